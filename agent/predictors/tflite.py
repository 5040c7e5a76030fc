"""TFLite predictor on ``ai-edge-litert``: XNNPACK with the configured thread count.

- ``options.threads`` (else the framework manifest's ``intra_op_threads``) becomes
  the interpreter's ``num_threads`` (XNNPACK's pool); the predictor keeps it as
  ``num_threads``.
- XNNPACK is LiteRT's default delegate; ``options.runtime["xnnpack"] = false`` runs
  the plain builtin kernels instead.
- A batch of a new size resizes the input tensors (``resize_tensor_input`` +
  ``allocate_tensors``); the same size again costs nothing.
- Quantized models: an input whose tensor is int8/uint8 with a scale takes float32
  (quantized here, ``q = clip(round(x / scale) + zero_point)``) or its raw integer
  type (passed through). Quantized outputs are dequantized to float32,
  ``x = (q - zero_point) * scale``, unless ``options.runtime["dequantize"] = false``.

An interpreter is not thread-safe; ``predict`` holds a lock for its whole call.
"""

from __future__ import annotations

import threading
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any

import numpy as np
from ai_edge_litert.interpreter import Interpreter, OpResolverType

from agent.predictors import TensorSig, batch_axes, check_inputs
from mlscope.contracts import FrameworkInfo
from mlscope.errors import InferenceError, ModelLoadError
from mlscope.manifest import ModelManifest
from mlscope.predictor import PredictorOptions

__all__ = ["TFLitePredictor", "open", "probe"]

FRAMEWORK = "tflite"


def probe() -> FrameworkInfo:
    try:
        ver = dist_version("ai-edge-litert")
    except PackageNotFoundError:  # a vendored or source build: ask the module itself
        import ai_edge_litert

        ver = str(getattr(ai_edge_litert, "__version__", "unknown"))
    return FrameworkInfo(name=FRAMEWORK, version=ver, devices=("cpu",))


class _Quant:
    """Per-tensor affine quantization of one tensor (scale 0 means not quantized)."""

    def __init__(self, detail: dict[str, Any]) -> None:
        scale, zero = detail.get("quantization", (0.0, 0))
        self.dtype = np.dtype(detail["dtype"])
        self.scale = float(scale)
        self.zero = int(zero)
        self.on = self.scale != 0.0 and self.dtype.kind in "iu"

    def quantize(self, x: np.ndarray) -> np.ndarray:
        info = np.iinfo(self.dtype)
        q = np.rint(x / np.float32(self.scale)) + self.zero
        out: np.ndarray = np.clip(q, info.min, info.max).astype(self.dtype)
        return out

    def dequantize(self, q: np.ndarray) -> np.ndarray:
        out: np.ndarray = (q.astype(np.float32) - np.float32(self.zero)) * np.float32(self.scale)
        return out


class TFLitePredictor:
    framework = FRAMEWORK
    device = "cpu"
    num_threads: int | None = None
    """The interpreter's thread count (None: LiteRT's default)."""

    def __init__(self, interp: Interpreter, manifest: ModelManifest, *, dequantize: bool) -> None:
        self._interp: Interpreter | None = interp
        self.model = manifest.name
        self._lock = threading.Lock()
        ins = interp.get_input_details()
        self._in_index = [d["index"] for d in ins]
        self._in_quant = [_Quant(d) for d in ins]
        axes = batch_axes(manifest, [d["name"] for d in ins])
        self._sigs = [
            _signature(d, q, axis) for d, q, axis in zip(ins, self._in_quant, axes, strict=True)
        ]
        self._shapes = [tuple(int(s) for s in d["shape"]) for d in ins]
        outs = interp.get_output_details()
        self._out_index = [d["index"] for d in outs]
        self._out_quant = [_Quant(d) if dequantize else None for d in outs]

    def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        with self._lock:
            interp = self._interp
            if interp is None:
                raise InferenceError(
                    f"{self.model}: predictor is closed", model=self.model, framework=FRAMEWORK
                )
            check_inputs(inputs, self._sigs, model=self.model, framework=FRAMEWORK)
            try:
                self._resize(interp, inputs)
                for idx, quant, arr in zip(self._in_index, self._in_quant, inputs, strict=True):
                    if quant.on and arr.dtype != quant.dtype:
                        arr = quant.quantize(arr)
                    interp.set_tensor(idx, arr)
                interp.invoke()
                outs = [interp.get_tensor(i) for i in self._out_index]
            except Exception as exc:  # ValueError/RuntimeError from the interpreter
                raise InferenceError(
                    f"{self.model}: {exc}",
                    model=self.model,
                    framework=FRAMEWORK,
                    batch_size=len(inputs[0]),
                ) from exc
        return [
            q.dequantize(o) if q is not None and q.on else o
            for q, o in zip(self._out_quant, outs, strict=True)
        ]

    def _resize(self, interp: Interpreter, inputs: list[np.ndarray]) -> None:
        changed = False
        for n, (idx, arr) in enumerate(zip(self._in_index, inputs, strict=True)):
            if arr.shape != self._shapes[n]:
                interp.resize_tensor_input(idx, list(arr.shape), strict=False)
                self._shapes[n] = tuple(arr.shape)
                changed = True
        if changed:
            interp.allocate_tensors()

    def effective_options(self) -> dict[str, Any]:
        """The interpreter's thread count (None: LiteRT's default)."""
        return {"num_threads": self.num_threads}

    def close(self) -> None:
        with self._lock:
            self._interp = None


def _signature(detail: dict[str, Any], quant: _Quant, batch_axis: int | None) -> TensorSig:
    sig = detail.get("shape_signature")
    dims = [int(d) for d in (sig if sig is not None and len(sig) else detail["shape"])]
    shape = tuple(None if i == batch_axis or d < 0 else d for i, d in enumerate(dims))
    if quant.on:
        return TensorSig(
            name=detail["name"],
            dtype=np.dtype(np.float32),
            shape=shape,
            accepts=(quant.dtype,),
            batch_axis=batch_axis,
        )
    return TensorSig(name=detail["name"], dtype=quant.dtype, shape=shape, batch_axis=batch_axis)


def open(model_path: Path, manifest: ModelManifest, options: PredictorOptions) -> TFLitePredictor:
    if options.device.split(":")[0] != "cpu":
        raise ModelLoadError(
            f"tflite runs on the cpu here, not {options.device!r}",
            model=manifest.name,
            framework=FRAMEWORK,
            device=options.device,
        )
    resolver = (
        OpResolverType.BUILTIN
        if options.runtime.get("xnnpack", True)
        else OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    )
    try:
        interp = Interpreter(
            model_path=str(model_path),
            num_threads=options.intra_op_threads,
            experimental_op_resolver_type=resolver,
        )
        interp.allocate_tensors()
    except Exception as exc:  # ValueError for a bad flatbuffer, RuntimeError for bad ops
        raise ModelLoadError(
            f"cannot load {model_path}: {exc}",
            model=manifest.name,
            framework=FRAMEWORK,
            device=options.device,
        ) from exc
    pred = TFLitePredictor(
        interp, manifest, dequantize=bool(options.runtime.get("dequantize", True))
    )
    pred.num_threads = options.intra_op_threads
    return pred
