"""Framework-level tracing: per-layer / per-op / per-kernel spans from each framework's
own profiler, parented under the predict span of the query they belong to.

No framework is modified; each module drives the profiler the framework ships:

=============  ==============================================================
onnxruntime    ``SessionOptions.enable_profiling`` on a second, profiling
               session of the same model (one per evaluation, read when it is
               released: :func:`flush`)
pytorch        ``torch.profiler.profile`` around the call; CUDA kernels are
               correlated to their op when a GPU is present
tensorflow     ``tf.profiler.experimental`` trace, read back from its XPlane
tflite         nothing: LiteRT's Python interpreter exposes no per-op timing
=============  ==============================================================

Use (in the inference thread, only when the query's level is ``framework`` or more)::

    with profiling.capture(predictor, full=level >= FULL) as cap:
        t0 = now(); out = predictor.predict(inputs); t1 = now()  # the predict span
    ...
    cap.emit(spans, parent=predict_span_id, query_index=index)

The predict span is timed inside the capture, so what a profiler does to start and
stop (open a session, read a trace) stays out of it; that cost is the predict span's
``profiler_ns`` attribute.

Span conventions (the analysis relies on them): ``kind="layer"`` for a graph node or
op, ``kind="kernel"`` for a device kernel (parent: its layer span); ``name`` is the
node name; ``attrs`` has at least ``op_type``, ``shape`` and ``device``.
"""

from __future__ import annotations

import importlib
import logging
import threading
import weakref
from typing import Any

from agent.profiling.base import NULL, Capture, FrameworkProfiler

__all__ = ["NULL", "Capture", "FrameworkProfiler", "capture", "flush", "profiler_for"]

log = logging.getLogger(__name__)

_MODULES = {
    "onnxruntime": "agent.profiling.onnxruntime",
    "pytorch": "agent.profiling.pytorch",
    "tensorflow": "agent.profiling.tensorflow",
    "tflite": "agent.profiling.tflite",
}
_profilers: weakref.WeakKeyDictionary[Any, FrameworkProfiler | None] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def profiler_for(predictor: Any) -> FrameworkProfiler | None:
    """The profiler of one predictor (made once, then reused); None if it has none."""
    with _lock:
        if predictor in _profilers:
            return _profilers[predictor]
        module = _MODULES.get(str(getattr(predictor, "framework", "")))
        prof: FrameworkProfiler | None = None
        if module is not None:
            prof = importlib.import_module(module).make(predictor)
        if prof is None:
            log.info(
                "no framework-level profiler for %s",
                getattr(predictor, "framework", type(predictor).__name__),
            )
        _profilers[predictor] = prof
        return prof


def flush(predictor: Any) -> int:
    """Emit the layer spans a profiler holds back (ONNX Runtime reads its events once per
    evaluation, see its module); call when an evaluation is released. Returns how many."""
    with _lock:
        prof = _profilers.get(predictor)
    pending = getattr(prof, "flush", None)
    return int(pending()) if pending is not None else 0


def capture(predictor: Any, *, full: bool = False) -> Capture:
    """A context manager around one predict call that collects its layer spans.

    ``full`` (trace level ``full``) also keeps what a profiler sees below a layer
    (PyTorch: the ops each layer op calls, as ``kind="op"`` spans under it).
    """
    prof = profiler_for(predictor)
    return NULL if prof is None else prof.capture(full=full)
