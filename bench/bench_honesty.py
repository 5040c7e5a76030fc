"""Are the reported numbers the real ones? Four checks, in one run.

1. compute vs bare: the ``compute`` (predict span) mean of a single-stream run of
   efficientnet_lite0 through the platform, against a bare ``predictor.predict`` loop
   of the same file in a process of its own (bench_pipeline's BareProcess), for ONNX
   Runtime and TFLite, alternated in rounds (bare slice, then a platform run); the
   median of the per-round ratios. Goal: within 5 %.
2. layer sum vs predict at each trace level (efficientnet_lite0, ORT, through a real
   executor): the predict span's median per level (what tracing adds to it), the
   median share of the predict span covered by the query's layer spans, and the
   profiler's own start/stop cost kept out of the span (``profiler_ns``).
3. issue lag vs publish time: a Driver at ``--qps`` against the noop agent while a
   separate process subscribed to the agent's query subject stamps every query's
   arrival (CLOCK_MONOTONIC, shared by processes of one host). The reported issue lag
   (issued = handed to the bus client) and its pacer / loop parts, against schedule ->
   arrival at the subscriber (issue lag plus one nats-server hop).
4. load generator CPU per query: the Driver process's CPU time over issued queries at
   200 and ``--qps`` QPS (constant schedule), and whether it shares the agent's host.

Usage: PYTHONPATH=. python bench/bench_honesty.py [--zoo DIR] [--qps 1000] [--seconds 10]
Prints, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from bench.bench_pipeline import BareProcess
from broker.loadgen import Driver
from broker.summary import figures
from cli.demo import wait_for_agent
from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.contracts import JobRequest, ScenarioSpec, TraceLevel
from mlscope.jobs import submit
from mlscope.registry import list_agents
from mlscope.schedule import constant
from mlscope.settings import Settings
from mlscope.tuning import ProcessTuning

MODEL = "efficientnet_lite0"


def stack(zoo: Path, frameworks: list[str]) -> tuple[Stack, Settings]:
    data = Path(tempfile.mkdtemp(prefix="mlscope-bench-honesty-"))
    (data / "zoo").symlink_to(zoo, target_is_directory=True)
    s = Stack(Settings(data_dir=data), nats_port=0, frameworks=frameworks)
    live = s.start()
    for fw in frameworks:
        anyio.run(wait_for_agent, live, fw)
    return s, live


def compute_vs_bare(zoo: Path, seconds: float, rounds: int = 3) -> None:
    s, live = stack(zoo, ["onnxruntime", "tflite"])
    try:
        for fw in ("onnxruntime", "tflite"):
            bare = BareProcess(fw, zoo, 1, _threads(fw))
            ratios, pairs = [], []
            for _ in range(rounds):  # alternated, so both see the same background load
                bare_ms = 1e3 / bare.rate(seconds / rounds)
                summ = anyio.run(
                    submit,
                    live,
                    JobRequest(
                        model=MODEL,
                        framework=fw,
                        trace_level="none",
                        scenario=ScenarioSpec(
                            name="single-stream", duration_s=seconds / rounds, min_duration_s=0
                        ),
                    ),
                )
                comp = (summ.latency_split_ms or {})["compute"]["mean"] or float("nan")
                ratios.append(comp / bare_ms)
                pairs.append(f"{comp:.3f}/{bare_ms:.3f}")
            bare.close()
            print(
                f"1. {fw}: compute mean / bare mean per round (ms) {', '.join(pairs)}: "
                f"ratio median {statistics.median(ratios):.3f} "
                f"({', '.join(f'{r:.3f}' for r in ratios)})"
            )
    finally:
        s.stop()


def _threads(framework: str) -> int | None:
    """The agent's thread count for ``framework`` (its framework manifest's), so the
    bare loop runs the model the same way."""
    from mlscope.framework_manifest import FrameworkManifest
    from mlscope.manifest_files import load_manifest

    doc = load_manifest(
        Path(__file__).resolve().parent.parent / "manifests" / "frameworks" / f"{framework}.yaml"
    )
    threads = doc.options.intra_op_threads if isinstance(doc, FrameworkManifest) else None
    return threads or None


def layers_per_level(zoo: Path, queries: int) -> None:
    from tests.tracing_fixtures import open_model, run_queries

    model = open_model(zoo, MODEL, "onnxruntime")
    model.warmup()
    rows_by = {lvl: [] for lvl in ("model", "framework", "full")}  # type: dict[str, list[Any]]
    for _ in range(3):  # rounds, so that machine noise hits every level alike
        for lvl in rows_by:
            rows_by[lvl] += run_queries(
                model, TraceLevel.parse(lvl), queries // 3, first_index=len(rows_by[lvl])
            )
    base = None
    for lvl, rows in rows_by.items():
        pred = [r for r in rows if r["name"] == "predict"]
        span = statistics.median(r["end_ns"] - r["start_ns"] for r in pred) / 1e6
        base = base or span
        line = f"2. level {lvl:<9} predict p50 {span:.3f} ms (x{span / base:.2f} of model)"
        if lvl != "model":
            share = []
            for p in pred:
                kids = [r for r in rows if r["kind"] == "layer" and r["parent_id"] == p["span_id"]]
                share.append(
                    sum(r["end_ns"] - r["start_ns"] for r in kids) / (p["end_ns"] - p["start_ns"])
                )
            cost = [json.loads(p["attrs"]).get("profiler_ns", 0) / 1e3 for p in pred]
            line += (
                f"; layer sum / predict p50 {statistics.median(share):.3f} "
                f"(min {min(share):.3f}); profiler start/stop p50 "
                f"{statistics.median(cost):.0f} us, first {max(cost) / 1e3:.1f} ms"
            )
        print(line)
    model.predictor.close()


SUBSCRIBER = textwrap.dedent("""
    import asyncio, sys, time, json
    import nats
    from mlscope import codec
    async def main():
        nc = await nats.connect(sys.argv[1])
        got = {}
        async def cb(msg):
            got[int(codec.decode(msg.data)["index"])] = time.perf_counter_ns()
        await nc.subscribe(sys.argv[2], cb=cb)
        await nc.flush()
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        print(json.dumps(got), flush=True)
        await nc.close()
    asyncio.run(main())
""")


async def _drive(settings: Settings, qps: float, seconds: float) -> Any:
    async with busmod.connect(settings, name="bench-honesty") as bus:
        agent = next(
            a for a in await list_agents(bus) if any(f.name == "noop" for f in a.frameworks)
        )
        await busmod.request(
            bus,
            names.agent_ctl(agent.agent_id),
            codec.encode(
                {
                    "op": "prepare",
                    "evaluation_id": "ev-honesty",
                    "model": "noop",
                    "model_version": "1.0.0",
                    "batch_size": 1,
                    "trace_level": "none",
                }
            ),
            timeout=60,
        )
        sched = constant(qps, duration_s=seconds)
        driver = Driver(
            bus,
            evaluation_id="ev-honesty",
            subject=names.agent_query(agent.agent_id),
            spec=ScenarioSpec(name="constant", qps=qps, duration_s=seconds),
            inputs=lambda g: np.zeros((1, 4), np.float32),
            labels=None,
            trace_level=TraceLevel.NONE,
            schedule=sched,
            tuning=ProcessTuning(),
        )
        return await driver.run(), agent.host


def lag_and_cost(qps: float, seconds: float) -> None:
    s = Stack(
        Settings(data_dir=Path(tempfile.mkdtemp(prefix="mlscope-bench-lag-"))),
        nats_port=0,
        frameworks=["noop"],
    )
    live = s.start()
    try:
        anyio.run(wait_for_agent, live, "noop")
        for rate in (200.0, qps):
            sub = subprocess.Popen(
                [sys.executable, "-c", SUBSCRIBER, live.nats_url, "mlscope.agent.*.query"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={**os.environ},
            )
            assert sub.stdin is not None and sub.stdout is not None
            sub.stdout.readline()
            rec, host = anyio.run(_drive, live, rate, seconds)
            sub.stdin.write("\n")
            sub.stdin.flush()
            arrived = json.loads(sub.stdout.readline())
            sub.wait(10)
            f = figures(rec, has_labels=False)
            idx = np.asarray([int(k) for k in arrived], np.int64)
            at = np.asarray(list(arrived.values()), np.int64) - rec.t0_ns
            to_sub = (at - rec.scheduled[idx]) / 1e3
            hop = (at - rec.issued[idx]) / 1e3
            lag, split = f.issue_lag_us, f.issue_lag_split_us
            print(
                f"3. {rate:g} QPS constant x {seconds:g} s: issue lag p50/p99 "
                f"{lag['p50']:.1f}/{lag['p99']:.1f} us (pacer p99 "
                f"{split['pacer']['p99']:.1f}, loop p99 {split['loop']['p99']:.1f}); "
                f"schedule -> subscriber p50/p99 {np.percentile(to_sub, 50):.1f}/"
                f"{np.percentile(to_sub, 99):.1f} us; issued -> subscriber p50 "
                f"{np.percentile(hop, 50):.1f} us ({len(idx)} of {rec.n} seen)"
            )
            print(
                f"4. {rate:g} QPS: load generator {f.loadgen_cpu_us_per_query:.0f} us CPU "
                f"per query ({(f.loadgen_cpu_us_per_query or 0) * rate / 1e6:.0%} of a "
                f"core), agent host {host} = load generator host: "
                f"{host == os.uname().nodename}, {os.cpu_count()} cores"
            )
    finally:
        s.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--zoo", type=Path, default=Path(os.environ.get("MLSCOPE_TEST_ZOO", "/work/zoo"))
    )
    ap.add_argument("--qps", type=float, default=1000)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--queries", type=int, default=60)
    ap.add_argument("--only", choices=["compute", "layers", "lag"], default=None)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    if args.only in (None, "compute"):
        compute_vs_bare(args.zoo, args.seconds)
    if args.only in (None, "layers"):
        layers_per_level(args.zoo, args.queries)
    if args.only in (None, "lag"):
        lag_and_cost(args.qps, args.seconds)


if __name__ == "__main__":
    main()
