"""TensorFlow: per-op spans from ``tf.profiler.experimental``, read back from its XPlane.

Each profiled call runs between ``tf.profiler.experimental.start(logdir)`` and
``stop()`` with a ``Trace("mlscope::predict")`` annotation around it. The profiler
writes one ``*.xplane.pb`` (an ``XSpace`` protobuf); on the ``/host:CPU`` plane the
executor threads (lines ``tf_Compute/...``) hold one event per executed graph node,
named ``<node name>:<op type>``. The annotation's start, known on both the
profiler's clock and the agent's, converts event times to the agent's clock.

Limits: TensorFlow allows one profiler session per process, so profiled calls are
serialized (a process-wide lock); shapes are not in the host events (``shape`` is
null); on a GPU the device planes' kernels are not correlated yet (only host ops are
spans). Each capture costs a profiler start/stop and a protobuf write+read.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

import tensorflow as tf

from agent.profiling.base import Capture, LayerEvent
from mlscope import scratch

__all__ = ["TfCapture", "TfProfiler", "make", "xspace_events"]

log = logging.getLogger(__name__)
MARK = "mlscope::predict"
_one_session = threading.Lock()


def _xplane_pb2() -> Any:
    try:
        from tsl.profiler.protobuf import xplane_pb2  # type: ignore[import-not-found, unused-ignore]
    except ImportError:  # older TensorFlow wheels vendor it under tensorflow.tsl
        from tensorflow.tsl.profiler.protobuf import (  # type: ignore[import-not-found, no-redef, unused-ignore]
            xplane_pb2,
        )
    return xplane_pb2


class TfProfiler:
    def __init__(self, device: str) -> None:
        self.device = device

    def capture(self, *, full: bool = False) -> Capture:
        return TfCapture(self)


class TfCapture(Capture):
    def __init__(self, prof: TfProfiler) -> None:
        super().__init__()
        self.prof = prof
        self._dir = ""
        self._trace: Any = None

    def __enter__(self) -> Capture:
        _one_session.acquire()
        self._dir = str(scratch.scratch_path("tfprof"))
        try:
            tf.profiler.experimental.start(self._dir)
        except Exception as exc:  # e.g. a profiler session someone else started
            log.warning("tensorflow profiler did not start, no layer spans: %s", exc)
            shutil.rmtree(self._dir, ignore_errors=True)
            _one_session.release()
            self._dir = ""
            return super().__enter__()
        self._trace = tf.profiler.experimental.Trace(MARK)
        super().__enter__()
        self._trace.__enter__()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._dir:  # the profiler never started
            super().__exit__(et, ev, tb)
            return
        try:
            self._trace.__exit__(et, ev, tb)
            super().__exit__(et, ev, tb)
            tf.profiler.experimental.stop()
            if et is None:
                files = sorted(Path(self._dir).rglob("*.xplane.pb"))
                if files:
                    self.events = _read(files[-1], self.start_ns, self.prof.device)
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)
            _one_session.release()


def _read(path: Path, mark_ns: int, device: str) -> list[LayerEvent]:
    try:
        space = _xplane_pb2().XSpace()
        space.ParseFromString(path.read_bytes())
    except Exception as exc:  # protobuf's DecodeError, a missing module: no spans
        log.warning("unreadable tensorflow profile %s: %s", path, exc)
        return []
    return xspace_events(space, mark_ns=mark_ns, device=device)


def xspace_events(space: Any, *, mark_ns: int, device: str) -> list[LayerEvent]:
    """Graph-node events of the host plane, on the agent clock (the marker at mark_ns)."""
    host = next((p for p in space.planes if p.name == "/host:CPU"), None)
    if host is None:
        return []
    md = host.event_metadata
    mark: int | None = None
    raw: list[tuple[int, int, str]] = []
    for line in host.lines:
        for e in line.events:
            name = md[e.metadata_id].name
            start = line.timestamp_ns + e.offset_ps // 1000
            if name == MARK:
                mark = start
            elif ":" in name and "::" not in name and line.name.startswith("tf_Compute"):
                raw.append((start, start + e.duration_ps // 1000, name))
    if mark is None:
        log.warning("tensorflow profile has no %s marker: no layer spans", MARK)
        return []
    shift = mark_ns - mark
    raw.sort()
    out = []
    for start, end, name in raw:
        node, _, op_type = name.rpartition(":")
        out.append(
            LayerEvent(
                name=node,
                op_type=op_type,
                start_ns=start + shift,
                end_ns=end + shift,
                shape=None,
                device=device,
            )
        )
    return out


def make(predictor: Any) -> TfProfiler | None:
    return TfProfiler(str(getattr(predictor, "device", "cpu")))
