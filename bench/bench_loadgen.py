"""Load-generator benchmark against the noop agent on loopback, in one run.

1. The whole platform at --qps (default 1,000) Poisson for --duration s (default 30):
   issue lag p50/p99/min/max (min >= 0: never early), achieved / requested and
   achieved / scheduled rate, the verdict, and the latency the platform adds to a
   model: end-to-end from issue minus the agent's predict span ("overhead"), with
   the other parts of the latency split.
2. Maximum issue rate of one load-generator process: the real Driver (pacer thread,
   one hop per batch to the event loop, nats-py publish) with a schedule of --burst
   queries all due at once, sent to a subject nobody answers; rate = queries / time
   until the last one left nats-py. Beside it, nats-py's raw publish rate of the same
   payload in a plain loop on the same connection type.
3. The floor under the bus-added latency: a bare nats-py echo (another Python process
   that republishes each message to its reply subject) at 1,000 messages/s, round
   trip p50/p99: what any Python client and agent on this bus pay at least.

Usage: PYTHONPATH=. python bench/bench_loadgen.py [--qps 1000] [--duration 30]
Prints, asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

import broker.loadgen as loadgen
from broker.loadgen import Driver, encode_query
from broker.schedule import Schedule
from broker.tuning import ProcessTuning
from cli.demo import wait_for_agent
from cli.services import Stack
from mlscope import bus as busmod
from mlscope.contracts import JobRequest, ScenarioSpec, TraceLevel
from mlscope.jobs import submit
from mlscope.settings import Settings

SINK = "bench.sink"


async def issue_rate(settings: Settings, n: int) -> tuple[float, float]:
    """(queries/s issued by one Driver, pacer-side queries/s) for n queries due at once."""
    loadgen.DRAIN_TIMEOUT_S = 0.2  # nobody answers the sink: do not wait for replies
    x = np.zeros((1, 16), np.float32)
    async with busmod.connect(settings, name="bench-lg") as bus:
        spec = ScenarioSpec(name="online", qps=1e6, duration_s=1, max_outstanding=n)
        driver = Driver(
            bus,
            evaluation_id="ev-bench",
            subject=SINK,
            spec=spec,
            inputs=lambda i: x,
            labels=None,
            trace_level=TraceLevel.NONE,
            schedule=Schedule(np.zeros(n, np.int64)),
            tuning=ProcessTuning(),
        )
        publish = bus.nc.publish
        done_at: list[int] = []

        async def counted(*a: Any, **kw: Any) -> None:  # notes when the n-th query left
            await publish(*a, **kw)
            if bus.nc.stats["out_msgs"] - base == n:
                done_at.append(time.perf_counter_ns())

        base = bus.nc.stats["out_msgs"]
        bus.nc.publish = counted  # type: ignore[method-assign]
        rec = await driver.run()
        await bus.nc.flush()
        sent = (done_at[0] - rec.t0_ns) / 1e9
        paced = rec.issued.max() / 1e9 or 1e-9
        return n / sent, n / paced


async def raw_publish_rate(settings: Settings, n: int) -> float:
    """nats-py publish in a loop (the same payload), then flush: messages/s."""
    payload = encode_query("ev-bench", 0, np.zeros((1, 16), np.float32), TraceLevel.NONE)
    async with busmod.connect(settings, name="bench-raw") as bus:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            await bus.nc.publish(SINK, payload, reply="_INBOX.bench")
        await bus.nc.flush()
        return n / ((time.perf_counter_ns() - t0) / 1e9)


ECHO = """
import asyncio, sys
import nats
async def main():
    nc = await nats.connect(sys.argv[1])
    async def echo(m):
        await nc.publish(m.reply, m.data)
    await nc.subscribe("bench.echo", cb=echo)
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


async def echo_rtt(settings: Settings, n: int = 5000) -> tuple[float, float]:
    """(p50, p99) µs of a bare nats-py round trip through an echo process, 1,000/s."""
    proc = await anyio.open_process([sys.executable, "-c", ECHO, settings.nats_url])
    try:
        assert proc.stdout is not None
        await proc.stdout.receive()  # "ready"
        payload = encode_query("ev-bench", 0, np.zeros((1, 16), np.float32), TraceLevel.NONE)
        sent = np.zeros(n, np.int64)
        rtt: list[int] = []
        async with busmod.connect(settings, name="bench-echo") as bus:

            async def back(msg: Any) -> None:
                rtt.append(time.perf_counter_ns() - int(sent[int(msg.data[:8])]))

            await bus.nc.subscribe("_INBOX.bench-echo", cb=back)
            for i in range(n):
                sent[i] = time.perf_counter_ns()
                await bus.nc.publish("bench.echo", b"%08d" % i + payload, reply="_INBOX.bench-echo")
                await anyio.sleep(0.001)
            await anyio.sleep(0.5)
    finally:
        proc.kill()
        await proc.wait()
    p50, p99 = np.percentile(np.asarray(rtt) / 1e3, [50, 99])
    return float(p50), float(p99)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--qps", type=float, default=1000)
    ap.add_argument("--duration", type=float, default=30)
    ap.add_argument("--burst", type=int, default=100_000)
    args = ap.parse_args()
    data = Path(tempfile.mkdtemp(prefix="mlscope-bench-lg-"))
    stack = Stack(Settings(data_dir=data), nats_port=0, frameworks=["noop"])
    live = stack.start()
    try:
        anyio.run(wait_for_agent, live, "noop")
        s = anyio.run(
            lambda: submit(
                live,
                JobRequest(
                    model="noop",
                    framework="noop",
                    trace_level="none",
                    scenario=ScenarioSpec(name="online", qps=args.qps, duration_s=args.duration),
                ),
            )
        )
        lg, paced = anyio.run(issue_rate, live, args.burst)
        raw = anyio.run(raw_publish_rate, live, args.burst)
        echo50, echo99 = anyio.run(echo_rtt, live)
    finally:
        stack.stop()

    lag, split = s.issue_lag_us, s.latency_split_ms or {}
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(
        f"1. noop online @ {args.qps:g} QPS Poisson x {args.duration:g} s "
        f"({s.queries} queries): {'VALID' if s.valid else 'INVALID ' + str(s.invalid_reasons)}"
    )
    print(f"   issue lag us: p50 {lag['p50']:.1f}  p99 {lag['p99']:.1f}  max {lag['max']:.1f}")
    achieved, scheduled = s.achieved_qps or 0.0, s.scheduled_qps or float("nan")
    print(
        f"   rate: requested {s.requested_qps:g}  scheduled {scheduled:.1f}  achieved "
        f"{achieved:.1f}  achieved/scheduled {achieved / scheduled:.5f}"
        f"  achieved/requested {achieved / args.qps:.4f}"
    )
    print(f"   latency ms: p50 {s.latency_ms.p50:.3f}  p99 {s.latency_ms.p99:.3f}")
    for name, v in split.items():
        print(
            f"   split {name:<10} p50 {v['p50']:.3f} ms  p99 {v['p99']:.3f} ms  "
            f"mean {v['mean']:.3f} ms"
        )
    print(
        f"2. one load-generator process, {args.burst:,} queries due at once: "
        f"{lg:,.0f} queries/s published (pacer alone {paced:,.0f}/s); "
        f"nats-py raw publish {raw:,.0f} msgs/s; ratio {lg / raw:.2f}"
    )
    print(
        f"3. bare nats-py echo round trip at 1,000/s: p50 {echo50:.0f} us  p99 {echo99:.0f} us"
        f"  (platform overhead p50 {(split['overhead']['p50'] or float('nan')) * 1e3:.0f} us)"
    )


if __name__ == "__main__":
    main()
