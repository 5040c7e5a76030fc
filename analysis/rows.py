"""An evaluation's raw rows as data frames: its per-query records (with latency and
outcome), its spans (those of the agent it ran on, :mod:`mlscope.tracerows`), read a
bounded frame at a time; the latencies a percentile curve needs as one narrow column.
No statistics here; the evaluations themselves are :mod:`analysis.data`'s.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd

from analysis.source import FRAME_ROWS, Source, joined, pages
from mlscope import schema
from mlscope.outcomes import UNKNOWN_OUTCOME, classify
from mlscope.tracerows import MANY, trace_rows

__all__ = ["QUERY_FIELDS", "latencies_ms", "queries", "queries_of", "spans", "spans_of"]

_DTYPES = {
    "String": "object",
    "UInt8": "int64",
    "UInt32": "int64",
    "Int32": "int64",
    "Int64": "int64",
}
QUERY_FIELDS = {
    c.name: "bool" if c.name == "ok" else _DTYPES[c.base_type] for c in schema.QUERIES.columns
}
"""The stored columns of ``queries`` (:data:`mlscope.schema.QUERIES`) and their dtypes."""
_QUERY_NAMES = {"label": "correct"}
"""Stored ``queries`` columns as readers name them: ``label`` holds a query's number of
correct samples."""


def queries(source: Source, ids: Sequence[str]) -> pd.DataFrame:
    """Raw per-query rows of ``ids`` with latency (completed - scheduled) in ns, by
    evaluation and query index, read a bounded frame at a time (:func:`queries_of`)."""
    frame = joined(queries_of(source, ids))
    if frame.empty:  # an empty answer over the bus names no columns
        frame = pd.DataFrame({c: pd.Series(dtype=t) for c, t in QUERY_FIELDS.items()})
        frame = frame.rename(columns=_QUERY_NAMES)
    for col in ("scheduled_ns", "issued_ns", "completed_ns"):
        frame[col] = frame[col].astype(np.int64)
    frame["ok"] = frame["ok"].astype(bool)
    frame["latency_ns"] = frame["completed_ns"] - frame["scheduled_ns"]
    return _with_outcomes(frame)


def _with_outcomes(frame: pd.DataFrame) -> pd.DataFrame:
    """``outcome`` (:class:`mlscope.outcomes.Outcome`) and ``warmup`` on every row.

    Rows stored before outcomes were recorded (no column, or 255) are classified from
    their times; they cannot tell a refusal from a failure, so both count as failed.
    """
    derived = classify(issued=frame["issued_ns"], completed=frame["completed_ns"], ok=frame["ok"])
    if "outcome" in frame.columns:
        stored = frame["outcome"].to_numpy(np.int64)
        derived = np.where(stored == UNKNOWN_OUTCOME, derived, stored).astype(np.uint8)
    frame["outcome"] = derived
    frame["warmup"] = (
        frame["warmup"].astype(bool) if "warmup" in frame.columns else np.zeros(len(frame), bool)
    )
    return frame


def spans(
    source: Source,
    evaluation_id: str,
    *,
    kinds: Sequence[str] | None = None,
    query_index: int | None = None,
) -> pd.DataFrame:
    """Spans of one evaluation (optionally some kinds, or one query), by start time
    (then agent and span id), read a bounded frame at a time (:func:`pages`): those of
    the agent it ran on (:func:`mlscope.tracerows.trace_rows`)."""
    sql = (
        "SELECT agent_id, span_id, parent_id, query_index, level, kind, name, start_ns, "
        f"end_ns, host, attrs FROM {trace_rows('spans')}"
    )
    params: dict[str, Any] = {"e": evaluation_id}
    if kinds is not None:
        sql += " AND kind IN {k:Array(String)}"
        params["k"] = list(kinds)
    if query_index is not None:
        sql += " AND query_index = {q:Int64}"
        params["q"] = query_index
    key = (("start_ns", "Int64"), ("agent_id", "String"), ("span_id", "UInt64"))
    return joined(pages(source, sql, params, key))


def spans_of(
    source: Source, ids: Sequence[str], *, rows: int = FRAME_ROWS
) -> Iterator[pd.DataFrame]:
    """Every span of evaluations ``ids`` (all stored columns but the batch bookkeeping;
    each evaluation's of the agent it ran on), by evaluation and start time (then agent
    and span id, which are unique), in frames of at most ``rows``
    (:func:`analysis.source.pages`): what an export writes."""
    return pages(
        source,
        "SELECT evaluation_id, agent_id, span_id, parent_id, query_index, level, kind, name, "
        f"start_ns, end_ns, host, attrs FROM {trace_rows('spans', MANY)}",
        {"ids": list(ids)},
        (
            ("evaluation_id", "String"),
            ("start_ns", "Int64"),
            ("agent_id", "String"),
            ("span_id", "UInt64"),
        ),
        rows=rows,
    )


def queries_of(
    source: Source, ids: Sequence[str], *, rows: int = FRAME_ROWS
) -> Iterator[pd.DataFrame]:
    """Every stored per-query record of evaluations ``ids``, as stored, by evaluation and
    query index, in frames of at most ``rows``: what an export writes. The stored
    ``label`` column holds a query's number of correct samples: it is named
    ``correct`` here (a reader would take ``label`` for the expected class)."""
    frames = pages(
        source,
        "SELECT * FROM queries FINAL WHERE evaluation_id IN {ids:Array(String)}",
        {"ids": list(ids)},
        (("evaluation_id", "String"), ("query_index", "UInt32")),
        rows=rows,
    )
    return (frame.rename(columns=_QUERY_NAMES) for frame in frames)


def latencies_ms(source: Source, ids: Sequence[str]) -> dict[str, np.ndarray]:
    """Latency (ms) of the answered, non-warm-up queries of each of ``ids`` (those with
    any), in query order: the samples a percentile curve or a bootstrap needs, read
    as one narrow column (an index into ``ids``, not the id, on every row). A cancelled
    run has none: it stopped part-way, so its rows measure no steady load (its summary
    has no latency figures either, :func:`analysis.summary.summary`)."""
    if not ids:
        return {}
    got = source.frame(
        "SELECT toUInt32(indexOf({ids:Array(String)}, evaluation_id)) AS i, "
        "completed_ns - scheduled_ns AS ns FROM queries FINAL WHERE evaluation_id IN "
        "{ids:Array(String)} AND ok != 0 AND warmup = 0 AND evaluation_id NOT IN "
        "(SELECT evaluation_id FROM evaluations FINAL WHERE evaluation_id IN "
        "{ids:Array(String)} AND status = 'cancelled') ORDER BY i, query_index",
        {"ids": list(ids)},
    )
    if got.empty:  # a direct read of no rows has no columns either
        return {}
    index = got["i"].to_numpy(np.int64)
    ns = got["ns"].to_numpy(np.int64)
    bounds = np.flatnonzero(np.diff(index)) + 1
    starts = [0, *bounds.tolist()]
    ends = [*bounds.tolist(), index.size]
    return {ids[index[a] - 1]: ns[a:b] / 1e6 for a, b in zip(starts, ends, strict=True) if b > a}
