"""Layer analysis (paper Table 3): where the time of one evaluation goes.

Span convention (docs/ARCHITECTURE.md, "Tracing"): ``kind="layer"`` for a graph node
or op (parent: the predict span), ``kind="kernel"`` for a device kernel (parent: its
layer span), ``name`` the node name, ``attrs`` JSON with ``op_type``, ``shape`` and
``device``. Where a framework reports ops but no layers (``kind="op"`` only), the ops
are the layers.

Sums and counts are done in SQL (one row per layer comes back, not one per span).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pandas as pd

from analysis.source import Source

__all__ = ["layer_kind", "layer_kinds", "layer_types", "shape_text", "top_layers"]


def layer_kind(source: Source, evaluation_id: str) -> str | None:
    """ "layer" or "op", whichever spans this evaluation has (None: neither)."""
    return layer_kinds(source, [evaluation_id])[evaluation_id]


def layer_kinds(source: Source, ids: Sequence[str]) -> dict[str, str | None]:
    """:func:`layer_kind` of each of ``ids``, in one query."""
    got = (
        source.frame(
            "SELECT evaluation_id, kind, count() AS n FROM spans FINAL WHERE evaluation_id "
            "IN {ids:Array(String)} AND kind IN ('layer', 'op') GROUP BY evaluation_id, kind",
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


def _layers_sql(kind: str) -> str:
    return (
        "SELECT agent_id, span_id, name, end_ns - start_ns AS ns, attrs FROM spans FINAL "
        f"WHERE evaluation_id = {{e:String}} AND kind = '{kind}'"
    )


def top_layers(
    source: Source, evaluation_id: str, n: int = 10, *, kind: str | None = None
) -> pd.DataFrame:
    """The ``n`` layers with the most time: rank, layer, op_type, shape, calls, total_ms,
    mean_ms, share (of all layer time), dominant (kernel or op), dominant_ms (its total),
    dominant_share (of the layer's kernel time), alloc_mb (the memory its outputs take,
    where the profiler reports it: ONNX Runtime; else None), predict_share (of the time
    of every predict span of the evaluation: how much of inference the layer explains;
    None without predict spans). ``kind``: :func:`layer_kind` when the caller knows it."""
    cols = [
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
    kind = _kind(source, evaluation_id, kind)
    if kind is None:
        return pd.DataFrame(columns=cols)
    params = {"e": evaluation_id}
    layers = source.frame(
        f"SELECT name AS layer, count() AS calls, sum(ns) AS total_ns, any(attrs) AS attrs "
        f"FROM ({_layers_sql(kind)}) GROUP BY layer ORDER BY total_ns DESC, layer",
        params,
    )
    total_all = float(layers["total_ns"].sum()) or 1.0
    predict_ns = _predict_ns(source, evaluation_id)
    top = layers.head(n)
    kernels = source.frame(
        f"SELECT l.name AS layer, k.name AS child, sum(k.end_ns - k.start_ns) AS ns "
        f"FROM (SELECT agent_id, parent_id, name, start_ns, end_ns FROM spans FINAL "
        f"WHERE evaluation_id = {{e:String}} AND kind IN ('kernel', 'op') "
        f"AND kind != '{kind}') AS k "
        f"INNER JOIN ({_layers_sql(kind)}) AS l "
        f"ON k.parent_id = l.span_id AND k.agent_id = l.agent_id "
        f"WHERE l.name IN {{names:Array(String)}} GROUP BY layer, child "
        f"ORDER BY layer, ns DESC, child",
        {**params, "names": list(top["layer"])},
    )
    rows = []
    for i, r in enumerate(top.to_dict("records"), start=1):
        attrs = _attrs(r["attrs"])
        mine = kernels[kernels["layer"] == r["layer"]] if len(kernels) else kernels
        if len(mine):
            dom, dom_ns, dom_share = (
                str(mine["child"].iloc[0]),
                float(mine["ns"].iloc[0]),
                float(mine["ns"].iloc[0]) / float(mine["ns"].sum()),
            )
        else:  # no kernel below this layer: its op is what dominates
            dom, dom_ns, dom_share = (attrs.get("op_type") or r["layer"], float(r["total_ns"]), 1.0)
        rows.append(
            {
                "rank": i,
                "layer": r["layer"],
                "op_type": attrs.get("op_type", ""),
                "shape": shape_text(attrs.get("shape")),
                "device": attrs.get("device", ""),
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
        )
    return pd.DataFrame(rows, columns=cols)


def _predict_ns(source: Source, evaluation_id: str) -> float:
    """The summed duration of the evaluation's predict spans (0.0: none)."""
    got = source.frame(
        "SELECT sum(end_ns - start_ns) AS ns, count() AS n FROM spans FINAL "
        "WHERE evaluation_id = {e:String} AND kind = 'step' AND name = 'predict'",
        {"e": evaluation_id},
    )
    return float(got["ns"].iloc[0]) if len(got) and int(got["n"].iloc[0]) else 0.0


def layer_types(source: Source, evaluation_id: str, *, kind: str | None = None) -> pd.DataFrame:
    """Aggregates by layer type: op_type, layers (distinct), calls, total_ms, mean_ms,
    share of all layer time; most time first. ``kind`` as in :func:`top_layers`."""
    cols = ["op_type", "layers", "calls", "total_ms", "mean_ms", "share"]
    kind = _kind(source, evaluation_id, kind)
    if kind is None:
        return pd.DataFrame(columns=cols)
    got = source.frame(
        f"SELECT JSONExtractString(attrs, 'op_type') AS op_type, uniqExact(name) AS layers, "
        f"count() AS calls, sum(ns) AS total_ns FROM ({_layers_sql(kind)}) "
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
    """Bytes -> MB (10⁶); None where the framework's profiler reports no memory."""
    return int(value) / 1e6 if isinstance(value, int | float) else None


def _attrs(raw: Any) -> dict[str, Any]:
    try:
        got = json.loads(raw) if raw else {}
    except (TypeError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def shape_text(shape: Any) -> str:
    """``1×8×26×26``; several tensors comma-separated; a profiler's
    ``{"inputs": [...], "outputs": [...]}`` as ``1×1×8×8 → 1×8×6×6`` (the dtypes
    dropped, as ``{"dtype": "float", "shape": [...]}`` reads ``1×8×6×6``)."""
    if isinstance(shape, dict) and ("inputs" in shape or "outputs" in shape):
        ins, outs = shape_text(shape.get("inputs")), shape_text(shape.get("outputs"))
        return f"{ins} → {outs}" if ins and outs else ins or outs
    if isinstance(shape, dict):
        return shape_text(shape.get("shape"))
    if isinstance(shape, list | tuple):
        if shape and all(isinstance(s, list | tuple | dict) for s in shape):
            return ", ".join(shape_text(s) for s in shape)
        return "×".join(str(s) for s in shape)
    return "" if shape is None else str(shape)
