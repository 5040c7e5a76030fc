"""The timeline of one evaluation, at a chosen depth: model → layer → kernel.

Times are in milliseconds from the first span of the queries shown (``first_query`` on,
not the evaluation's first span), on the agent's clock
(every span of one agent shares it; the load generator's offset is stored per
evaluation and applied by ``mlscope trace`` (``cli/trace_cmd.py``), not needed within
one agent). They are taken exactly, in Python integers, before they become floats:
two stored Int64 times may be further apart than an Int64 holds.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from analysis.layers import attr_text, shape_text, span_attrs
from analysis.rows import spans
from analysis.source import Source, table_exists
from mlscope.errors import DatabaseError
from mlscope.tracerows import trace_rows

__all__ = ["DEPTHS", "inflight_slots", "system_samples", "timeline"]

# Each depth shows its kinds and those above it.
DEPTHS: dict[str, tuple[str, ...]] = {
    "model": ("query", "step"),
    "layer": ("query", "step", "layer", "op"),
    "kernel": ("query", "step", "layer", "op", "kernel"),
}
_ROW = {"query": 0, "step": 1, "layer": 2, "op": 2, "kernel": 3}


def timeline(
    source: Source,
    evaluation_id: str,
    *,
    depth: str = "layer",
    first_query: int = 0,
    queries: int = 5,
) -> pd.DataFrame:
    """Spans of queries ``first_query .. first_query+queries-1`` down to ``depth``:
    kind, name, lane (0 query, 1 step, 2 layer/op, 3 kernel), query_index, start_ms,
    end_ms (from the first of these spans), dur_ms, op_type, shape, parent_id, span_id."""
    if depth not in DEPTHS:
        raise ValueError(f"depth must be one of {', '.join(DEPTHS)}, not {depth!r}")
    cols = [
        "kind",
        "name",
        "lane",
        "query_index",
        "start_ms",
        "end_ms",
        "dur_ms",
        "op_type",
        "shape",
        "parent_id",
        "span_id",
    ]
    raw = spans(source, evaluation_id, kinds=DEPTHS[depth])
    if raw.empty:
        return pd.DataFrame(columns=cols)
    qi = raw["query_index"].astype(int)
    raw = raw[(qi >= first_query) & (qi < first_query + queries)]
    if raw.empty:
        return pd.DataFrame(columns=cols)
    start, end = _ints(raw["start_ns"]), _ints(raw["end_ns"])
    t0 = min(start)
    attrs = [span_attrs(a) for a in raw["attrs"]]
    return pd.DataFrame(
        {
            "kind": raw["kind"].astype(str).to_numpy(),
            "name": raw["name"].to_numpy(),
            "lane": [_ROW.get(k, 4) for k in raw["kind"]],
            "query_index": raw["query_index"].astype(int).to_numpy(),
            "start_ms": _ms(s - t0 for s in start),
            "end_ms": _ms(e - t0 for e in end),
            "dur_ms": _ms(e - s for s, e in zip(start, end, strict=True)),
            "op_type": [attr_text(a, "op_type") for a in attrs],
            "shape": [shape_text(a.get("shape")) for a in attrs],
            "parent_id": raw["parent_id"].astype("uint64").to_numpy(),
            "span_id": raw["span_id"].astype("uint64").to_numpy(),
        },
        columns=cols,
    )


def inflight_slots(tl: pd.DataFrame) -> pd.Series:
    """A lane per query in flight: each query takes the lowest slot free at its start
    (a slot frees when its query ends), and its spans share that slot. Queries that
    overlap, that is queue behind one another, land on separate lanes; back-to-back
    queries reuse lane 0. Indexed like ``tl``; a span whose query has no query span
    goes to the slot of its query index's first span."""
    queries = tl[tl["kind"] == "query"].sort_values("start_ms")
    ends: list[float] = []  # ends[slot]: when that slot's query ends
    slot_of: dict[int, int] = {}
    for q in queries.itertuples():
        free = next((i for i, end in enumerate(ends) if end <= q.start_ms), len(ends))
        if free == len(ends):
            ends.append(q.end_ms)
        else:
            ends[free] = q.end_ms
        slot_of[int(q.query_index)] = free
    return pd.Series(
        [slot_of.get(int(i), 0) for i in tl["query_index"]], index=tl.index, dtype="int64"
    )


def system_samples(source: Source, evaluation_id: str) -> pd.DataFrame:
    """The evaluation's system samples (CPU, memory, GPU...), those of the agent it ran
    on (:func:`mlscope.tracerows.trace_rows`), empty where the table or the samples do
    not exist (system tracing is off below the ``system`` level)."""
    if not table_exists(source, "system_samples"):
        return pd.DataFrame()
    try:
        # FINAL: a redelivered sample batch must not show twice. The full sorting key
        # orders the rows, so that a paged read (BusSource) neither skips nor repeats.
        return source.frame(
            f"SELECT * FROM {trace_rows('system_samples')} "
            "ORDER BY agent_id, metric, device, ts_ns",
            {"e": evaluation_id},
        )
    except DatabaseError:
        return pd.DataFrame()


def _ints(column: pd.Series) -> list[int]:
    """A column of stored times as Python integers (which never wrap)."""
    return [int(v) for v in column]


def _ms(ns: Iterable[int]) -> np.ndarray:
    """Exact nanosecond differences as milliseconds."""
    return np.fromiter((v / 1e6 for v in ns), np.float64)
