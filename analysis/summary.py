"""Per-evaluation summaries and latency over time, from the raw per-query samples.

Definitions (the same as the server's, ``broker/summary.py``): latency = completed -
scheduled; throughput = samples answered / (last completion - first issue); top-1 =
correct answers / samples answered; errors = failed + refused + lost and not issued
apart (:mod:`mlscope.outcomes`); warm-up rows are left out. Percentiles and trimmed
means are :mod:`mlscope.stats`'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from analysis.data import evaluations, queries
from analysis.source import Source
from mlscope.outcomes import count
from mlscope.stats import describe_ms, percentiles, trimmed_mean

__all__ = ["SUMMARY_COLUMNS", "latency_windows", "summarize_samples", "summary"]

SUMMARY_COLUMNS = (
    "evaluation_id",
    "model",
    "model_version",
    "framework",
    "framework_version",
    "system",
    "scenario",
    "batch_size",
    "trace_level",
    "valid",
    "queries",
    "errors",
    "not_issued",
    "samples",
    "trimmed_mean_ms",
    "p50_ms",
    "p90_ms",
    "p99_ms",
    "max_ms",
    "throughput_ips",
    "top1",
    "invalid_reasons",
    "role",
    "parallel",
    "requested_qps",
    "peak_rss_mb",
    "rss_growth_mb",
    "energy_j",
    "artifact_sha256",
)


def summarize_samples(q: pd.DataFrame) -> dict[str, Any]:
    """Latency, throughput and accuracy of one evaluation's query rows (warm-up rows
    left out; failed / refused / lost / not issued as :mod:`mlscope.outcomes`)."""
    q = q[~q["warmup"].to_numpy(bool)] if "warmup" in q.columns else q
    ok = q["ok"].to_numpy(bool)
    lat = describe_ms(q["latency_ns"].to_numpy(np.int64)[ok])
    batch = q["batch_size"].to_numpy(np.int64)
    samples = int(batch[ok].sum())
    issued = q["issued_ns"].to_numpy(np.int64)
    issued = issued[issued > 0]
    done = q["completed_ns"].to_numpy(np.int64)
    done = done[done > 0]
    counts = count(q["outcome"].to_numpy(np.uint8))
    span_s = (float(done.max()) - float(issued.min())) / 1e9 if done.size and issued.size else 0.0
    correct = int(q["correct"].to_numpy(np.int64)[ok].sum()) if "correct" in q else 0
    return {
        "queries": len(q),
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
        "correct": correct,
    }


def summary(source: Source, ids: Sequence[str] | None = None) -> pd.DataFrame:
    """One row per evaluation: the columns of :data:`SUMMARY_COLUMNS`, recomputed from
    the raw samples (evaluations whose queries were lost keep their stored figures)."""
    ev = evaluations(source, ids)
    if ev.empty:
        return pd.DataFrame(columns=list(SUMMARY_COLUMNS))
    q = queries(source, list(ev["evaluation_id"]))
    # not dict(groupby): dict() takes the groupby's `keys` attribute for a mapping's
    by_id = {k: g for k, g in q.groupby("evaluation_id", sort=False)}  # noqa: C416
    rows = []
    for e in ev.to_dict("records"):
        row = {k: e.get(k) for k in SUMMARY_COLUMNS}
        g = by_id.get(e["evaluation_id"])
        if g is not None:
            s = summarize_samples(g)
            has_labels = e.get("top1") is not None
            row.update({k: v for k, v in s.items() if k in SUMMARY_COLUMNS})
            row["top1"] = s["correct"] / s["samples"] if has_labels and s["samples"] else None
        rows.append(row)
    return pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS))


def latency_windows(source: Source, evaluation_id: str, *, window_s: float = 1.0) -> pd.DataFrame:
    """Latency in consecutive windows of scheduled time (warm-up, throttling, noise).

    Columns: window (index), start_s (from the first scheduled query), queries,
    trimmed_mean_ms, p50_ms, p90_ms, p99_ms.
    """
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    q = queries(source, [evaluation_id])
    q = q[q["ok"] & ~q["warmup"]]
    cols = ["window", "start_s", "queries", "trimmed_mean_ms", "p50_ms", "p90_ms", "p99_ms"]
    if q.empty:
        return pd.DataFrame(columns=cols)
    t = (q["scheduled_ns"] - q["scheduled_ns"].min()) / 1e9
    window = (t // window_s).astype(int)
    rows = []
    for w, g in q.groupby(window):
        ms = g["latency_ns"].to_numpy(np.int64) / 1e6
        p50, p90, p99 = percentiles(ms, [50, 90, 99])
        rows.append(
            {
                "window": int(w),
                "start_s": int(w) * window_s,
                "queries": len(g),
                "trimmed_mean_ms": trimmed_mean(ms),
                "p50_ms": p50,
                "p90_ms": p90,
                "p99_ms": p99,
            }
        )
    return pd.DataFrame(rows, columns=cols)
