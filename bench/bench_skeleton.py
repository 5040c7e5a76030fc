"""Walking-skeleton benchmark: measured in one run, printed as medians and ratios.

1. Open-loop pacing through the whole platform: digits_cnn online at --qps for
   --duration s, issue lag p50/p99/max and achieved vs requested/scheduled rate.
2. Batched throughput of digits_cnn through the agent vs a bare onnxruntime loop on
   the same file, same batch size, same thread settings: the ratio platform / bare.

Usage: python bench/bench_skeleton.py [--qps 500] [--duration 10] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import anyio
import numpy as np

from cli.demo import wait_for_agent
from cli.stack import Stack
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.contracts import JobRequest, ScenarioSpec
from mlscope.jobs import submit
from mlscope.settings import Settings
from mlscope.zoo.build import build


def bare_loop(graph: Path, x: np.ndarray, batch: int, seconds: float) -> float:
    """Inputs/s of session.run over the same pre-processed batches, no platform."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(graph), sess_options=so, providers=["CPUExecutionProvider"])
    batches = [
        (x[i : i + batch].astype(np.float32) / 16.0)[:, None]
        for i in range(0, len(x) - batch, batch)
    ]
    for b in batches[:10]:
        sess.run(None, {"input": b})
    done, n, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sess.run(None, {"input": batches[n % len(batches)]})
        done += batch
        n += 1
    return done / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--qps", type=float, default=500)
    ap.add_argument("--duration", type=float, default=10)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    data = Path(tempfile.mkdtemp(prefix="mlscope-bench-"))
    settings = Settings(data_dir=data)
    build(settings.zoo_dir, only=["digits_cnn"], log=lambda _: None)
    entry = Catalog.load(default_manifest_dirs()).find("digits_cnn", framework="onnxruntime")
    graph = entry.graph(settings.zoo_dir)
    with np.load(entry.dataset(settings.zoo_dir)) as npz:  # type: ignore[arg-type]
        x = npz["x"]
    stack = Stack(settings, nats_port=0, frameworks=["onnxruntime"])
    live = stack.start()
    try:
        anyio.run(wait_for_agent, live, "onnxruntime")
        online = [
            anyio.run(
                submit,
                live,
                JobRequest(
                    model="digits_cnn",
                    framework="onnxruntime",
                    trace_level="model",
                    scenario=ScenarioSpec(
                        name="online", qps=args.qps, duration_s=args.duration, seed=seed
                    ),
                ),
            )
            for seed in range(args.repeats)
        ]
        platform, bare = [], []
        for _ in range(args.repeats):
            s = anyio.run(
                lambda: submit(
                    live,
                    JobRequest(
                        model="digits_cnn",
                        framework="onnxruntime",
                        trace_level="model",
                        scenario=ScenarioSpec(
                            name="batched", batch_size=args.batch_size, duration_s=args.duration
                        ),
                    ),
                )
            )
            platform.append(s.throughput_ips or 0.0)
            bare.append(bare_loop(graph, x, args.batch_size, args.duration))
    finally:
        stack.stop()

    def _ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def med(values: Iterable[float | None]) -> float:
        """The median of the figures a run has (NaN when none has it)."""
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else float("nan")

    print(
        f"online digits_cnn @ {args.qps:g} QPS x {args.duration:g} s, {args.repeats} runs "
        "(median of runs)"
    )
    print(
        f"  issue lag p50 {med(r.issue_lag_us['p50'] for r in online):.1f} us  "
        f"p99 {med(r.issue_lag_us['p99'] for r in online):.1f} us  "
        f"max {med(r.issue_lag_us['max'] for r in online):.1f} us"
    )
    print(
        f"  achieved {med(r.achieved_qps for r in online):.1f} QPS  scheduled "
        f"{med(r.scheduled_qps for r in online):.1f}  requested {args.qps:g}  "
        f"achieved/scheduled {med(_ratio(r.achieved_qps, r.scheduled_qps) for r in online):.4f}"
    )
    print(
        f"  latency p50 {med(r.latency_ms.p50 for r in online):.3f} ms  "
        f"p99 {med(r.latency_ms.p99 for r in online):.3f} ms  valid "
        f"{sum(r.valid for r in online)}/{len(online)}"
    )
    print(f"batched digits_cnn, batch {args.batch_size}, {args.duration:g} s x {args.repeats}")
    print(
        f"  platform {med(platform):,.0f} inputs/s  bare onnxruntime {med(bare):,.0f} "
        f"inputs/s  ratio {med(p / b for p, b in zip(platform, bare, strict=True)):.3f}"
    )


if __name__ == "__main__":
    main()
