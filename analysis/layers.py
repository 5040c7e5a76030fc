"""Layer analysis (paper Table 3): where the time of one evaluation goes.

Span convention (docs/ARCHITECTURE.md, "Tracing"): ``kind="layer"`` for a graph node
or op (parent: the predict span), ``kind="kernel"`` for a device kernel (parent: its
layer span), ``name`` the node name, ``attrs`` JSON with ``op_type``, ``shape`` and
``device``. Where a framework reports ops but no layers (``kind="op"`` only), the ops
are the layers.

Sums and counts are done in SQL (one row per layer comes back, not one per span).
The spans of warm-up queries (flagged in ``queries``) are left out of every table, as
their latency is left out of the summary.

Spans are written by agents, which are not trusted, and a ClickHouse server may hold
any rows, so nothing here assumes a span is well formed:

* an evaluation's spans are those of the agent it ran on: every table reads them
  through :func:`mlscope.tracerows.trace_rows` (another agent's, published under its
  id, are not counted);
* :func:`span_attrs` is the one reader of a span's ``attrs``, for every reader of spans;
* durations and their sums are taken in 128-bit integers (two Int64 times may be 2⁶⁴
  apart), and a span that ends before it starts is left out of the tables
  (:func:`layer_spans_left_out` counts them);
* :func:`shape_text` is bounded whatever the shape it is given.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import pandas as pd

from analysis.source import Source
from mlscope.bounded import json_depth
from mlscope.tracerows import MANY, trace_rows

__all__ = [
    "ATTRS_MAX_CHARS",
    "ATTRS_MAX_DEPTH",
    "ATTR_TEXT_MAX_CHARS",
    "SHAPE_MAX_CHARS",
    "TOP_LAYER_COLUMNS",
    "attr_text",
    "layer_kind",
    "layer_kinds",
    "layer_spans_left_out",
    "layer_types",
    "shape_text",
    "span_attrs",
    "top_layers",
]

ATTRS_MAX_CHARS = 1 << 20
"""The longest ``attrs`` text read (the bus's default max payload: an agent's span batch
holds no longer one); a longer one reads as no attributes."""
ATTRS_MAX_DEPTH = 16
"""How deeply ``attrs`` may nest (a profiler's shapes take four levels); deeper text
reads as no attributes, before any parser recurses into it."""
ATTR_TEXT_MAX_CHARS = 200
"""The longest attribute text shown (``op_type``, ``device``); a longer one is not."""
SHAPE_MAX_CHARS = 200
"""The longest text :func:`shape_text` gives (cut with "…")."""
_SHAPE_MAX_DEPTH = 8
"""Levels of nesting :func:`shape_text` follows ("…" below them)."""
_INT_LIMIT = 1 << 64
"""Integers in attributes are read within ±2⁶⁴ (a byte count, a dimension)."""


def layer_kind(source: Source, evaluation_id: str) -> str | None:
    """ "layer" or "op", whichever spans this evaluation has (None: neither)."""
    return layer_kinds(source, [evaluation_id])[evaluation_id]


def layer_kinds(source: Source, ids: Sequence[str]) -> dict[str, str | None]:
    """:func:`layer_kind` of each of ``ids``, in one query."""
    got = (
        source.frame(
            f"SELECT evaluation_id, kind, count() AS n FROM {trace_rows('spans', MANY)} "
            "AND kind IN ('layer', 'op') GROUP BY evaluation_id, kind "
            "ORDER BY evaluation_id, kind",
            {"ids": list(ids)},
        )
        if ids
        else pd.DataFrame()
    )
    found: dict[str, set[str]] = {}
    for e, k in zip(got.get("evaluation_id", ()), got.get("kind", ()), strict=True):
        found.setdefault(str(e), set()).add(str(k))
    kinds = {e: found.get(e, set()) for e in ids}
    return {e: "layer" if "layer" in k else "op" if "op" in k else None for e, k in kinds.items()}


def _kind(source: Source, evaluation_id: str, kind: str | None) -> str | None:
    """``kind`` as given (it goes into SQL: "layer" or "op" only), else found."""
    if kind is None:
        return layer_kind(source, evaluation_id)
    if kind not in ("layer", "op"):
        raise ValueError(f"layer kind must be 'layer' or 'op', not {kind!r}")
    return kind


_DURATION = "toInt128(end_ns) - toInt128(start_ns)"
"""A span's duration in ns, exact whatever its two Int64 times (65 bits at most); its
sums are taken in Int128 too and read as Float64 (:func:`_sum`)."""
_FORWARD = "end_ns >= start_ns"
"""The spans the layer tables count: one that ends before it starts has no duration."""
_MEASURED = (
    "query_index NOT IN (SELECT query_index FROM queries FINAL "
    "WHERE evaluation_id = {e:String} AND warmup != 0)"
)
"""The spans of measured queries: a warm-up query's spans (its row in ``queries`` says
so) are left out of the layer tables, as its latency is left out of every figure."""


def _sum(expr: str) -> str:
    """``sum(expr)`` of Int128 durations, as a float (never wrapped)."""
    return f"toFloat64(sum({expr}))"


def _layers_sql(kind: str) -> str:
    return (
        f"SELECT agent_id, span_id, name, {_DURATION} AS ns, attrs FROM {trace_rows('spans')} "
        f"AND kind = '{kind}' AND {_FORWARD} AND {_MEASURED}"
    )


def layer_spans_left_out(source: Source, evaluation_id: str, *, kind: str | None = None) -> int:
    """How many of the measured queries' layer spans the layer tables leave out: those
    whose stored end is before their start (warm-up queries' spans are left out of
    the tables anyway). ``kind`` as in :func:`top_layers`."""
    kind = _kind(source, evaluation_id, kind)
    if kind is None:
        return 0
    got = source.frame(
        f"SELECT count() AS n FROM {trace_rows('spans')} "
        f"AND kind = '{kind}' AND NOT ({_FORWARD}) AND {_MEASURED}",
        {"e": evaluation_id},
    )
    return int(got["n"].iloc[0]) if len(got) else 0


TOP_LAYER_COLUMNS = [
    "rank",
    "layer",
    "op_type",
    "shape",
    "device",
    "calls",
    "total_ms",
    "mean_ms",
    "share",
    "dominant",
    "dominant_ms",
    "dominant_share",
    "alloc_mb",
    "predict_share",
]
"""The columns of :func:`top_layers`."""


def top_layers(
    source: Source, evaluation_id: str, n: int = 10, *, kind: str | None = None
) -> pd.DataFrame:
    """The ``n`` layers with the most time: rank, layer, op_type, shape, calls, total_ms,
    mean_ms, share (of all layer time), dominant (kernel or op), dominant_ms (its total),
    dominant_share (of the layer's kernel time), alloc_mb (the memory its outputs take,
    where the profiler reports it: ONNX Runtime; else None), predict_share (of the time
    of every predict span of the evaluation: how much of inference the layer explains;
    None without predict spans). ``kind``: :func:`layer_kind` when the caller knows it.
    Only the spans of measured queries count: a warm-up query's are left out, as in
    every other figure (:data:`_MEASURED`).
    Spans that end before they start are left out (:func:`layer_spans_left_out`), and
    attributes that cannot be read are not shown (:func:`span_attrs`)."""
    kind = _kind(source, evaluation_id, kind)
    if kind is None:
        return pd.DataFrame(columns=TOP_LAYER_COLUMNS)
    layers = source.frame(
        f"SELECT name AS layer, count() AS calls, {_sum('ns')} AS total_ns, any(attrs) AS attrs "
        f"FROM ({_layers_sql(kind)}) GROUP BY layer ORDER BY total_ns DESC, layer",
        {"e": evaluation_id},
    )
    total_all = float(layers["total_ns"].sum()) or 1.0
    predict_ns = _predict_ns(source, evaluation_id)
    top = layers.head(n)
    kernels = _kernels_below(source, evaluation_id, kind, list(top["layer"]))
    rows = [
        _layer_row(i, r, kernels, total_all=total_all, predict_ns=predict_ns)
        for i, r in enumerate(top.to_dict("records"), start=1)
    ]
    return pd.DataFrame(rows, columns=TOP_LAYER_COLUMNS)


def _kernels_below(
    source: Source, evaluation_id: str, kind: str, layers: list[str]
) -> pd.DataFrame:
    """layer, child, ns: the time of each kernel (or op) below each of ``layers``, most
    first within a layer."""
    return source.frame(
        f"SELECT l.name AS layer, k.name AS child, {_sum('k.ns')} AS ns "
        f"FROM (SELECT agent_id, parent_id, name, {_DURATION} AS ns FROM {trace_rows('spans')} "
        f"AND kind IN ('kernel', 'op') AND kind != '{kind}' AND {_FORWARD}) AS k "
        f"INNER JOIN ({_layers_sql(kind)}) AS l "
        f"ON k.parent_id = l.span_id AND k.agent_id = l.agent_id "
        f"WHERE l.name IN {{names:Array(String)}} GROUP BY layer, child "
        f"ORDER BY layer, ns DESC, child",
        {"e": evaluation_id, "names": layers},
    )


def _layer_row(
    rank: int,
    r: dict[str, Any],
    kernels: pd.DataFrame,
    *,
    total_all: float,
    predict_ns: float,
) -> dict[str, Any]:
    """One row of :func:`top_layers` from the layer's aggregate ``r``."""
    attrs = span_attrs(r["attrs"])
    op_type = attr_text(attrs, "op_type")
    mine = kernels[kernels["layer"] == r["layer"]] if len(kernels) else kernels
    if len(mine):
        dom_ns = float(mine["ns"].iloc[0])
        # kernels of no time at all: the first of them is all there is
        dom, dom_share = str(mine["child"].iloc[0]), dom_ns / (float(mine["ns"].sum()) or 1.0)
    else:  # no kernel below this layer: its op is what dominates
        dom, dom_ns, dom_share = (op_type or r["layer"], float(r["total_ns"]), 1.0)
    return {
        "rank": rank,
        "layer": r["layer"],
        "op_type": op_type,
        "shape": shape_text(attrs.get("shape")),
        "device": attr_text(attrs, "device"),
        "calls": int(r["calls"]),
        "total_ms": float(r["total_ns"]) / 1e6,
        "mean_ms": float(r["total_ns"]) / int(r["calls"]) / 1e6,
        "share": float(r["total_ns"]) / total_all,
        "dominant": dom,
        "dominant_ms": dom_ns / 1e6,
        "dominant_share": dom_share,
        "alloc_mb": _mb(attrs.get("output_bytes")),
        "predict_share": float(r["total_ns"]) / predict_ns if predict_ns else None,
    }


def _predict_ns(source: Source, evaluation_id: str) -> float:
    """The summed duration of the measured queries' predict spans (0.0: none)."""
    got = source.frame(
        f"SELECT {_sum(_DURATION)} AS ns, count() AS n FROM {trace_rows('spans')} "
        f"AND kind = 'step' AND name = 'predict' AND {_FORWARD} AND {_MEASURED}",
        {"e": evaluation_id},
    )
    return float(got["ns"].iloc[0]) if len(got) and int(got["n"].iloc[0]) else 0.0


def layer_types(source: Source, evaluation_id: str, *, kind: str | None = None) -> pd.DataFrame:
    """Aggregates by layer type: op_type, layers (distinct), calls, total_ms, mean_ms,
    share of all layer time; most time first (warm-up queries' spans left out).
    ``kind`` as in :func:`top_layers`."""
    cols = ["op_type", "layers", "calls", "total_ms", "mean_ms", "share"]
    kind = _kind(source, evaluation_id, kind)
    if kind is None:
        return pd.DataFrame(columns=cols)
    # ClickHouse's JSON reader is bounded and reads text it cannot parse as no value
    got = source.frame(
        f"SELECT op_type, uniqExact(name) AS layers, count() AS calls, "
        f"{_sum('ns')} AS total_ns FROM (SELECT name, ns, "
        f"JSONExtractString(attrs, 'op_type') AS t, "
        f"if(length(t) <= {ATTR_TEXT_MAX_CHARS}, t, '') AS op_type FROM ({_layers_sql(kind)})) "
        f"GROUP BY op_type ORDER BY total_ns DESC, op_type",
        {"e": evaluation_id},
    )
    total = float(got["total_ns"].sum()) or 1.0
    out = pd.DataFrame(
        {
            "op_type": [t or "(unknown)" for t in got["op_type"]],
            "layers": got["layers"].astype(int),
            "calls": got["calls"].astype(int),
            "total_ms": got["total_ns"].astype(float) / 1e6,
        }
    )
    out["mean_ms"] = out["total_ms"] / out["calls"]
    out["share"] = got["total_ns"].astype(float) / total
    return out[cols]


def _mb(value: Any) -> float | None:
    """Bytes -> MB (10⁶); None where the framework's profiler reports no memory, or no
    count of bytes (not a number, negative, not finite, past 2⁶³)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not 0 <= value < 1 << 63:  # NaN fails every comparison
        return None
    return int(value) / 1e6


def span_attrs(raw: object) -> dict[str, Any]:
    """A span's ``attrs`` (JSON text an agent wrote, not trusted) as a dict: what every
    reader of spans reads them with. It never raises: text that is not a JSON object,
    longer than :data:`ATTRS_MAX_CHARS` or nested deeper than :data:`ATTRS_MAX_DEPTH`
    reads as ``{}``; a number that is not finite (``NaN``, ``Infinity``, ``1e999``) or an
    integer beyond ±2⁶⁴ reads as None, so that whoever shows a number gets one it can
    use, and whoever writes the attributes again writes valid JSON."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode()
        except UnicodeDecodeError:
            return {}
    if not isinstance(raw, str) or not raw or len(raw) > ATTRS_MAX_CHARS:
        return {}
    if raw.count("[") + raw.count("{") > ATTRS_MAX_DEPTH and json_depth(raw) > ATTRS_MAX_DEPTH:
        return {}
    try:
        got = json.loads(
            raw, parse_constant=_no_number, parse_float=_finite, parse_int=_bounded_int
        )
    except (ValueError, RecursionError):
        return {}
    return got if isinstance(got, dict) else {}


def _no_number(_: str) -> None:
    """``NaN``, ``Infinity`` and ``-Infinity``: JSON has no such numbers."""
    return None


def _finite(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


def _bounded_int(text: str) -> int | None:
    if len(text) > 21:  # ±2⁶⁴ has 20 digits; never convert a longer run of them
        return None
    value = int(text)
    return value if -_INT_LIMIT < value < _INT_LIMIT else None


def attr_text(attrs: dict[str, Any], key: str) -> str:
    """The text attribute ``key`` (``op_type``, ``device``) of :func:`span_attrs`' dict;
    "" where it is missing, not text, or longer than :data:`ATTR_TEXT_MAX_CHARS`."""
    value = attrs.get(key)
    return value if isinstance(value, str) and len(value) <= ATTR_TEXT_MAX_CHARS else ""


def shape_text(shape: Any) -> str:
    """``1×8×26×26``; several tensors comma-separated; a profiler's
    ``{"inputs": [...], "outputs": [...]}`` as ``1×1×8×8 → 1×8×6×6`` (the dtypes
    dropped, as ``{"dtype": "float", "shape": [...]}`` reads ``1×8×6×6``). Whatever
    ``shape`` holds, the text is at most :data:`SHAPE_MAX_CHARS` characters (cut with
    "…"), nesting is followed a few levels deep ("…" below), and a dimension that is
    neither a number nor a name reads "?"."""
    text = _shape_text(shape, _SHAPE_MAX_DEPTH)
    return text if len(text) <= SHAPE_MAX_CHARS else text[: SHAPE_MAX_CHARS - 1] + "…"


def _shape_text(shape: Any, depth: int) -> str:
    if depth == 0:
        return "…"
    if isinstance(shape, dict) and ("inputs" in shape or "outputs" in shape):
        ins = _shape_text(shape.get("inputs"), depth - 1)
        outs = _shape_text(shape.get("outputs"), depth - 1)
        return f"{ins} → {outs}" if ins and outs else ins or outs
    if isinstance(shape, dict):
        return _shape_text(shape.get("shape"), depth - 1)
    if isinstance(shape, list | tuple):
        # each item shows at least one character: more than fit are never looked at
        items = shape[: SHAPE_MAX_CHARS + 1]
        if items and all(isinstance(s, list | tuple | dict) for s in items):
            return ", ".join(_shape_text(s, depth - 1) for s in items)
        return "×".join(_dimension(s) for s in items)
    return "" if shape is None else _dimension(shape)


def _dimension(value: Any) -> str:
    """One dimension: a size, or a symbolic name (``batch``)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < _INT_LIMIT:
        return str(value)
    if isinstance(value, str):
        return value[: SHAPE_MAX_CHARS + 1]
    return "?"
