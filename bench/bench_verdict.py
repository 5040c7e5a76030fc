"""How long the server's verdict takes on long runs (``broker.summary.judge``).

Synthetic run records, no stack:

- ``open``: a Poisson open loop at 1,000 QPS answered 2.5 ms after issue, and the
  same run with its agent paused for 2 s in the middle (the gap search's slower case);
- ``closed``: an agent-placed batched stream (closed loop): each query taken when the
  one before ended (175 µs ± 10 µs a predict, digits_cnn at batch 32 on 2 cores),
  answered in blocks of 40 that share their reply time; and a server-placed
  single-stream loop whose every reply has its own time.

Each size is judged ``--repeat`` times; the median is printed with the reasons found
(none for the healthy runs).

Usage: PYTHONPATH=. python bench/bench_verdict.py [--sizes 100000,1000000,3000000]
       [--repeat 3]
Prints one JSON line per case; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from broker.summary import judge
from mlscope.contracts import ScenarioSpec
from mlscope.record import RunRecord
from mlscope.validity import ValidityPolicy

MS = 1_000_000


def record(issued: np.ndarray, replied: np.ndarray, batch: int = 1) -> RunRecord:
    rec = RunRecord(n=len(issued), batch_size=batch, t0_ns=10**12)
    rec.scheduled[:] = rec.paced[:] = rec.issued[:] = issued
    rec.completed[:] = replied
    rec.ok[:] = 1
    return rec


def open_loop(n: int, pause: bool) -> RunRecord:
    rng = np.random.default_rng(1)
    issued = np.cumsum(rng.exponential(MS, n)).astype(np.int64) + 1
    replied = issued + int(2.5 * MS)
    if pause:  # answers held from the middle for 2 s
        mid = int(issued[n // 2])
        held = (replied >= mid) & (replied < mid + 2_000 * MS)
        replied[held] = mid + 2_000 * MS
    return record(issued, replied)


def stream(n: int) -> RunRecord:
    rng = np.random.default_rng(1)
    took = rng.normal(175_000, 10_000, n).astype(np.int64).clip(100_000)
    issued = np.cumsum(took) - took + 1
    ends = issued + took
    first = np.flatnonzero(np.arange(n) % 40 == 0)
    replied = np.repeat(np.maximum.reduceat(ends, first), np.diff(np.append(first, n)))
    return record(issued, replied + 100_000, batch=32)


def single_stream(n: int) -> RunRecord:
    rng = np.random.default_rng(1)
    took = rng.normal(200_000, 20_000, n).astype(np.int64).clip(100_000)
    issued = np.cumsum(took + 20_000) - took + 1  # the next sent 20 µs after each answer
    return record(issued, issued + took)


def timed(rec: RunRecord, name: str, open_: bool, repeat: int) -> dict[str, object]:
    spec = ScenarioSpec(name=name, duration_s=1, qps=1000)
    window = float(rec.completed.max()) / 1e9
    took: list[float] = []
    reasons: tuple[str, ...] = ()
    for _ in range(repeat):
        t = time.perf_counter()
        reasons = judge(
            rec,
            spec,
            ValidityPolicy(),
            window_s=window,
            requested_rate=1000.0 if open_ else None,
            poisson=open_,
            open_loop=open_,
        ).reasons
        took.append(time.perf_counter() - t)
    return {"median_s": round(statistics.median(took), 3), "reasons": [r[:60] for r in reasons]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="100000,1000000,3000000")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    for n in (int(s) for s in a.sizes.split(",")):
        cases = {
            "open": (open_loop(n, False), "online", True),
            "open, paused 2 s": (open_loop(n, True), "online", True),
            "closed, agent stream": (stream(n), "batched", False),
            "closed, single-stream": (single_stream(n), "single-stream", False),
        }
        for case, (rec, name, open_) in cases.items():
            print(json.dumps({"queries": n, "case": case, **timed(rec, name, open_, a.repeat)}))


if __name__ == "__main__":
    main()
