"""Load-generator benchmark against the noop agent on loopback, in one run.

1. The whole platform at --qps (default 1,000) Poisson for --duration s (default 30):
   issue lag p50/p99/min/max (min >= 0: never early), achieved / requested and
   achieved / scheduled rate, the verdict, and the latency the platform adds to a
   model: end-to-end from issue minus the agent's predict span ("overhead"), with
   the other parts of the latency split.
2. Maximum issue rate of one load-generator process: the real Driver (the pacer's
   thread writes each batch of due queries to the run's query link) with a schedule
   of --burst queries all due at once, sent to a subject nobody answers; rate =
   queries / time until the last one was written. Beside it, nats-py's raw publish
   rate of the same payload in a plain loop.
3. The served path against its floor, alternated over --rounds rounds (the order
   rotates from round to round; medians, and the median of per-round ratios):
   * ``echo``: a bare nats-py round trip through an echo process (another Python
     process that republishes each message to its reply subject) at --qps on a
     Poisson schedule: what any Python client and agent on this bus pay at least;
   * ``served``: the real Driver in this process against the noop agent (server
     placement, trace level none) at --qps Poisson for --served-s seconds:
     end-to-end minus the agent's predict span p50/p99, from the scheduled time and
     from the issue time; issue lag p50/p99; and the load generator's process CPU
     time per issued query (this process runs nothing else meanwhile), with the
     shares of the pacer's thread and the query link's reader in it (per-thread CPU
     from /proc, sampled every 0.1 s);
   * ``served-single``: the same Driver in a closed loop, one query in flight for
     --served-s seconds (single-stream): each query is sent when the previous answer
     arrives, so its round trip has no schedule to wait for.

4. The machine's wake-up floor, before and after the rest: one thread sleeping to
   deadlines 1 ms apart with libc's ``clock_nanosleep`` (through ctypes, the GIL
   released), at normal and at real-time priority: its thread CPU time per
   sleep-and-wake and how late each wake-up is (p50/p99). An open loop at 1,000 QPS
   wakes two threads a query (the pacer to send, the link's reader to stamp the
   reply), so twice the CPU per turn is the floor of its CPU per query on the machine.

Usage: PYTHONPATH=. python bench/bench_loadgen.py [--qps 1000] [--duration 30]
       [--rounds 5] [--served-s 10] [--only served]
Prints, asserts nothing.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

import broker.loadgen as loadgen
from broker.loadgen import Driver, encode_query
from cli.demo import wait_for_agent
from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.contracts import (
    JobRequest,
    PrepareOp,
    ReleaseOp,
    ScenarioSpec,
    TraceLevel,
    new_id,
)
from mlscope.jobs import submit
from mlscope.pacer import RealtimeThread
from mlscope.registry import list_agents
from mlscope.schedule import Schedule, poisson
from mlscope.settings import Settings
from mlscope.tuning import ProcessTuning

SINK = "bench.sink"


async def issue_rate(settings: Settings, n: int) -> float:
    """Queries/s issued by one Driver for n queries due at once: the pacer's thread
    writes each batch to the query link as it stamps it, so the last stamp is when the
    last query was handed to the socket."""
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
        rec = await driver.run()
        return n / (rec.issued.max() / 1e9 or 1e-9)


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


async def echo_rtt(settings: Settings, schedule: Schedule) -> dict[str, float]:
    """A bare nats-py round trip through an echo process, sent on ``schedule``: p50/p99 µs."""
    proc = await anyio.open_process([sys.executable, "-c", ECHO, settings.nats_url])
    offsets = schedule.offsets_ns
    try:
        assert proc.stdout is not None
        await proc.stdout.receive()  # "ready"
        payload = encode_query("ev-bench", 0, np.zeros((1, 16), np.float32), TraceLevel.NONE)
        sent = np.zeros(offsets.size, np.int64)
        rtt: list[int] = []
        async with busmod.connect(settings, name="bench-echo") as bus:
            all_back = anyio.Event()

            async def back(msg: Any) -> None:
                rtt.append(time.perf_counter_ns() - int(sent[int(msg.data[:8])]))
                if len(rtt) == offsets.size:
                    all_back.set()

            await bus.nc.subscribe("_INBOX.bench-echo", cb=back)
            cpu0 = time.process_time()
            t0 = time.perf_counter_ns() + 20_000_000
            for i, off in enumerate(offsets.tolist()):
                wait = (t0 + off - time.perf_counter_ns()) / 1e9
                if wait > 0:
                    await anyio.sleep(wait)
                sent[i] = time.perf_counter_ns()
                await bus.nc.publish("bench.echo", b"%08d" % i + payload, reply="_INBOX.bench-echo")
            with anyio.move_on_after(2):
                await all_back.wait()
            cpu = time.process_time() - cpu0
    finally:
        proc.kill()
        await proc.wait()
    p50, p99 = np.percentile(np.asarray(rtt) / 1e3, [50, 99])
    return {
        "rtt_p50_us": float(p50),
        "rtt_p99_us": float(p99),
        "cpu_us_per_msg": cpu / offsets.size * 1e6,
        "n": len(rtt),
    }


class ThreadCPU:
    """CPU time of this process's threads by name (``/proc/self/task/*/schedstat``),
    sampled every ``every_s`` while a run goes on: the last sample of a thread that ended
    meanwhile stands for its total (short by at most ``every_s`` of its life). The
    sampler's own thread is left out."""

    def __init__(self, every_s: float = 0.1) -> None:
        self.every_s = every_s
        self._base: dict[int, int] = {}
        self._last: dict[int, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-thread-cpu", daemon=True)

    @staticmethod
    def _read() -> dict[int, int]:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as fh:
                    out[int(tid)] = int(fh.read().split()[0])
            except (OSError, ValueError, IndexError):  # the thread ended meanwhile
                continue
        return out

    def _sample(self) -> None:
        names = {t.native_id: t.name for t in threading.enumerate()}
        for tid, ns in self._read().items():
            name = names.get(tid) or self._last.get(tid, ("other", 0))[0]
            self._last[tid] = (name, ns)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def __enter__(self) -> ThreadCPU:
        self._base = self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def per_thread_ns(self) -> dict[str, int]:
        """CPU ns used during the run, summed by thread name (sampler left out)."""
        used: dict[str, int] = {}
        for tid, (name, ns) in self._last.items():
            if name != self._thread.name:
                used[name] = used.get(name, 0) + ns - self._base.get(tid, 0)
        return used


async def _noop_agent(bus: busmod.Bus) -> str:
    agents = await list_agents(bus)
    return next(a.agent_id for a in agents if any(f.name == "noop" for f in a.frameworks))


async def served(
    settings: Settings, schedule: Schedule | None, qps: float, seconds: float = 1.0
) -> dict[str, float]:
    """The real Driver against the noop agent (server placement): what the bus adds.
    ``schedule`` None: a closed loop, one query in flight for ``seconds``."""
    evaluation_id = new_id("ev")
    x = np.zeros((1, 16), np.float32)
    async with busmod.connect(settings, name="bench-served") as bus:
        agent_id = await _noop_agent(bus)
        ctl = names.agent_ctl(agent_id)
        prepare = PrepareOp(
            evaluation_id=evaluation_id, model="noop", model_version="1.0.0", trace_level="none"
        )
        await busmod.request(bus, ctl, codec.encode_model(prepare), timeout=60)
        try:
            driver = Driver(
                bus,
                evaluation_id=evaluation_id,
                subject=names.agent_query(agent_id),
                spec=ScenarioSpec(name="online", qps=qps, duration_s=1)
                if schedule is not None
                else ScenarioSpec(name="single-stream", duration_s=seconds),
                inputs=lambda g: x,
                labels=None,
                trace_level=TraceLevel.NONE,
                schedule=schedule,
                tuning=ProcessTuning(),
            )
            with ThreadCPU() as threads:
                rec = await driver.run()
        finally:
            release = codec.encode_model(ReleaseOp(evaluation_id=evaluation_id))
            await busmod.request(bus, ctl, release, timeout=10)
    return _served_figures(rec, threads.per_thread_ns())


def _served_figures(rec: Any, threads: dict[str, int]) -> dict[str, float]:
    ok = rec.ok.astype(bool)
    issued = rec.issued > 0
    predict = (rec.predict_end - rec.predict_start)[ok]
    from_sched = (rec.completed - rec.scheduled)[ok] - predict
    from_issue = (rec.completed - rec.issued)[ok] - predict
    lag = (rec.issued - rec.scheduled)[issued]
    q = [50, 99]
    s50, s99 = np.percentile(from_sched / 1e3, q)
    i50, i99 = np.percentile(from_issue / 1e3, q)
    l50, l99 = np.percentile(lag / 1e3, q)
    return {
        "bus_p50_us": float(s50),
        "bus_p99_us": float(s99),
        "bus_from_issue_p50_us": float(i50),
        "bus_from_issue_p99_us": float(i99),
        "lag_p50_us": float(l50),
        "lag_p99_us": float(l99),
        "lag_min_us": float(lag.min() / 1e3),
        "cpu_us_per_query": rec.cpu_s / max(int(issued.sum()), 1) * 1e6,
        # Where that CPU goes: the pacer's thread (sleep, spin, send), the query link's
        # reader (wake, parse, decode, stamp), and the event loop with the rest.
        "cpu_pacer_us": threads.get("mlscope-pacer", 0) / max(int(issued.sum()), 1) / 1e3,
        "cpu_reader_us": threads.get("mlscope-replies", 0) / max(int(issued.sum()), 1) / 1e3,
        "ok": int(ok.sum()),
        "n": rec.n,
    }


def ab_rounds(live: Settings, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    """Echo floor and served path, alternated; the order rotates each round."""
    paths = ["echo", "served", "served-single"]
    out: dict[str, list[dict[str, float]]] = {p: [] for p in paths}
    for r in range(args.rounds):
        sched = poisson(args.qps, duration_s=args.served_s, seed=r)
        for k in range(len(paths)):
            path = paths[(k + r) % len(paths)]
            if path == "echo":
                res = anyio.run(echo_rtt, live, sched)
            elif path == "served":
                res = anyio.run(served, live, sched, args.qps)
            else:
                res = anyio.run(served, live, None, args.qps, args.served_s)
            res["load"] = os.getloadavg()[0]
            out[path].append(res)
            print(f"   round {r} {path:<14} " + _line(res), flush=True)
    return out


def _line(res: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.1f}" for k, v in res.items())


def report_ab(out: dict[str, list[dict[str, float]]]) -> None:
    echo = [r["rtt_p50_us"] for r in out["echo"]]
    print(f"3. echo round trip p50 us: median {np.median(echo):.0f}  per round {echo}")
    for path in [p for p in out if p != "echo"]:
        rounds = out[path]
        med = {k: float(np.median([r[k] for r in rounds])) for k in rounds[0]}
        ratio = [r["bus_p50_us"] / e for r, e in zip(rounds, echo, strict=True)]
        ratio_i = [r["bus_from_issue_p50_us"] / e for r, e in zip(rounds, echo, strict=True)]
        print(f"   {path}: medians " + _line(med))
        print(
            f"   {path}: (end-to-end - predict) p50 / echo p50, per round "
            f"{[round(x, 2) for x in ratio]} median {np.median(ratio):.2f}; "
            f"from issue {np.median(ratio_i):.2f}"
        )


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def wake_floor(*, realtime: bool, turns: int = 3000, gap_ns: int = 1_000_000) -> dict[str, float]:
    """One thread's sleep-and-wake to deadlines ``gap_ns`` apart, in C: its CPU time
    per turn and each wake-up's lateness (see the module doc, 4)."""
    libc = ctypes.CDLL(None, use_errno=True)
    clock_monotonic, timer_abstime = 1, 1  # <time.h>; perf_counter_ns is CLOCK_MONOTONIC
    late = np.zeros(turns, np.int64)
    cpu = [0]

    def run() -> None:
        priority = RealtimeThread(enable=realtime)
        try:
            ts = _Timespec()
            cpu0 = time.thread_time_ns()
            due = time.perf_counter_ns() + gap_ns
            for i in range(turns):
                ts.tv_sec, ts.tv_nsec = divmod(due, 1_000_000_000)
                libc.clock_nanosleep(clock_monotonic, timer_abstime, ctypes.byref(ts), None)
                late[i] = time.perf_counter_ns() - due
                due += gap_ns
            cpu[0] = time.thread_time_ns() - cpu0
        finally:
            priority.restore()

    thread = threading.Thread(target=run, name="wake-floor")
    thread.start()
    thread.join()
    p50, p99 = np.percentile(late / 1e3, [50, 99])
    return {"cpu_us_per_turn": cpu[0] / turns / 1e3, "late_p50_us": p50, "late_p99_us": p99}


def report_floor(when: str) -> None:
    for realtime in (False, True):
        f = wake_floor(realtime=realtime)
        print(
            f"4. wake-up floor ({when}, {'real-time' if realtime else 'normal'} priority): "
            f"CPU {f['cpu_us_per_turn']:.1f} us per sleep-and-wake (x2 = "
            f"{2 * f['cpu_us_per_turn']:.1f} us per query), late p50 {f['late_p50_us']:.1f} "
            f"us, p99 {f['late_p99_us']:.1f} us",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--qps", type=float, default=1000)
    ap.add_argument("--duration", type=float, default=30)
    ap.add_argument("--burst", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--served-s", type=float, default=10)
    ap.add_argument("--only", choices=["served"], default=None)
    args = ap.parse_args()
    data = Path(tempfile.mkdtemp(prefix="mlscope-bench-lg-"))
    stack = Stack(Settings(data_dir=data), nats_port=0, frameworks=["noop"])
    live = stack.start()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    report_floor("before")
    try:
        anyio.run(wait_for_agent, live, "noop")
        ab = ab_rounds(live, args)
        if args.only is None:
            s = anyio.run(
                lambda: submit(
                    live,
                    JobRequest(
                        model="noop",
                        framework="noop",
                        trace_level="none",
                        scenario=ScenarioSpec(
                            name="online", qps=args.qps, duration_s=args.duration
                        ),
                    ),
                )
            )
            lg = anyio.run(issue_rate, live, args.burst)
            raw = anyio.run(raw_publish_rate, live, args.burst)
        report_floor("after")
    finally:
        stack.stop()
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    report_ab(ab)
    if args.only is None:
        report_platform(s, args)
        print(
            f"2. one load-generator process, {args.burst:,} queries due at once: "
            f"{lg:,.0f} queries/s written to the query link; "
            f"nats-py raw publish {raw:,.0f} msgs/s; ratio {lg / raw:.2f}"
        )


def report_platform(s: Any, args: argparse.Namespace) -> None:
    lag, split = s.issue_lag_us, s.latency_split_ms or {}
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
    print(f"   loadgen cost: {s.loadgen_cost}")
    for name, v in split.items():
        print(
            f"   split {name:<10} p50 {v['p50']:.3f} ms  p99 {v['p99']:.3f} ms  "
            f"mean {v['mean']:.3f} ms"
        )


if __name__ == "__main__":
    main()
