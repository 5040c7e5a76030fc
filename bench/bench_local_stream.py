"""An agent's batched stream against a bare predict loop, in one process, on any device.

What ``placement: agent`` runs for a ``batched`` scenario (``LocalRun`` over the
samples held pre-processed, one stream on the model's executor: ``Executor.stream``),
without the server, the bus or the database, so it runs on a machine that has only the
runtime and a GPU. For each case, alternated in each round (the order flips, the first
round warms up and is not kept):

- ``bare``: ``predictor.predict`` in a loop over pre-processed batches of the run's
  samples, on this thread, nothing else;
- ``stream``: the agent's local run of ``batched`` at the case's batch size, its
  throughput as the platform reports it (answered inputs over the time from the run's
  start to its last answer), and how much of that time the runtime was predicting
  (``stream_runtime_busy``: the sum of the predict spans over it; the rest is the
  platform's work between two predicts, which a machine's drift blurs less than a
  ratio of two runs). A model whose answers go to a thread of their own (predicts of
  1 ms or more) does its post-processing beside the predicts, so its share is near 1
  and what that thread takes from the runtime shows only in the ratio.

Then single-stream: the median latency of a local ``single-stream`` run against the
median of single bare calls. The process runs with the agent's GIL switch interval
(the agent sets it at start; a runtime that releases the GIL around a device sync waits
out the default 5 ms interval when any other thread is runnable).

The full-stack comparison (the agent process over the bus, against a bare loop in a
process of its own) is ``bench_placement.py --only batched``.

Usage: PYTHONPATH=. python bench/bench_local_stream.py --zoo DIR
       [--cases digits_cnn:pytorch:1,digits_cnn:pytorch:32] [--device cpu|cuda:0]
       [--rounds 3] [--seconds 1.5]
Prints one JSON line per case; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from agent.localrun import LocalRun
from agent.pipeline import Executor
from agent.samplelib import MemoryBudget, preprocess_all
from agent.service import AGENT_SWITCH_INTERVAL_S
from agent.worker import LoadedModel
from mlscope import samples
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.contracts import ScenarioSpec, TraceLevel
from mlscope.framework_manifest import FrameworkManifest
from mlscope.manifest_files import load_manifest
from mlscope.predictor import PredictorOptions

ROOT = Path(__file__).resolve().parent.parent

T = TypeVar("T")
DEFAULT_CASES = "digits_cnn:onnxruntime:32,digits_cnn:pytorch:1,digits_cnn:pytorch:32"


def apart(fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of its own that ends when it returns. Nothing here runs the
    model on the main thread: a runtime's OpenMP team belongs to the first thread that
    ran a parallel region and lives as long as it does, and a second live team (the
    executor's) would make both slow on a small machine (see ``agent.worker``). So the
    bare loop, like the agent's predict thread, is the only live team while it runs."""
    out: list[T] = []
    t = threading.Thread(target=lambda: out.append(fn()), name="bench-bare")
    t.start()
    t.join()
    if not out:
        raise RuntimeError("the bench thread failed (its traceback is above)")
    return out[0]


def agent_options(framework: str, device: str, batch: int) -> PredictorOptions:
    """How an agent with default settings opens a model of ``framework`` on ``device``:
    its framework manifest's runtime options (threads, providers)."""
    doc = load_manifest(ROOT / "manifests" / "frameworks" / f"{framework}.yaml")
    runtime = doc.runtime(device) if isinstance(doc, FrameworkManifest) else {}
    return PredictorOptions(device=device, batch_size=batch, runtime=runtime)


def bare_rate(model: LoadedModel, batches: list[np.ndarray], seconds: float) -> float:
    def loop() -> float:
        done, k, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            model.predictor.predict([batches[k % len(batches)]])
            done += len(batches[0])
            k += 1
        return done / (time.perf_counter() - t0)

    return apart(loop)


def local_run(model: LoadedModel, rows: np.ndarray, scenario: str, batch: int, s: float) -> Any:
    inputs, _ = samples.feed(rows, None, batch, 0)
    spec = ScenarioSpec(
        name=scenario, batch_size=batch, duration_s=s, min_duration_s=0, min_queries=1
    )
    ex = Executor(model)
    run = LocalRun(
        ex,
        spec,
        inputs=inputs,
        level=TraceLevel.NONE,
        spans=None,
        overloaded=lambda _i: "overloaded",
        preprocessed=True,
    )
    try:
        run.prepare()
        run.run()
    finally:
        ex.stop(close=False)  # the model serves the next round
    return run


def answered(run: Any) -> tuple[int, np.ndarray]:
    rec = run.rec
    n = int(rec.done)
    if not (rec.ok[:n] == 1).all():
        raise RuntimeError(f"{n - int((rec.ok[:n] == 1).sum())} queries failed: {rec.errors}")
    return n, rec.completed[:n]


def case(zoo: Path, text: str, device: str, rounds: int, seconds: float) -> dict[str, Any]:
    name, framework, b = text.split(":")
    batch = int(b)
    entry = Catalog.load(default_manifest_dirs()).find(name, framework=framework)
    model = LoadedModel.open(entry, entry.graph(zoo), agent_options(framework, device, batch))
    try:
        x, _ = samples.table(samples.dataset(entry, zoo), entry.manifest.inputs[0].shape, 0)
        rows = preprocess_all("bench", x, model, MemoryBudget(limit=2**34))
        if rows is None:
            raise SystemExit(f"{name}: its pre-processing does not run sample by sample")
        order, _ = samples.feed(rows, None, batch, 0)  # the run's own queries, cycled
        batches = [np.ascontiguousarray(order(i)) for i in range(8)]
        apart(lambda: [model.warmup() for _ in range(5)])
        got: dict[str, list[float]] = {"bare": [], "stream": []}
        busy: list[float] = []
        for r in range(1 + rounds):
            for who in ("bare", "stream") if r % 2 else ("stream", "bare"):
                if who == "bare":
                    got[who].append(bare_rate(model, batches, seconds))
                    continue
                run = local_run(model, rows, "batched", batch, seconds)
                if not run.streamed:
                    raise RuntimeError("the batched run did not stream")
                n, done_ns = answered(run)
                got[who].append(n * batch / (int(done_ns.max()) / 1e9))
                rec = run.rec
                busy.append(
                    float((rec.predict_end[:n] - rec.predict_start[:n]).sum()) / int(done_ns.max())
                )
        kept = {k: v[1:] for k, v in got.items()}
        single = local_run(model, rows, "single-stream", 1, seconds)
        n, done_ns = answered(single)
        lat = done_ns - single.rec.issued[:n]
        ones, _ = samples.feed(rows, None, 1, 0)
        one = [np.ascontiguousarray(ones(i)) for i in range(8)]

        def calls() -> list[int]:
            took = []
            for k in range(300):
                t = time.perf_counter_ns()
                model.predictor.predict([one[k % 8]])
                took.append(time.perf_counter_ns() - t)
            return took

        return {
            "case": text,
            "device": device,
            "inputs_per_s": kept,
            "median_ratio_to_bare": statistics.median(
                s / b for s, b in zip(kept["stream"], kept["bare"], strict=True)
            ),
            "stream_runtime_busy": statistics.median(busy[1:]),
            "single_stream_p50_us": float(np.median(lat)) / 1e3,
            "bare_call_p50_us": statistics.median(apart(calls)) / 1e3,
        }
    finally:
        model.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zoo", type=Path, required=True)
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.5)
    args = p.parse_args()
    sys.setswitchinterval(AGENT_SWITCH_INTERVAL_S)
    for text in args.cases.split(","):
        print(json.dumps(case(args.zoo, text, args.device, args.rounds, args.seconds)), flush=True)


if __name__ == "__main__":
    main()
