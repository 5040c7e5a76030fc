"""ONNX Runtime predictor: CPU provider, CUDA/TensorRT when the runtime really has them.

Framework-manifest options (``options.runtime``, from
:meth:`mlscope.framework_manifest.FrameworkManifest.runtime`), all optional:

``providers``
    Execution providers in priority order, each a name or ``[name, {options}]``;
    default from the device: ``cpu`` -> CPU, ``cuda[:N]`` -> CUDA then CPU. A GPU
    device whose list names no GPU provider is refused, not run on the CPU.
``tensorrt``
    ``true`` puts the TensorRT provider in front of CUDA for a ``cuda`` device.
``provider_options``
    ``{provider: {option: value}}`` merged into the chosen providers' options.
``intra_op_threads`` / ``inter_op_threads``
    Thread pools (``options.threads`` wins for intra-op; 0 is ORT's default);
    inter-op defaults to 1.
``execution_mode``
    ``sequential`` (default) or ``parallel``.
``graph_optimization``
    ``disable``, ``basic``, ``extended`` or ``all`` (default, ORT's own default).

A device that asks for a GPU provider gets it or a ModelLoadError: ORT's silent
fallback to the CPU would make a "GPU" benchmark measure the CPU.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from agent.predictors import TensorSig, batch_axes, check_inputs, device_index
from mlscope.contracts import FrameworkInfo
from mlscope.errors import ConfigError, InferenceError, InputMismatchError, ModelLoadError
from mlscope.manifest import ModelManifest
from mlscope.predictor import PredictorOptions

__all__ = ["OnnxRuntimePredictor", "open", "probe"]

FRAMEWORK = "onnxruntime"
log = logging.getLogger(__name__)

_GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
_OPT_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
# A one-node Identity graph (x: float[1] -> y), serialized; used by probe() to check
# that the CUDA provider really runs on a device rather than falling back to the CPU.
_IDENTITY_ONNX = bytes.fromhex(
    "08083a3b0a100a017812017922084964656e74697479120570726f62655a0f0a0178120a0a0808"
    "0112040a020801620f0a0179120a0a08080112040a02080142040a00100d"
)
_MAX_PROBED_GPUS = 16


def probe() -> FrameworkInfo:
    """ORT's version; ``cuda:N`` for each GPU on which the CUDA provider really runs."""
    devices = ["cpu"]
    if "CUDAExecutionProvider" in ort.get_available_providers():
        devices += [f"cuda:{i}" for i in range(_count_cuda_devices())]
    return FrameworkInfo(name=FRAMEWORK, version=ort.__version__, devices=tuple(devices))


def _count_cuda_devices() -> int:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    for idx in range(_MAX_PROBED_GPUS):
        try:
            sess = ort.InferenceSession(
                _IDENTITY_ONNX,
                sess_options=so,
                providers=[("CUDAExecutionProvider", {"device_id": idx}), "CPUExecutionProvider"],
            )
        except Exception:  # no such device or a broken CUDA install: stop counting
            return idx
        if sess.get_providers()[0] != "CUDAExecutionProvider":
            return idx
    return _MAX_PROBED_GPUS


class OnnxRuntimePredictor:
    framework = FRAMEWORK

    def __init__(self, session: ort.InferenceSession, manifest: ModelManifest, device: str):
        self.session: ort.InferenceSession | None = session
        self.profile_args: tuple[str, ort.SessionOptions, list[Any]] | None = None
        self.device = device
        self.model = manifest.name
        # Old model-zoo graphs (IR < 4) list weights as inputs too: feed only real inputs.
        overridable = {i.name for i in session.get_overridable_initializers()}
        self._inputs = [i for i in session.get_inputs() if i.name not in overridable]
        self._names = [i.name for i in self._inputs]
        axes = batch_axes(manifest, self._names)
        self._sigs = [
            TensorSig(
                name=i.name,
                dtype=_np_dtype(i.type),
                shape=tuple(d if isinstance(d, int) and d >= 0 else None for d in i.shape),
                batch_axis=axis,
            )
            for i, axis in zip(self._inputs, axes, strict=True)
        ]

    def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        session = self.session
        if session is None:
            raise InferenceError(
                f"{self.model}: predictor is closed", model=self.model, framework=FRAMEWORK
            )
        check_inputs(inputs, self._sigs, model=self.model, framework=FRAMEWORK)
        feed = dict(zip(self._names, inputs, strict=True))
        try:
            return list(session.run(None, feed))
        except ort.capi.onnxruntime_pybind11_state.InvalidArgument as exc:
            raise InputMismatchError(
                f"{self.model}: {exc}",
                model=self.model,
                framework=FRAMEWORK,
                expected=[s.describe() for s in self._sigs],
                actual=[list(a.shape) for a in inputs],
            ) from exc
        except Exception as exc:  # the runtime's own error types; translated here only
            raise InferenceError(
                f"{self.model}: {exc}",
                model=self.model,
                framework=FRAMEWORK,
                batch_size=len(inputs[0]),
            ) from exc

    def effective_options(self) -> dict[str, Any]:
        """What the session really runs with: its providers (ORT falls back silently
        when one cannot start), their options and its thread counts."""
        session = self.session
        if session is None:
            return {}
        so = session.get_session_options()
        return {
            "providers": list(session.get_providers()),
            "provider_options": session.get_provider_options(),
            "intra_op_threads": int(so.intra_op_num_threads),
            "inter_op_threads": int(so.inter_op_num_threads),
            "execution_mode": str(so.execution_mode).rsplit(".", 1)[-1],
            "graph_optimization": str(so.graph_optimization_level).rsplit(".", 1)[-1],
        }

    def close(self) -> None:
        self.session = None


def open(
    model_path: Path, manifest: ModelManifest, options: PredictorOptions
) -> OnnxRuntimePredictor:
    so = _session_options(options)
    if options.profile:
        so.enable_profiling = True
    kind = options.device.split(":")[0]
    providers = _providers(options, manifest)
    try:
        session = ort.InferenceSession(str(model_path), sess_options=so, providers=providers)
    except Exception as exc:  # runtime-specific load errors, translated once
        raise ModelLoadError(
            f"cannot load {model_path}: {exc}",
            model=manifest.name,
            framework=FRAMEWORK,
            device=options.device,
        ) from exc
    wanted = providers[0][0]
    if wanted in _GPU_PROVIDERS and session.get_providers()[0] != wanted:
        raise ModelLoadError(
            f"onnxruntime could not start {wanted} on {options.device} "
            f"(it fell back to {session.get_providers()})",
            model=manifest.name,
            framework=FRAMEWORK,
            device=options.device,
        )
    pred = OnnxRuntimePredictor(session, manifest, options.device if kind != "cpu" else "cpu")
    # What agent.profiling.onnxruntime needs to open a profiling twin of this session.
    pred.profile_args = (str(model_path), _session_options(options), providers)
    return pred


def _session_options(options: PredictorOptions) -> ort.SessionOptions:
    """Fresh SessionOptions equal to the predictor's (ORT options cannot be copied)."""
    rt = options.runtime
    so = ort.SessionOptions()
    intra = options.intra_op_threads
    if intra:
        so.intra_op_num_threads = intra
    so.inter_op_num_threads = int(rt.get("inter_op_threads", 1))
    so.execution_mode = (
        ort.ExecutionMode.ORT_PARALLEL
        if rt.get("execution_mode") == "parallel"
        else ort.ExecutionMode.ORT_SEQUENTIAL
    )
    level = str(rt.get("graph_optimization", "all"))
    if level not in _OPT_LEVELS:
        raise ConfigError(
            f"onnxruntime graph_optimization must be one of {sorted(_OPT_LEVELS)}, not {level!r}"
        )
    so.graph_optimization_level = _OPT_LEVELS[level]
    so.log_severity_level = 3
    return so


def _providers(
    options: PredictorOptions, manifest: ModelManifest
) -> list[tuple[str, dict[str, Any]]]:
    """(name, options) pairs in priority order, checked against what ORT has here."""
    rt = options.runtime
    kind = options.device.split(":")[0]
    if rt.get("providers"):
        chosen = [
            (p, {}) if isinstance(p, str) else (str(p[0]), dict(p[1])) for p in rt["providers"]
        ]
    elif kind == "cpu":
        chosen = [("CPUExecutionProvider", {})]
    elif kind in ("cuda", "tensorrt"):
        gpu = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        if kind == "tensorrt" or rt.get("tensorrt"):
            gpu.insert(0, "TensorrtExecutionProvider")
        chosen = [(p, {}) for p in gpu]
    else:
        raise ModelLoadError(
            f"onnxruntime has no device {options.device!r}",
            model=manifest.name,
            framework=FRAMEWORK,
            device=options.device,
        )
    if kind != "cpu" and not any(name in _GPU_PROVIDERS for name, _ in chosen):
        raise ModelLoadError(
            f"onnxruntime providers {[n for n, _ in chosen]} name no GPU provider for "
            f"{options.device}: the run would measure the CPU",
            model=manifest.name,
            framework=FRAMEWORK,
            device=options.device,
        )
    extra = rt.get("provider_options") or {}
    for name, opts in chosen:
        opts.update(extra.get(name, {}))
        if name in _GPU_PROVIDERS and kind != "cpu":
            opts.setdefault("device_id", device_index(options.device))
    available = ort.get_available_providers()
    missing = [name for name, _ in chosen if name not in available]
    if missing:
        raise ModelLoadError(
            f"onnxruntime {ort.__version__} here lacks provider(s) {missing} (has {available})",
            model=manifest.name,
            framework=FRAMEWORK,
            device=options.device,
        )
    return chosen


_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int16)": np.int16,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(bool)": np.bool_,
}


def _np_dtype(onnx_type: str) -> np.dtype[Any]:
    return np.dtype(_DTYPES.get(onnx_type, np.float32))
