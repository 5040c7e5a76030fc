"""The analysis summaries computed in pandas from raw rows: the reference the SQL path
is checked against (same stored data, same figures)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from mlscope.outcomes import count
from mlscope.stats import describe_ms, percentiles, trimmed_mean


def summarize_samples(q: pd.DataFrame) -> dict[str, Any]:
    """Latency, throughput and accuracy of one evaluation's query rows (of
    :func:`analysis.rows.queries`), warm-up rows left out."""
    warmup = int(q["warmup"].to_numpy(bool).sum())
    q = q[~q["warmup"].to_numpy(bool)]
    ok = q["ok"].to_numpy(bool)
    lat = describe_ms(q["latency_ns"].to_numpy(np.int64)[ok])
    samples = int(q["batch_size"].to_numpy(np.int64)[ok].sum())
    issued = q["issued_ns"].to_numpy(np.int64)
    issued = issued[issued > 0]
    done = q["completed_ns"].to_numpy(np.int64)
    done = done[done > 0]
    counts = count(q["outcome"].to_numpy(np.uint8))
    span_s = (float(done.max()) - float(issued.min())) / 1e9 if done.size and issued.size else 0.0
    return {
        "queries": len(q),
        "warmup_queries": warmup,
        "errors": counts["errors"],
        "not_issued": counts["not_issued"],
        "failed": counts["failed"],
        "refused": counts["refused"],
        "lost": counts["lost"],
        "samples": samples,
        "trimmed_mean_ms": lat["trimmed_mean"],
        "p50_ms": lat["p50"],
        "p90_ms": lat["p90"],
        "p99_ms": lat["p99"],
        "max_ms": lat["max"],
        "throughput_ips": samples / span_s if span_s > 0 else None,
        "correct": int(q["correct"].to_numpy(np.int64)[ok].sum()),
    }


def latency_windows(q: pd.DataFrame, window_s: float) -> pd.DataFrame:
    """Latency per window of scheduled time from one evaluation's query rows."""
    q = q[q["ok"] & ~q["warmup"]]
    t0 = q["scheduled_ns"].min()
    window = ((q["scheduled_ns"] - t0) / 1e9 // window_s).astype(int)
    done = ((q["completed_ns"] - t0) / 1e9 // window_s).astype(int).value_counts()
    rows = []
    groups = dict(list(q.groupby(window)))
    # a window in which queries only completed (the run's tail) is a row too
    for w in sorted({*groups, *(int(x) for x in done.index)}):
        g = groups.get(w, q.iloc[:0])
        ms = g["latency_ns"].to_numpy(np.int64) / 1e6
        p50, p90, p99 = percentiles(ms, [50, 90, 99]) if ms.size else (None, None, None)
        rows.append(
            {
                "window": int(w),
                "start_s": int(w) * window_s,
                "queries": len(g),
                "trimmed_mean_ms": trimmed_mean(ms) if ms.size else None,
                "p50_ms": p50,
                "p90_ms": p90,
                "p99_ms": p99,
                "completed_per_s": int(done.get(w, 0)) / window_s,
            }
        )
    return pd.DataFrame(rows)
