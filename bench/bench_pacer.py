"""How precisely and how fast the pacer issues, with a null issue callback.

    PYTHONPATH=. python bench/bench_pacer.py            # ~2 min
    PYTHONPATH=. python bench/bench_pacer.py --runs 1   # quicker look

Prints, asserts nothing. Every figure is the median over ``--runs`` runs (default 3) of
that run's statistic; percentiles are mlscope.stats' nearest rank.

1. Issue lag (issued - scheduled) p50/p99/max for Poisson schedules at 1,000 and
   10,000 QPS, batch callback (``issue_many``) and per-query callback (``issue``), and
   at 1,000 QPS with ``busy_s=0`` (a spin made only of ``time.sleep(0)``). "early"
   counts queries issued before their time (always 0).
2. The same at 1,000 QPS while another Python thread burns CPU (standing in for a busy
   event loop), with the interpreter's default 5 ms switch interval and with 100 µs:
   the GIL, not the pacer, decides the tail then.
3. Maximum issue rate: a schedule whose queries are all due at once, issued as fast as
   the pacer can (per-query callback; batches of 1; batches of 1,024).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from mlscope import schedule as sch
from mlscope.pacer import Pacer, PacerResult
from mlscope.stats import percentiles


def _null_many(indices: range, issued_ns: int) -> None:
    return None


def _null_one(i: int, scheduled_ns: int, issued_ns: int) -> None:
    return None


def _lag_us(result: PacerResult) -> tuple[float, float, float]:
    lag = result.lag_ns / 1e3
    p50, p99 = percentiles(lag, [50, 99])
    return float(p50 or 0), float(p99 or 0), float(lag.max())


def _median_rows(rows: Sequence[tuple[float, ...]]) -> tuple[float, ...]:
    return tuple(statistics.median(col) for col in zip(*rows, strict=True))


_KINDS: dict[str, Callable[[sch.Schedule], Pacer]] = {
    "issue_many": lambda s: Pacer(s, issue_many=_null_many),
    "issue": lambda s: Pacer(s, issue=_null_one),
    "issue_many, busy_s=0": lambda s: Pacer(s, issue_many=_null_many, busy_s=0),
}


def _lag_case(rate: float, seconds: float, runs: int, kind: str) -> tuple[float, ...]:
    rows = []
    for run in range(runs):
        s = sch.poisson(rate, duration_s=seconds, seed=run)
        result = _KINDS[kind](s).run()
        negative = int(np.count_nonzero(result.lag_ns < 0))
        rows.append((*_lag_us(result), float(negative)))
    return _median_rows(rows)


def _busy_thread(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(1000):
            x += 1


def _lag_under_contention(
    rate: float, seconds: float, runs: int, interval: float
) -> tuple[float, ...]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    stop = threading.Event()
    hog = threading.Thread(target=_busy_thread, args=(stop,), daemon=True)
    hog.start()
    try:
        return _lag_case(rate, seconds, runs, "issue_many")
    finally:
        stop.set()
        hog.join()
        sys.setswitchinterval(old)


def _max_rate(n: int, runs: int, make: Callable[[np.ndarray], Pacer]) -> float:
    rates = []
    for _ in range(runs):
        pacer = make(np.zeros(n, np.int64))
        t0 = time.perf_counter_ns()
        result = pacer.run()
        elapsed = time.perf_counter_ns() - t0
        rates.append(result.reached / (elapsed / 1e9))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    runs = args.runs
    print(
        f"python {platform.python_version()} on {platform.machine()}, "
        f"{os.cpu_count()} cores; medians of {runs} runs; lag in µs"
    )

    print("\nissue lag, Poisson, null callback")
    print(f"{'rate':>8} {'callback':>22} {'p50':>8} {'p99':>8} {'max':>9} {'early':>6}")
    for rate, seconds, kinds in (
        (1_000.0, 5.0, ("issue_many", "issue", "issue_many, busy_s=0")),
        (10_000.0, 3.0, ("issue_many", "issue")),
    ):
        for kind in kinds:
            p50, p99, worst, early = _lag_case(rate, seconds, runs, kind)
            print(f"{rate:>8.0f} {kind:>22} {p50:>8.1f} {p99:>8.1f} {worst:>9.1f} {early:>6.0f}")

    print("\nissue lag at 1,000 QPS beside a CPU-bound Python thread (issue_many)")
    print(f"{'switch interval':>16} {'p50':>8} {'p99':>8} {'max':>9}")
    for interval in (0.005, 0.0001):
        p50, p99, worst, _ = _lag_under_contention(1_000.0, 3.0, runs, interval)
        print(f"{interval * 1e6:>13.0f} µs {p50:>8.1f} {p99:>8.1f} {worst:>9.1f}")

    print("\nmaximum issue rate, all queries due at once, null callback (queries/s)")
    n = 1_000_000
    cases: list[tuple[str, Callable[[np.ndarray], Pacer]]] = [
        ("issue (per query)", lambda s: Pacer(s, issue=_null_one)),
        ("issue_many, batch 1", lambda s: Pacer(s, issue_many=_null_many, max_batch=1)),
        ("issue_many, batch 1024", lambda s: Pacer(s, issue_many=_null_many)),
    ]
    for label, make in cases:
        print(f"{label:>24} {_max_rate(n, runs, make):>14,.0f}")


if __name__ == "__main__":
    main()
