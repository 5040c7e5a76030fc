"""ONNX Runtime: per-node spans from the runtime's own profiler.

ORT profiles a whole session (``SessionOptions.enable_profiling``) and hands the
events over only through ``end_profiling()``, which writes a JSON file and stops
profiling for good; there is no per-run switch in its Python API. So profiled runs
go through one profiling twin of the model (same file, options and providers as the
predictor's), opened once per evaluation and read when the evaluation is released
(:class:`OrtProfiler`): each node event belongs to the query whose predict window
holds it. Opening and reading the session happen outside every predict span, so the
predict span of a traced query is the run itself (with ORT's per-node recording).

Node events (``cat == "Node"``, name ``<node>_kernel_time``) carry the op type,
input/output shapes and provider. Their timestamps are microseconds from
``get_profiling_start_time_ns()`` on the wall clock; they are converted to the
agent's monotonic clock with an offset taken at the same instant.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import onnxruntime as ort

from agent.profiling.base import Capture, LayerEvent, emit_events
from agent.tracer import SpanBuffer
from mlscope import scratch

__all__ = ["FLUSH_EVERY", "OrtCapture", "OrtProfiler", "make", "node_events"]

log = logging.getLogger(__name__)
_SUFFIX = "_kernel_time"


FLUSH_EVERY = 512
"""Profiled runs kept in one profiling session before its events are read (bounds the
profiler's memory; reading ends the session, and the next run opens another)."""


@dataclass
class _Pending:
    spans: SpanBuffer
    parent: int
    query_index: int
    window: tuple[int, int]


class OrtProfiler:
    """One profiling session per evaluation (not per query), read when it ends.

    ORT hands its events over only by ``end_profiling()``, which stops that session's
    profiling for good. So every profiled run goes through one long-lived profiling
    twin of the predictor's session; each query's predict window is remembered, and
    when the evaluation is released (or after :data:`FLUSH_EVERY` runs) the session is
    ended, its node events are read once and each is put under the predict span whose
    window holds it. Opening the session (tens of ms for efficientnet_lite0) and
    reading it happen outside every predict span; only the first run of a session is
    a cold one.
    """

    def __init__(
        self, predictor: Any, model_path: str, options: ort.SessionOptions, providers: list[Any]
    ) -> None:
        self.predictor, self.model_path = predictor, model_path
        self.options, self.providers = options, providers
        self.dir = scratch.scratch_path("ortprof")
        weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.options.enable_profiling = True
        self.options.profile_file_prefix = str(self.dir / "run")
        self.device = str(getattr(predictor, "device", "cpu"))
        self.lock = threading.RLock()
        self.sessions_opened = 0
        self._session: ort.InferenceSession | None = None
        self._wall_minus_mono = 0
        self._pending: list[_Pending] = []

    def capture(self, *, full: bool = False) -> Capture:
        return OrtCapture(self)

    def session(self) -> ort.InferenceSession | None:
        """The evaluation's profiling session (opened on first use)."""
        if len(self._pending) >= FLUSH_EVERY:
            self.flush()
        if self._session is None:
            try:
                self._session = ort.InferenceSession(
                    self.model_path, sess_options=self.options, providers=self.providers
                )
            except Exception as exc:  # ORT's own error types: profile nothing
                log.warning("onnxruntime profiling session failed, no layer spans: %s", exc)
                return None
            self.sessions_opened += 1
            self._wall_minus_mono = time.time_ns() - time.perf_counter_ns()
        return self._session

    def defer(self, pending: _Pending) -> None:
        with self.lock:
            self._pending.append(pending)

    def flush(self) -> int:
        """End the profiling session and emit every pending query's layer spans; returns
        how many spans were emitted."""
        with self.lock:
            session, pending = self._session, self._pending
            self._session, self._pending = None, []
        if session is None:
            return 0
        wall_minus_mono = self._wall_minus_mono  # taken when profiling started
        path = session.end_profiling()
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            log.warning("unreadable onnxruntime profile %s: %s", path, exc)
            return 0
        finally:
            Path(path).unlink(missing_ok=True)
        base = session.get_profiling_start_time_ns() - wall_minus_mono
        events = sorted(
            node_events(raw, base_ns=base, device=self.device), key=lambda e: e.start_ns
        )
        starts = np.asarray([e.start_ns for e in events], np.int64)
        emitted = 0
        for p in pending:  # a run's node events start inside its predict window
            lo, hi = np.searchsorted(starts, p.window[0]), np.searchsorted(starts, p.window[1])
            emitted += emit_events(
                p.spans, events[lo:hi], parent=p.parent, query_index=p.query_index, window=p.window
            )
        return emitted


class OrtCapture(Capture):
    """Swaps the evaluation's profiling session into the predictor for one call; its
    layer spans are emitted when the profiler is flushed."""

    def __init__(self, prof: OrtProfiler) -> None:
        super().__init__()
        self.prof = prof
        self._saved: Any = None
        self._session: ort.InferenceSession | None = None

    def __enter__(self) -> Capture:
        super().__enter__()  # from here, the profiler's own cost (opening the session)
        self.prof.lock.acquire()  # one profiled run at a time; a flush waits for it
        self._session = self.prof.session()
        if self._session is not None:
            self._saved = self.prof.predictor.session
            self.prof.predictor.session = self._session
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        super().__exit__(et, ev, tb)
        try:
            if self._session is not None:
                self.prof.predictor.session = self._saved
        finally:
            self.prof.lock.release()

    def emit(
        self,
        spans: SpanBuffer,
        *,
        parent: int,
        query_index: int,
        window: tuple[int, int] | None = None,
    ) -> int:
        if self._session is not None and window is not None:
            self.prof.defer(_Pending(spans, parent, query_index, window))
        return 0

    @property
    def deferred(self) -> bool:
        return self._session is not None


def node_events(raw: list[dict[str, Any]], *, base_ns: int, device: str) -> list[LayerEvent]:
    """The node events of the (single) ``model_run`` in one ORT profile, in order."""
    out = []
    for e in raw:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith(_SUFFIX):
            continue
        args = e.get("args", {})
        start = base_ns + int(e["ts"]) * 1000
        out.append(
            LayerEvent(
                name=str(e["name"])[: -len(_SUFFIX)],
                op_type=str(args.get("op_name", "")),
                start_ns=start,
                end_ns=start + int(e.get("dur", 0)) * 1000,
                shape={
                    "inputs": _shapes(args.get("input_type_shape")),
                    "outputs": _shapes(args.get("output_type_shape")),
                },
                device=device,
                extra={
                    "provider": args.get("provider", ""),
                    "node_index": args.get("node_index", ""),
                    **_memory(args),
                },
            )
        )
    return out


_MEMORY_ARGS = {
    "output_size": "output_bytes",
    "parameter_size": "parameter_bytes",
    "mem_in_use_delta": "mem_delta_bytes",
}
"""ORT's per-node memory figures (bytes, as text) -> span attributes: what the node's
outputs take (the paper's "allocated memory" of a layer), its weights, and how much
the arena's in-use memory changed during the node (newer ORT versions only)."""


def _memory(args: dict[str, Any]) -> dict[str, int]:
    out = {}
    for key, attr in _MEMORY_ARGS.items():
        try:
            out[attr] = int(args[key])
        except (KeyError, TypeError, ValueError):
            continue
    return out


def _shapes(typed: Any) -> list[Any]:
    """ORT writes [{"float": [1, 3, 224, 224]}, ...]; keep the shapes, with dtypes."""
    out: list[Any] = []
    for item in typed or []:
        if isinstance(item, dict):
            out.extend({"dtype": k, "shape": v} for k, v in item.items())
    return out


def make(predictor: Any) -> OrtProfiler | None:
    args = getattr(predictor, "profile_args", None)
    if args is None:
        log.warning("onnxruntime predictor exposes no profile_args: no layer spans")
        return None
    model_path, options, providers = args
    return OrtProfiler(predictor, str(model_path), options, list(providers))
