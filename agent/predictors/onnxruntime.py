"""ONNX Runtime predictor: CPU provider, CUDA/TensorRT when the runtime has them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from mlscope.contracts import FrameworkInfo
from mlscope.errors import InferenceError, InputMismatchError, ModelLoadError
from mlscope.manifest import ModelManifest
from mlscope.predictor import PredictorOptions

__all__ = ["OnnxRuntimePredictor", "open", "probe"]

FRAMEWORK = "onnxruntime"
_DEVICE_PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}


def probe() -> FrameworkInfo:
    available = ort.get_available_providers()
    devices = ["cpu"]
    if "CUDAExecutionProvider" in available:
        devices.append("cuda")
    return FrameworkInfo(name=FRAMEWORK, version=ort.__version__, devices=tuple(devices))


class OnnxRuntimePredictor:
    framework = FRAMEWORK

    def __init__(self, session: ort.InferenceSession, manifest: ModelManifest, device: str,
                 initializers: set[str]):
        self.session = session
        self.device = device
        self.model = manifest.name
        # Feed only real inputs: old model-zoo graphs list initializers as inputs too.
        self._inputs = [i for i in session.get_inputs() if i.name not in initializers]
        self._input_names = [i.name for i in self._inputs]
        self._dtypes = [_np_dtype(i.type) for i in self._inputs]

    def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        if len(inputs) != len(self._inputs):
            raise InputMismatchError(
                f"{self.model} takes {len(self._inputs)} input(s), got {len(inputs)}",
                model=self.model, framework=FRAMEWORK,
                expected=self._input_names, actual=len(inputs))
        feed: dict[str, Any] = {}
        for meta, dtype, arr in zip(self._inputs, self._dtypes, inputs, strict=True):
            if arr.dtype != dtype:
                raise InputMismatchError(
                    f"{self.model}: input {meta.name} wants {dtype}, got {arr.dtype}",
                    model=self.model, framework=FRAMEWORK, input=meta.name,
                    expected=str(dtype), actual=str(arr.dtype))
            feed[meta.name] = arr
        try:
            return list(self.session.run(None, feed))
        except (ort.capi.onnxruntime_pybind11_state.InvalidArgument) as exc:
            raise InputMismatchError(
                f"{self.model}: {exc}", model=self.model, framework=FRAMEWORK,
                expected=[str(i.shape) for i in self._inputs],
                actual=[list(a.shape) for a in inputs]) from exc
        except Exception as exc:  # the runtime's own error types; translated here only
            raise InferenceError(f"{self.model}: {exc}", model=self.model,
                                 framework=FRAMEWORK, batch_size=len(inputs[0])) from exc

    def close(self) -> None:
        self.session = None  # type: ignore[assignment]


def open(model_path: Path, manifest: ModelManifest,
         options: PredictorOptions) -> OnnxRuntimePredictor:
    so = ort.SessionOptions()
    if options.threads:
        so.intra_op_num_threads = options.threads
    so.inter_op_num_threads = int(options.runtime.get("inter_op_threads", 1))
    so.log_severity_level = 3
    if options.profile:
        so.enable_profiling = True
    kind = options.device.split(":")[0]
    providers = options.runtime.get("providers") or _DEVICE_PROVIDERS.get(kind)
    if providers is None:
        raise ModelLoadError(f"onnxruntime has no device {options.device!r}",
                             model=manifest.name, framework=FRAMEWORK, device=options.device)
    missing = [p for p in providers if p not in ort.get_available_providers()]
    if missing:
        raise ModelLoadError(f"onnxruntime here lacks provider(s) {missing}",
                             model=manifest.name, framework=FRAMEWORK, device=options.device)
    try:
        session = ort.InferenceSession(str(model_path), sess_options=so, providers=providers)
    except Exception as exc:  # runtime-specific load errors, translated once
        raise ModelLoadError(f"cannot load {model_path}: {exc}", model=manifest.name,
                             framework=FRAMEWORK) from exc
    return OnnxRuntimePredictor(session, manifest, kind, _initializer_names(model_path))


def _initializer_names(model_path: Path) -> set[str]:
    try:
        import onnx
    except ImportError:  # without the onnx package, assume no initializer inputs
        return set()
    model = onnx.load(str(model_path), load_external_data=False)
    return {i.name for i in model.graph.initializer}


_DTYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_,
}


def _np_dtype(onnx_type: str) -> np.dtype[Any]:
    return np.dtype(_DTYPES.get(onnx_type, np.float32))
