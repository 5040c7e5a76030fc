"""What one answered query carries back from its predict (:class:`Outcome`), and the one
function that turns it into the query's model-level spans (:func:`emit_spans`), for the
executor's queries and a stream's alike. Framework-level profiles hang under the predict
span here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from agent.profiling import NULL, Capture
from agent.tracer import SpanBuffer
from mlscope.contracts import TraceLevel
from mlscope.errors import MLScopeError

__all__ = ["Outcome", "emit_spans"]


@dataclass(slots=True)
class Outcome:
    """What one query of a predicted batch gets back."""

    result: np.ndarray | None = None
    raw: np.ndarray | None = None
    error: MLScopeError | None = None
    t_predict: int = 0
    t_predict_end: int = 0
    t_post_end: int = 0
    batch: int = 0
    capture: Capture = NULL
    """Framework-level profile of the predict call (empty below level framework)."""


def emit_spans(
    spans: SpanBuffer,
    index: int,
    level: TraceLevel,
    samples: int,
    received_ns: int,
    out: Outcome,
    *,
    pre: tuple[int, int],
) -> None:
    """The model-level spans of one answered query (``samples`` of them, received at
    ``received_ns``, pre-processed over ``pre``): query > preprocess, predict, post."""
    t_pre, t_pre_end = pre
    attrs: dict[str, Any] = {"batch_size": samples}
    if out.batch != attrs["batch_size"]:
        attrs["predict_batch"] = out.batch  # merged with other queries
    root = spans.add(
        parent=0,
        query_index=index,
        level=TraceLevel.MODEL,
        kind="query",
        name="query",
        start_ns=received_ns,
        end_ns=out.t_post_end,
        attrs=attrs,
    )
    for name, a, b in (
        ("preprocess", t_pre, t_pre_end),
        ("predict", out.t_predict, out.t_predict_end),
        ("postprocess", out.t_predict_end, out.t_post_end),
    ):
        cap = out.capture if name == "predict" else NULL
        step_attrs = (
            {"profiler_ns": max(cap.end_ns - cap.start_ns - (b - a), 0)}
            if cap is not NULL and cap.end_ns
            else None
        )
        sid = spans.add(
            parent=root,
            query_index=index,
            level=TraceLevel.MODEL,
            kind="step",
            name=name,
            start_ns=a,
            end_ns=b,
            attrs=step_attrs,
        )
        if cap is not NULL and level >= TraceLevel.FRAMEWORK:
            cap.emit(spans, parent=sid, query_index=index, window=(a, b))
