"""Reading speed of analysis: `mlscope report` of 20 evaluations and `mlscope report
--suite`, as rows the suite never shows grow.

    PYTHONPATH=$PWD python bench/bench_report.py [--runs 5] [--unrelated 400000,1000000,2000000]

A real stack: nats-server and `mlscope server` owning chDB in a fresh data directory
(no agents: nothing is run). 20 evaluations are stored with realistic rows: 4 model /
framework pairs x (one online run + batched runs at batch 1, 2, 4, 8), 5,000 queries
each, 4 model-level spans per query, and layer spans (8 per query) on two of them.
Unrelated rows are then added in steps: evaluations the suite never shows (older runs
of the same keys and runs of another model), 5,000 queries + 20,000 spans each. The
rows are inserted straight into chDB by a child process while the server is stopped
(chDB allows one process per data directory), then the stack starts again.

At each step it times the commands a user runs, as child processes (interpreter
start and imports included): `mlscope report ID x20` (Markdown on stdout: tables, the
figures named), `mlscope report ID x20 -o report.html` (25 figures drawn as SVG) and
`mlscope report --suite --models ...`; and, for the split, `mlscope report` with no
argument (start-up and imports only). Medians of --runs runs, with min and max; the
commands alternate, so a change of load hits them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cli.stack import Stack  # noqa: E402
from mlscope import bus as busmod  # noqa: E402
from mlscope import remote  # noqa: E402
from mlscope.settings import Settings  # noqa: E402

PAIRS = [
    ("digits_cnn", "onnxruntime"),
    ("digits_cnn", "pytorch"),
    ("mnist_lenet", "onnxruntime"),
    ("mnist_lenet", "tflite"),
]
RUNS_PER_PAIR = [("online", 1), ("batched", 1), ("batched", 2), ("batched", 4), ("batched", 8)]
QUERIES = 5_000
SPANS_PER_QUERY = 4
LAYERS = 8
T_BASE_MS = 1_750_000_000_123  # sub-second parts everywhere: see docs/BENCHMARKS.md


# ------------------------------------------------------------------ stored rows


def _evaluation(
    eval_id: str, at_ms: int, model: str, fw: str, scenario: str, batch: int
) -> dict[str, Any]:
    summary = {
        "scenario": {"name": scenario, "batch_size": batch, "qps": 200.0},
        "requested_qps": 200.0 if scenario == "online" else None,
        "queries": QUERIES,
        "samples": QUERIES * batch,
        "errors": 0,
        "duration_s": 25.0,
        "throughput_ips": 200.0 * batch,
        "accuracy": {"top1": 0.99},
        "valid": True,
    }
    spec = {"agent": {"cpu_model": "bench cpu", "cpu_cores": 2}, "artifact_sha256": "0" * 64}
    return {
        "evaluation_id": eval_id,
        "job_id": eval_id,
        "rerun_of": "",
        "created_at": datetime.fromtimestamp(at_ms / 1000, UTC).replace(tzinfo=None),
        "model": model,
        "model_version": "1.0.0",
        "framework": fw,
        "framework_version": "1.0",
        "agent_id": "bench-agent",
        "host": "bench-host",
        "device": "cpu",
        "scenario": scenario,
        "trace_level": "framework",
        "status": "completed",
        "valid": 1,
        "t0_ns": 0,
        "clock_offset_ns": 0,
        "spec": json.dumps(spec),
        "summary": json.dumps(summary),
    }


def _queries(eval_id: str, rng: np.random.Generator, batch: int) -> dict[str, Any]:
    n = QUERIES
    scheduled = np.arange(n, dtype=np.int64) * 5_000_000
    issued = scheduled + rng.integers(20_000, 200_000, n)
    latency = (rng.lognormal(np.log(2e6), 0.3, n)).astype(np.int64)
    completed = scheduled + latency
    zeros = np.zeros(n, np.int64)
    return {
        "evaluation_id": [eval_id] * n,
        "query_index": np.arange(n, dtype=np.int64),
        "batch_size": np.full(n, batch, np.int64),
        "scheduled_ns": scheduled,
        "issued_ns": issued,
        "completed_ns": completed,
        "agent_received_ns": issued + 100_000,
        "predict_start_ns": issued + 200_000,
        "predict_end_ns": completed - 100_000,
        "agent_replied_ns": completed - 50_000,
        "ok": np.ones(n, np.int64),
        "error": [""] * n,
        "label": np.full(n, batch, np.int64),
        "prediction": zeros,
        "outcome": zeros,
        "warmup": (np.arange(n) < 10).astype(np.int64),
        "paced_ns": issued,
    }


def _spans(eval_id: str, q: dict[str, Any], layers: bool) -> dict[str, Any]:
    """Per query: query -> preprocess, predict, postprocess (-> layers under predict)."""
    names = ["query", "preprocess", "predict", "postprocess"]
    layer_names = [f"conv{i}" for i in range(LAYERS)] if layers else []
    per = len(names) + len(layer_names)
    n = len(q["query_index"])
    base = np.arange(n, dtype=np.int64) * per + 1
    start = np.repeat(q["agent_received_ns"], per)
    end = np.repeat(q["agent_replied_ns"], per)
    slot = np.tile(np.arange(per), n)
    parent = np.where(slot == 0, 0, np.repeat(base, per))
    parent = np.where(slot >= len(names), np.repeat(base + 2, per), parent)
    kinds = ["query", "step", "step", "step", *(["layer"] * len(layer_names))]
    attrs = ["", "", "", "", *(['{"op_type": "Conv", "shape": [1, 8, 26, 26]}'] * len(layer_names))]
    return {
        "evaluation_id": [eval_id] * (n * per),
        "agent_id": ["bench-agent"] * (n * per),
        "span_id": np.repeat(base, per) + slot,
        "parent_id": parent,
        "query_index": np.repeat(q["query_index"], per),
        "level": np.where(slot == 0, 1, np.where(slot < len(names), 1, 2)),
        "kind": kinds * n,
        "name": [*names, *layer_names] * n,
        "start_ns": start + slot * 1000,
        "end_ns": end - (per - slot) * 1000,
        "host": ["bench-host"] * (n * per),
        "attrs": attrs * n,
        "batch_id": [f"b-{eval_id}"] * (n * per),
    }


def _store(db: Any, ev: dict[str, Any], rng: np.random.Generator, batch: int, layers: bool) -> int:
    from broker.db import EVALUATION_COLUMNS, QUERY_COLUMNS, SPAN_COLUMNS

    db.insert("evaluations", [[ev[c]] for c in EVALUATION_COLUMNS], EVALUATION_COLUMNS)
    q = _queries(ev["evaluation_id"], rng, batch)
    db.insert("queries", [q[c] for c in QUERY_COLUMNS], QUERY_COLUMNS)
    s = _spans(ev["evaluation_id"], q, layers)
    db.insert("spans", [s[c] for c in SPAN_COLUMNS], SPAN_COLUMNS)
    return len(q["query_index"]) + len(s["span_id"])


def fill(data_dir: Path, *, shown: bool, first: int, last: int) -> None:
    """Child process: the 20 shown evaluations (``shown``), and unrelated evaluations
    numbered ``first`` .. ``last - 1``."""
    from broker.db import Database

    db = Database(Settings(data_dir=data_dir).dsn)
    db.migrate()
    rng = np.random.default_rng(first)
    if shown:
        for i, ((model, fw), (scenario, batch)) in enumerate(
            (p, r) for p in PAIRS for r in RUNS_PER_PAIR
        ):
            ev = _evaluation(f"shown-{i:02d}", T_BASE_MS + i, model, fw, scenario, batch)
            _store(db, ev, rng, batch, layers=i in (0, 5))
    for j in range(first, last):
        model, fw = PAIRS[j % len(PAIRS)] if j % 2 else ("other_model", "onnxruntime")
        scenario, batch = RUNS_PER_PAIR[j % len(RUNS_PER_PAIR)]
        ev = _evaluation(f"old-{j:04d}", T_BASE_MS - 1_000 * (j + 1), model, fw, scenario, batch)
        _store(db, ev, rng, batch, layers=False)
    db.close()


ROWS_PER_UNRELATED = QUERIES * (1 + SPANS_PER_QUERY)


# ------------------------------------------------------------------ timing


async def _wait_server(settings: Settings, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with busmod.connect(settings, name="bench") as bus:
        while True:
            try:
                await remote.sql(bus, "SELECT 1", timeout=2.0)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await anyio.sleep(0.2)


def _timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    # cwd: `python -m` puts the working directory ahead of PYTHONPATH, so a bench of
    # another checkout must run from it
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, check=False)
    took = time.perf_counter() - t0
    if done.returncode not in (0, 2):
        raise RuntimeError(f"{' '.join(cmd[:5])} failed: {done.stderr.decode()[-2000:]}")
    return took


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure(settings: Settings, out: Path, runs: int) -> dict[str, dict[str, float]]:
    env = {**os.environ, **settings.as_env(), "PYTHONPATH": str(REPO)}
    cli = [sys.executable, "-m", "cli.main"]
    ids = [f"shown-{i:02d}" for i in range(len(PAIRS) * len(RUNS_PER_PAIR))]
    models = ",".join(f"{m}/{f}" for m, f in PAIRS)
    cmds = {
        "start-up (mlscope report, no argument)": [*cli, "report"],
        "report of 20 (Markdown on stdout)": [*cli, "report", *ids],
        "report of 20 (-o report.html)": [*cli, "report", *ids, "-o", str(out / "r.html")],
        "report --suite": [*cli, "report", "--suite", "--models", models],
    }
    got: dict[str, list[float]] = {k: [] for k in cmds}
    for _ in range(runs):  # alternated, so load changes hit every command alike
        for name, cmd in cmds.items():
            got[name].append(_timed(cmd, env))
    return {k: _stats(v) for k, v in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--unrelated", default="400000,1000000,2000000", help="rows, per step")
    ap.add_argument("--fill", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shown", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--last", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.fill is not None:
        fill(args.fill, shown=args.shown, first=args.first, last=args.last)
        return
    steps = [int(x) for x in args.unrelated.split(",") if x.strip()]
    with tempfile.TemporaryDirectory(prefix="mlscope-bench-report-") as tmp:
        base = Path(tmp) / "data"
        base.mkdir()
        done = 0
        for i, rows in enumerate(steps):
            last = -(-rows // ROWS_PER_UNRELATED)
            t0 = time.perf_counter()
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--fill",
                    str(base),
                    "--first",
                    str(done),
                    "--last",
                    str(last),
                ]
                + (["--shown"] if i == 0 else []),
                check=True,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            filled_s = time.perf_counter() - t0
            done = last
            stack = Stack(Settings(data_dir=base), nats_port=0, frameworks=[])
            settings = stack.start()
            try:
                anyio.run(_wait_server, settings, backend="asyncio")
                load = os.getloadavg()
                result = measure(settings, Path(tmp), args.runs)
            finally:
                stack.stop()
            print(
                f"unrelated rows {done * ROWS_PER_UNRELATED:,} (stored in {filled_s:.1f} s), "
                f"load {load[0]:.2f} {load[1]:.2f}"
            )
            for name, s in result.items():
                print(
                    f"  {name:42s} median {s['median']:.2f} s  "
                    f"(min {s['min']:.2f}, max {s['max']:.2f}, {args.runs} runs)"
                )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
