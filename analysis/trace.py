"""The timeline of one evaluation, at a chosen depth: model → layer → kernel.

Times are in milliseconds from the evaluation's first span, on the agent's clock
(every span of one agent shares it; the load generator's offset is stored per
evaluation and applied by ``mlscope trace`` (``cli/trace_cmd.py``), not needed within
one agent).
"""

from __future__ import annotations

import json

import pandas as pd

from analysis.data import spans
from analysis.source import Source, table_exists
from mlscope.errors import DatabaseError

__all__ = ["DEPTHS", "system_samples", "timeline"]

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
    end_ms, dur_ms, op_type, shape, parent_id, span_id."""
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
    t0 = int(raw["start_ns"].min())
    attrs = [_json(a) for a in raw["attrs"]]
    return pd.DataFrame(
        {
            "kind": raw["kind"].astype(str).to_numpy(),
            "name": raw["name"].to_numpy(),
            "lane": [_ROW.get(k, 4) for k in raw["kind"]],
            "query_index": raw["query_index"].astype(int).to_numpy(),
            "start_ms": (raw["start_ns"].astype("int64") - t0).to_numpy() / 1e6,
            "end_ms": (raw["end_ns"].astype("int64") - t0).to_numpy() / 1e6,
            "dur_ms": (raw["end_ns"].astype("int64") - raw["start_ns"].astype("int64")).to_numpy()
            / 1e6,
            "op_type": [str(a.get("op_type", "")) for a in attrs],
            "shape": [json.dumps(a["shape"]) if "shape" in a else "" for a in attrs],
            "parent_id": raw["parent_id"].astype("uint64").to_numpy(),
            "span_id": raw["span_id"].astype("uint64").to_numpy(),
        },
        columns=cols,
    )


def system_samples(source: Source, evaluation_id: str) -> pd.DataFrame:
    """The evaluation's system samples (CPU, memory, GPU...), empty where the table or
    the samples do not exist (system tracing is off below the ``system`` level)."""
    if not table_exists(source, "system_samples"):
        return pd.DataFrame()
    try:
        # FINAL: a redelivered sample batch must not show twice. The full sorting key
        # orders the rows, so that a paged read (BusSource) neither skips nor repeats.
        return source.frame(
            "SELECT * FROM system_samples FINAL WHERE evaluation_id = "
            "{e:String} ORDER BY agent_id, metric, device, ts_ns",
            {"e": evaluation_id},
        )
    except DatabaseError:
        return pd.DataFrame()


def _json(raw: object) -> dict[str, object]:
    try:
        got = json.loads(str(raw)) if raw else {}
    except ValueError:
        return {}
    return got if isinstance(got, dict) else {}
