"""What every framework profiler provides: a capture around one predict call."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

from agent.tracer import SpanBuffer
from mlscope.contracts import TraceLevel

__all__ = ["NULL", "Capture", "FrameworkProfiler", "LayerEvent", "NullCapture", "emit_events"]


@dataclass
class LayerEvent:
    """One node/op (kind "layer") or device kernel (kind "kernel") of one run.

    Times are on the agent's monotonic clock (``time.perf_counter_ns``). A kernel
    names its layer by ``layer`` (an index into the same list of events).
    """

    name: str
    op_type: str
    start_ns: int
    end_ns: int
    kind: str = "layer"
    shape: Any = None
    device: str = "cpu"
    layer: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Capture:
    """Collects the framework events of one predict call; subclasses fill ``events``."""

    def __init__(self) -> None:
        self.events: list[LayerEvent] = []
        self.start_ns = 0
        self.end_ns = 0

    def __enter__(self) -> Capture:
        self.start_ns = time.perf_counter_ns()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.end_ns = time.perf_counter_ns()

    def emit(
        self,
        spans: SpanBuffer,
        *,
        parent: int,
        query_index: int,
        window: tuple[int, int] | None = None,
    ) -> int:
        """Add the collected events as spans under ``parent``; returns how many."""
        return emit_events(
            spans, self.events, parent=parent, query_index=query_index, window=window
        )


class NullCapture(Capture):
    """The capture of a predictor without a profiler: collects nothing."""

    def __enter__(self) -> Capture:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None


NULL = NullCapture()


class FrameworkProfiler(Protocol):
    def capture(self, *, full: bool = False) -> Capture: ...


def emit_events(
    spans: SpanBuffer,
    events: list[LayerEvent],
    *,
    parent: int,
    query_index: int,
    window: tuple[int, int] | None = None,
) -> int:
    """Layer spans under ``parent``, kernels and ops under their layer; times clamped to
    ``window``.

    Clamping keeps a child inside its predict span when two clocks disagree by a few
    microseconds (a profiler's timestamps converted to the agent's clock).
    """
    lo, hi = window if window is not None else (None, None)
    ids: dict[int, int] = {}
    for pos, e in enumerate(events):
        start, end = e.start_ns, e.end_ns
        if lo is not None and hi is not None:
            start = min(max(start, lo), hi)
            end = min(max(end, start), hi)
        attrs: dict[str, Any] = {"op_type": e.op_type, "shape": e.shape, "device": e.device}
        attrs.update(e.extra)
        owner = parent
        if e.kind in ("kernel", "op") and e.layer is not None and e.layer in ids:
            owner = ids[e.layer]
        ids[pos] = spans.add(
            parent=owner,
            query_index=query_index,
            level=TraceLevel.FRAMEWORK,
            kind=e.kind,
            name=e.name,
            start_ns=start,
            end_ns=end,
            attrs=attrs,
        )
    return len(events)
