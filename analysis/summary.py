"""Per-evaluation summaries and latency over time, from the raw per-query samples.

Definitions (the same as the server's, ``broker/summary.py``): latency = completed -
scheduled; throughput = samples answered / (last completion - first issue); top-1 =
correct answers / samples answered; errors = failed + refused + lost and not issued
apart (:mod:`mlscope.outcomes`); warm-up rows are left out (``queries`` counts the
measured queries, ``warmup_queries`` the others; the stored summary's ``queries`` of
:func:`analysis.data.evaluations` counts both). Percentiles and trimmed
means are :mod:`mlscope.stats`' definitions, computed by the database
(:mod:`analysis.sqlstats`): an evaluation's rows stay in it, its figures come back.

A row is a query of ``batch_size`` samples; an MLPerf evaluation's row is one LoadGen
sample (stored with batch size 1, and counted as one sample whatever its
``batch_size``: rows stored by earlier versions carry LoadGen's samples per query there).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import pandas as pd

from analysis.data import evaluations
from analysis.source import Source
from analysis.sqlstats import OUTCOME, percentile, sorted_ms, trimmed_mean
from mlscope.outcomes import ERROR_OUTCOMES, Outcome

__all__ = [
    "COUNT_TYPES",
    "SAMPLE_STATS_SQL",
    "SUMMARY_COLUMNS",
    "latency_windows",
    "latency_windows_of",
    "sample_stats",
    "summary",
]

_OUTCOMES = (Outcome.NOT_ISSUED, Outcome.FAILED, Outcome.REFUSED, Outcome.LOST)
_OUTCOME_NAMES = tuple(x.label for x in _OUTCOMES)

SUMMARY_COLUMNS = (
    "evaluation_id",
    "created_at",
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
    "warmup_queries",
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
    "placement",
    "preprocess",
    "requested_qps",
    "peak_rss_mb",
    "rss_growth_mb",
    "energy_j",
    "host_other_cores",
    "artifact_sha256",
)

COUNT_TYPES = dict.fromkeys(
    ("batch_size", "queries", "warmup_queries", "errors", "not_issued", "samples"), "Int64"
)
"""The whole-number columns of :data:`SUMMARY_COLUMNS`, as nullable integers: a count is
whole (``17``, never ``17.0``) in every row, also beside a row that has none."""

_STATS = (
    "queries",
    "warmup_queries",
    "errors",
    "not_issued",
    "failed",
    "refused",
    "lost",
    "samples",
    "answered",
    "first_issued_ns",
    "issued",
    "last_completed_ns",
    "completed",
    "correct",
)
_SENT = f"o != {int(Outcome.NOT_ISSUED)}"
"""A query that was sent, by its outcome (:mod:`mlscope.outcomes`: a closed loop may
issue its first at offset 0, and a query with a completion was sent), as the server
counts it."""
_LATENCY_FIGURES = (
    "trimmed_mean_ms",
    "p50_ms",
    "p90_ms",
    "p99_ms",
    "max_ms",
    "throughput_ips",
    "top1",
)
"""What a cancelled run has none of (its summary's, and so its report's): it stopped
part-way, so its rows measure no steady load."""
_COUNTS = ", ".join(
    [
        "countIf(kept) AS queries",
        "countIf(NOT kept) AS warmup_queries",
        f"countIf(kept AND o IN {tuple(int(x) for x in ERROR_OUTCOMES)}) AS errors",
        *(f"countIf(kept AND o = {int(x)}) AS {x.label}" for x in _OUTCOMES),
        "sumIf(batch_size, kept AND ok != 0) AS samples",
        "countIf(kept AND ok != 0) AS answered",
        f"minIf(issued_ns, kept AND {_SENT}) AS first_issued_ns",
        f"countIf(kept AND {_SENT}) AS issued",
        "maxIf(completed_ns, kept AND completed_ns > 0) AS last_completed_ns",
        "countIf(kept AND completed_ns > 0) AS completed",
        "sumIf(label, kept AND ok != 0) AS correct",
        f"{sorted_ms('completed_ns - scheduled_ns', 'kept AND ok != 0')} AS lat",
    ]
)
SAMPLE_STATS_SQL = (
    f"SELECT evaluation_id, {', '.join(_STATS)}, "
    f"{trimmed_mean('lat')} AS trimmed_mean_ms, {percentile('lat', 50)} AS p50_ms, "
    f"{percentile('lat', 90)} AS p90_ms, {percentile('lat', 99)} AS p99_ms, "
    f"{percentile('lat', 100)} AS max_ms FROM (SELECT evaluation_id, {_COUNTS} FROM "
    f"(SELECT *, {OUTCOME} AS o, warmup = 0 AS kept FROM queries FINAL WHERE "
    "evaluation_id IN {ids:Array(String)}) GROUP BY evaluation_id) ORDER BY evaluation_id"
)
"""Per evaluation, the figures of its non-warm-up query rows, aggregated by the
database (one row per evaluation comes back, whatever the rows it holds)."""


def sample_stats(
    source: Source, ids: Sequence[str], *, sample_rows: Collection[str] = ()
) -> dict[str, dict[str, Any]]:
    """Latency, throughput and accuracy of each evaluation's query rows, by id
    (warm-up rows left out; failed / refused / lost / not issued as
    :mod:`mlscope.outcomes`); evaluations without query rows are absent.
    ``sample_rows``: evaluations whose every row is one sample (MLPerf's)."""
    if not ids:
        return {}
    got = source.frame(SAMPLE_STATS_SQL, {"ids": list(ids)})
    return {
        str(r["evaluation_id"]): _figures(r, one_sample=str(r["evaluation_id"]) in sample_rows)
        for r in got.to_dict("records")
    }


def _figures(r: dict[str, Any], *, one_sample: bool = False) -> dict[str, Any]:
    ints = {k: int(r[k]) for k in _STATS}
    if one_sample:
        ints["samples"] = ints["answered"]
    # throughput = samples answered / (last completion - first issue), as the server's
    span_s = (
        (float(ints["last_completed_ns"]) - float(ints["first_issued_ns"])) / 1e9
        if ints["completed"] and ints["issued"]
        else 0.0
    )
    figures = {k: _float(r[k]) for k in ("trimmed_mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms")}
    return {
        **{k: ints[k] for k in ("queries", "warmup_queries", "errors", *_OUTCOME_NAMES)},
        "samples": ints["samples"],
        **figures,
        "throughput_ips": ints["samples"] / span_s if span_s > 0 else None,
        "correct": ints["correct"],
    }


def _float(v: Any) -> float | None:
    return None if v is None or pd.isna(v) else float(v)


def _missing_as_none(v: Any) -> Any:
    """A frame's cell with NaN / NaT / None read as None (lists and text as they are)."""
    return None if v is None or (pd.api.types.is_scalar(v) and pd.isna(v)) else v


def summary(
    source: Source, ids: Sequence[str] | None = None, *, evaluated: pd.DataFrame | None = None
) -> pd.DataFrame:
    """One row per evaluation: the columns of :data:`SUMMARY_COLUMNS`, recomputed from
    the raw samples by the database (evaluations whose queries were lost keep their
    stored figures, ``queries`` less the warm-up ones there too). ``evaluated``: the
    rows of :func:`analysis.data.evaluations` when the caller has read them already
    (``ids`` is then ignored). ``top1`` is None for a run without labels (its stored
    summary has no top-1), whatever the other rows of ``evaluated`` hold."""
    ev = evaluations(source, ids) if evaluated is None else evaluated
    if ev.empty:
        return pd.DataFrame(columns=list(SUMMARY_COLUMNS)).astype(COUNT_TYPES)
    mlperf = ev["scenario"].astype(str).str.startswith("mlperf-")
    stats = sample_stats(
        source, list(ev["evaluation_id"]), sample_rows=set(ev.loc[mlperf, "evaluation_id"])
    )
    rows = []
    for e in ev.to_dict("records"):
        row = {k: _missing_as_none(e.get(k)) for k in SUMMARY_COLUMNS}
        s = stats.get(e["evaluation_id"])
        if s is not None:
            # A frame's missing value is NaN where another row has one (a float column):
            # only a stored top-1 means the run had labels.
            has_labels = row["top1"] is not None
            row.update({k: v for k, v in s.items() if k in SUMMARY_COLUMNS})
            row["top1"] = s["correct"] / s["samples"] if has_labels and s["samples"] else None
            if e.get("status") == "cancelled":  # counts from its rows, no figures
                row.update(dict.fromkeys(_LATENCY_FIGURES))
        elif row["queries"] is not None:  # stored figures: the measured queries only
            row["queries"] = max(row["queries"] - (row["warmup_queries"] or 0), 0)
        rows.append(row)
    return pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS)).astype(COUNT_TYPES)


_WINDOW_COLUMNS = [
    "window",
    "start_s",
    "queries",
    "trimmed_mean_ms",
    "p50_ms",
    "p90_ms",
    "p99_ms",
    "completed_per_s",
]


def _windows_sql(window_s: float) -> str:
    """Per evaluation and window of scheduled time (from the evaluation's first
    scheduled answered query): the answered queries scheduled in it, their latency
    figures, and how many answered queries completed in it. Each row is counted twice
    (``arrayJoin``): once in its scheduling window, once in its completion window; a
    window in which queries only completed (the tail of a run) is a row too, with no
    latency figures, so that the completions add up to the answered queries."""
    w = repr(float(window_s))
    rows = (
        f"SELECT evaluation_id, arrayJoin([(toInt64(floor((scheduled_ns - t0) / 1e9 / {w})), "
        f"1), (toInt64(floor((completed_ns - t0) / 1e9 / {w})), 0)]) AS at, latency_ns "
        "FROM (SELECT evaluation_id, scheduled_ns, completed_ns, "
        "completed_ns - scheduled_ns AS latency_ns, "
        "min(scheduled_ns) OVER (PARTITION BY evaluation_id) AS t0 FROM queries FINAL "
        "WHERE evaluation_id IN {ids:Array(String)} AND ok != 0 AND warmup = 0)"
    )
    return (
        f"SELECT evaluation_id, win, queries, completed, {trimmed_mean('lat')} AS "
        f"trimmed_mean_ms, {percentile('lat', 50)} AS p50_ms, {percentile('lat', 90)} AS "
        f"p90_ms, {percentile('lat', 99)} AS p99_ms FROM (SELECT evaluation_id, "
        "tupleElement(at, 1) AS win, sum(tupleElement(at, 2)) AS queries, "
        "count() - queries AS completed, "
        f"{sorted_ms('latency_ns', 'tupleElement(at, 2) = 1')} AS lat FROM ({rows}) "
        "GROUP BY evaluation_id, win) ORDER BY evaluation_id, win"
    )


def latency_windows(source: Source, evaluation_id: str, *, window_s: float = 1.0) -> pd.DataFrame:
    """Latency in consecutive windows of scheduled time (warm-up, throttling, noise).

    Columns: window (index), start_s (from the first scheduled query), queries,
    trimmed_mean_ms, p50_ms, p90_ms, p99_ms (of the queries scheduled in the window),
    completed_per_s (queries that completed in the window, per second: the rate the
    system delivered, which a stall drops while latency climbs). A window with
    completions but no query scheduled in it has queries 0 and no latency figures; a
    window with neither is absent. Computed by the database: one row per window comes
    back.
    """
    return latency_windows_of(source, [evaluation_id], window_s=window_s)[evaluation_id]


def latency_windows_of(
    source: Source, ids: Sequence[str], *, window_s: float = 1.0
) -> dict[str, pd.DataFrame]:
    """:func:`latency_windows` of each of ``ids``, in one query (empty frames for
    evaluations without answered queries)."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    out = {e: pd.DataFrame(columns=_WINDOW_COLUMNS) for e in ids}
    if not ids:
        return out
    got = source.frame(_windows_sql(window_s), {"ids": list(ids)})
    for e, g in got.groupby("evaluation_id", sort=False) if len(got) else ():
        frame = pd.DataFrame(
            {
                "window": g["win"].astype(int).to_numpy(),
                "start_s": g["win"].astype(int).to_numpy() * window_s,
                "queries": g["queries"].astype(int).to_numpy(),
                **{
                    c: [_float(v) for v in g[c]]
                    for c in ("trimmed_mean_ms", "p50_ms", "p90_ms", "p99_ms")
                },
                "completed_per_s": g["completed"].astype(int).to_numpy() / window_s,
            },
            columns=_WINDOW_COLUMNS,
        )
        frame.attrs["window_s"] = window_s
        out[str(e)] = frame
    return out
