"""MLPerf LoadGen on the server's host (placement server) against LoadGen next to the
model (placement agent), in one run.

``digits_cnn`` on ONNX Runtime through ``mlscope mlperf``: Offline (LoadGen's samples/s,
``--batch-size`` samples per agent query) and Server at ``--qps`` (LoadGen's p50 / p99),
each with both placements; the two placements alternate in each round (the order
rotates), so both see the same background load; medians over rounds. Runs are kept
short with a user.conf (Offline ``--seconds``, Server ``--seconds``; LoadGen's own
verdict is printed, not asserted).

Usage: PYTHONPATH=. python bench/bench_mlperf.py [--zoo DIR] [--rounds 3] [--seconds 3]
       [--qps 200] [--offline-qps 200000] [--scenarios Offline,Server]
       [--placements server,agent]
Prints one JSON document; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import anyio

from cli.demo import wait_for_agent
from cli.mlperf_cmd import run_mlperf
from cli.stack import Stack
from mlscope.contracts import JobRequest, MLPerfSpec, Placement
from mlscope.settings import Settings

MODEL, FRAMEWORK = "digits_cnn", "onnxruntime"
ROOT = Path(__file__).resolve().parent.parent


def user_conf(seconds: float) -> str:
    ms = int(seconds * 1000)
    return (
        f"*.Offline.min_duration = {ms}\n*.Offline.min_query_count = 1\n"
        f"*.Server.min_duration = {ms}\n*.Server.min_query_count = 100\n"
        "*.Server.target_latency = 1000\n"
    )


def one(settings: Settings, placement: Placement, spec: MLPerfSpec) -> dict[str, Any]:
    job = JobRequest(
        model=MODEL, framework=FRAMEWORK, trace_level="none", mlperf=spec, placement=placement
    )
    s, _ = anyio.run(run_mlperf, settings, job, backend="asyncio")
    return {
        "valid": s.valid,
        "samples_per_s": s.achieved_qps,
        "p50_ms": s.latency_ms.p50,
        "p99_ms": s.latency_ms.p99,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zoo", type=Path, default=Path(os.environ.get("MLSCOPE_TEST_ZOO", "")))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--qps", type=float, default=200.0)
    ap.add_argument("--offline-qps", type=float, default=200_000.0)
    ap.add_argument("--scenarios", default="Offline,Server", help="comma-separated")
    ap.add_argument("--placements", default="server,agent", help="comma-separated")
    args = ap.parse_args()
    data = Path(tempfile.mkdtemp(prefix="mlscope-bench-mlperf-"))  # fresh: never ~/.mlscope
    (data / "zoo").symlink_to(args.zoo.resolve(), target_is_directory=True)
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    stack = Stack(Settings(data_dir=data), nats_port=0, frameworks=[FRAMEWORK])
    live = stack.start()
    conf = user_conf(args.seconds)
    specs = {
        "Offline": MLPerfSpec(scenario="Offline", target_qps=args.offline_qps, user_conf=conf),
        "Server": MLPerfSpec(scenario="Server", target_qps=args.qps, user_conf=conf, seed=7),
    }
    specs = {sc: spec for sc, spec in specs.items() if sc in args.scenarios.split(",")}
    placements: tuple[Placement, ...] = ("server", "agent")
    both = [p for p in placements if p in args.placements.split(",")]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {sc: {p: [] for p in both} for sc in specs}
    try:
        anyio.run(wait_for_agent, live, FRAMEWORK)
        for r in range(args.rounds):
            order = both if r % 2 == 0 else both[::-1]
            for sc, spec in specs.items():
                for placement in order:
                    runs[sc][placement].append(one(live, placement, spec))
    finally:
        stack.stop()
    out: dict[str, Any] = {"load_average": os.getloadavg(), "rounds": args.rounds}
    for sc, by in runs.items():
        out[sc] = {
            p: {
                k: statistics.median(float(x[k]) for x in rs if x[k] is not None)
                for k in ("samples_per_s", "p50_ms", "p99_ms")
            }
            | {"valid": sum(bool(x["valid"]) for x in rs)}
            for p, rs in by.items()
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
