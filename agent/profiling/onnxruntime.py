"""ONNX Runtime: per-node spans from the runtime's own profiler.

ORT profiles a whole session (``SessionOptions.enable_profiling``) and hands the
events over only through ``end_profiling()``, which writes a JSON file and stops
profiling for good; there is no per-run switch in its Python API. So a profiled run
uses its own short-lived profiling session of the same model (same file, options
and providers as the predictor's): create, run once, ``end_profiling``, read,
delete. Every node event in that file therefore belongs to exactly one query.
The cost is one session creation per profiled query (tens of ms for
efficientnet_lite0): framework level is for inspecting layers, not for latency.

Node events (``cat == "Node"``, name ``<node>_kernel_time``) carry the op type,
input/output shapes and provider. Their timestamps are microseconds from
``get_profiling_start_time_ns()`` on the wall clock; they are converted to the
agent's monotonic clock with an offset taken at the same instant.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

import onnxruntime as ort

from agent.profiling.base import Capture, LayerEvent

__all__ = ["OrtCapture", "OrtProfiler", "make", "node_events"]

log = logging.getLogger(__name__)
_SUFFIX = "_kernel_time"


class OrtProfiler:
    def __init__(self, predictor: Any, model_path: str, options: ort.SessionOptions,
                 providers: list[Any]) -> None:
        self.predictor, self.model_path = predictor, model_path
        self.options, self.providers = options, providers
        self.dir = Path(tempfile.mkdtemp(prefix="mlscope-ortprof-"))
        weakref.finalize(self, shutil.rmtree, self.dir, True)
        self.options.enable_profiling = True
        self.options.profile_file_prefix = str(self.dir / "run")
        self.device = str(getattr(predictor, "device", "cpu"))

    def capture(self, *, full: bool = False) -> Capture:
        return OrtCapture(self)

    def session(self) -> ort.InferenceSession:
        return ort.InferenceSession(self.model_path, sess_options=self.options,
                                    providers=self.providers)


class OrtCapture(Capture):
    """Swaps a fresh profiling session into the predictor for one call."""

    def __init__(self, prof: OrtProfiler) -> None:
        super().__init__()
        self.prof = prof
        self._saved: Any = None
        self._session: ort.InferenceSession | None = None

    def __enter__(self) -> Capture:
        try:
            self._session = self.prof.session()
        except Exception as exc:  # ORT's own error types: profile nothing, predict anyway
            log.warning("onnxruntime profiling session failed, no layer spans: %s", exc)
            return super().__enter__()
        self._saved = self.prof.predictor.session
        self.prof.predictor.session = self._session
        return super().__enter__()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        super().__exit__(et, ev, tb)
        session, self._session = self._session, None
        if session is None:
            return
        self.prof.predictor.session = self._saved
        wall_minus_mono = time.time_ns() - time.perf_counter_ns()
        path = session.end_profiling()
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            log.warning("unreadable onnxruntime profile %s: %s", path, exc)
            return
        finally:
            Path(path).unlink(missing_ok=True)
        base = session.get_profiling_start_time_ns() - wall_minus_mono
        self.events = node_events(raw, base_ns=base, device=self.prof.device)


def node_events(raw: list[dict[str, Any]], *, base_ns: int, device: str) -> list[LayerEvent]:
    """The node events of the (single) ``model_run`` in one ORT profile, in order."""
    out = []
    for e in raw:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith(_SUFFIX):
            continue
        args = e.get("args", {})
        start = base_ns + int(e["ts"]) * 1000
        out.append(LayerEvent(
            name=str(e["name"])[: -len(_SUFFIX)], op_type=str(args.get("op_name", "")),
            start_ns=start, end_ns=start + int(e.get("dur", 0)) * 1000,
            shape={"inputs": _shapes(args.get("input_type_shape")),
                   "outputs": _shapes(args.get("output_type_shape"))},
            device=device,
            extra={"provider": args.get("provider", ""),
                   "node_index": args.get("node_index", "")}))
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
