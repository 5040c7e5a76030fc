"""PyTorch: per-op spans from ``torch.profiler``, CUDA kernels correlated to their op.

Each profiled call runs inside ``torch.profiler.profile`` with a
``record_function("mlscope::predict")`` marker; the marker's start, known on both the
profiler's clock and the agent's, converts every event to the agent's clock.

Layers are the outermost ATen/TorchScript ops of the call (an op whose ancestors are
only the marker or TorchScript ``forward`` frames); the ops they call are inside
them, not spans of their own. With a GPU, each CUDA kernel is matched to the op that
launched it through the profiler's correlation ids (kernel ->
``cudaLaunchKernel`` runtime call -> the layer op that encloses that call on the
same thread) and becomes a ``kernel`` span under that op's layer span.
"""

from __future__ import annotations

import logging
from types import TracebackType
from typing import Any

from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile, record_function

from agent.profiling.base import Capture, LayerEvent

__all__ = ["TorchCapture", "TorchProfiler", "make"]

log = logging.getLogger(__name__)
MARK = "mlscope::predict"


class TorchProfiler:
    def __init__(self, device: str) -> None:
        self.device = device
        self.cuda = device.startswith("cuda")

    def capture(self, *, full: bool = False) -> Capture:
        return TorchCapture(self, full=full)


class TorchCapture(Capture):
    def __init__(self, prof: TorchProfiler, *, full: bool = False) -> None:
        super().__init__()
        self.prof, self.full = prof, full
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if prof.cuda else [])
        self._profile = profile(activities=acts, record_shapes=True)
        self._mark = record_function(MARK)

    def __enter__(self) -> Capture:
        self._profile.__enter__()  # type: ignore[no-untyped-call]
        super().__enter__()
        self._mark.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._mark.__exit__(et, ev, tb)
        super().__exit__(et, ev, tb)
        self._profile.__exit__(et, ev, tb)  # type: ignore[no-untyped-call]
        if et is None:
            try:
                self.events = self._collect()
            except Exception as exc:  # a profiler result this code does not understand
                log.warning("torch.profiler result unreadable, no layer spans: %s", exc)

    def _collect(self) -> list[LayerEvent]:
        events: list[FunctionEvent] = list(self._profile.events())  # type: ignore[no-untyped-call]
        mark = next((e for e in events if e.name == MARK), None)
        if mark is None:
            log.warning("torch.profiler recorded no %s marker: no layer spans", MARK)
            return []
        shift = self.start_ns - int(mark.time_range.start * 1000)
        layers = [e for e in events if _is_layer(e)]
        layers.sort(key=lambda e: e.time_range.start)
        out = [
            LayerEvent(
                name=e.name,
                op_type=e.name,
                start_ns=shift + int(e.time_range.start * 1000),
                end_ns=shift + int(e.time_range.end * 1000),
                shape={"inputs": list(e.input_shapes or [])},
                device=self.prof.device,
                extra={"seq": i},
            )
            for i, e in enumerate(layers)
        ]
        if self.full:
            out += _nested_ops(events, layers, shift, self.prof.device)
        if self.prof.cuda:
            out += _kernels(self._profile, layers, shift)
        return out


def _is_op(e: FunctionEvent) -> bool:
    return e.device_type.name == "CPU" and "::" in e.name and e.name != MARK


def _is_layer(e: FunctionEvent) -> bool:
    if not _is_op(e):
        return False
    parent = e.cpu_parent
    while parent is not None:
        if _is_op(parent):
            return False
        parent = parent.cpu_parent
    return True


def _nested_ops(
    events: list[FunctionEvent], layers: list[FunctionEvent], shift: int, device: str
) -> list[LayerEvent]:
    """At level full: every op a layer op calls, as an ``op`` span under that layer."""
    index = {id(e): i for i, e in enumerate(layers)}
    out = []
    for e in events:
        if not _is_op(e) or id(e) in index:
            continue
        top = e.cpu_parent
        while top is not None and id(top) not in index:
            top = top.cpu_parent
        if top is None:
            continue
        out.append(
            LayerEvent(
                name=e.name,
                op_type=e.name,
                kind="op",
                start_ns=shift + int(e.time_range.start * 1000),
                end_ns=shift + int(e.time_range.end * 1000),
                shape={"inputs": list(e.input_shapes or [])},
                device=device,
                layer=index[id(top)],
            )
        )
    return out


def _kernels(prof: Any, layers: list[FunctionEvent], shift: int) -> list[LayerEvent]:
    """CUDA kernels, each under the layer op that launched it (by correlation id)."""
    results = prof.profiler.kineto_results
    base = int(results.trace_start_ns())  # time_range values are µs after this
    raw = list(results.events())
    launches: dict[int, Any] = {}
    for k in raw:
        if k.device_type().name == "CPU" and k.correlation_id() > 0:
            launches[k.correlation_id()] = k
    out: list[LayerEvent] = []
    for k in raw:
        if k.device_type().name != "CUDA":
            continue
        launch = launches.get(k.linked_correlation_id())
        if launch is None:
            continue
        t = (launch.start_ns() - base) / 1000.0
        owner = next(
            (i for i, op in enumerate(layers) if op.time_range.start <= t <= op.time_range.end),
            None,
        )
        if owner is None:
            continue
        start = shift + int(k.start_ns()) - base
        out.append(
            LayerEvent(
                name=k.name(),
                op_type=layers[owner].name,
                kind="kernel",
                start_ns=start,
                end_ns=start + int(k.duration_ns()),
                device=f"cuda:{k.device_index()}",
                layer=owner,
            )
        )
    return out


def make(predictor: Any) -> TorchProfiler | None:
    return TorchProfiler(str(getattr(predictor, "device", "cpu")))
