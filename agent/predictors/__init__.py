"""Predictors, one module per framework, imported by name only when used.

Each module ``agent.predictors.<framework>`` defines ``probe()`` and ``open(...)``
(see :mod:`mlscope.predictor`). Framework names are the same everywhere:
onnxruntime, pytorch, tensorflow, tflite, xrt, noop.

Device names reported by ``probe()``: ``cpu``, ``cuda:N`` for each CUDA GPU the
runtime itself can use, ``fpga:N`` for each XRT device.

This package also holds the one input check every predictor runs before it calls
its runtime (:func:`check_inputs`), so that a wrong count, dtype or shape is the
same :class:`~mlscope.errors.InputMismatchError` whichever framework is behind it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from mlscope import sysinfo
from mlscope.contracts import Accelerator, FrameworkInfo
from mlscope.devices import device_kind
from mlscope.errors import ConfigError, FrameworkUnavailable, InputMismatchError
from mlscope.manifest import FRAMEWORKS, ModelManifest
from mlscope.predictor import Predictor, PredictorOptions

__all__ = [
    "TensorSig",
    "accelerators",
    "batch_axes",
    "check_inputs",
    "device_index",
    "manifest_signature",
    "module",
    "open_predictor",
    "probe",
    "unusable_device",
]

log = logging.getLogger(__name__)


def module(framework: str) -> ModuleType:
    if framework not in FRAMEWORKS:
        raise ConfigError(f"unknown framework {framework!r} (one of {', '.join(FRAMEWORKS)})")
    return importlib.import_module(f"agent.predictors.{framework}")


def probe(framework: str) -> FrameworkInfo | None:
    """What of this framework really loads here (None when it does not).

    A probe that crashes (a broken install, a driver that fails to initialize) means
    the framework is not advertised; the reason is logged, the agent keeps starting.
    """
    try:
        info: FrameworkInfo | None = module(framework).probe()
    except ImportError:
        return None
    except Exception:  # a broken runtime must not stop the agent; say why, advertise nothing
        log.warning("probing %s failed; not advertising it", framework, exc_info=True)
        return None
    return info


_PROBED_AS = {"cpu": "cpu", "gpu": "cuda", "fpga": "fpga"}
"""How a probe names a device of each kind (``cuda:N``, ``fpga:N``, ``cpu``)."""


def unusable_device(device: str, info: FrameworkInfo) -> str | None:
    """Why ``info``'s framework cannot open models on ``device`` here (no such device
    among those its probe found: a GPU on a CPU-only machine or runtime, the CPU for
    XRT), or None when it can. Checked when an agent starts: one that started anyway
    would advertise itself and fail every job sent to it."""
    kind = device_kind(device)
    name = _PROBED_AS[kind] if kind == "cpu" else f"{_PROBED_AS[kind]}:{device_index(device)}"
    if name in info.devices:
        return None
    found = ", ".join(info.devices) or "none"
    return f"{info.name} cannot run on {device} on this machine (its devices here: {found})"


def accelerators(framework: str, devices: Sequence[str] = ()) -> tuple[Accelerator, ...]:
    """The devices this framework can run on here: those its runtime names (torch for
    GPUs, XRT for FPGAs), else the GPUs NVML reports for each ``cuda:N`` among
    ``devices`` (the framework's probe). A GPU the framework cannot use (a CPU-only
    ONNX Runtime or TensorFlow on a GPU host, TFLite) is not one of the agent's
    devices, so a job that asks for a GPU is never placed where it would run on the
    CPU."""
    try:
        found = getattr(module(framework), "accelerators", None)
        listed: list[Accelerator] = list(found()) if found is not None else []
    except Exception:  # a runtime that fails here still serves: report no device
        log.warning("listing %s devices failed", framework, exc_info=True)
        listed = []
    if not listed:
        usable = {d for d in devices if device_kind(d) == "gpu"}
        return tuple(g for g in sysinfo.nvml_gpus() if f"cuda:{g.index}" in usable)
    if any(a.kind == "gpu" and a.interconnect is None for a in listed):
        # The runtime names its GPUs; NVML knows how they are attached.
        links = {g.index: g.interconnect for g in sysinfo.nvml_gpus()}
        listed = [
            a.model_copy(update={"interconnect": links.get(a.index)})
            if a.kind == "gpu" and a.interconnect is None
            else a
            for a in listed
        ]
    return tuple(listed)


def open_predictor(
    framework: str, model_path: Path, manifest: ModelManifest, options: PredictorOptions
) -> Predictor:
    try:
        mod = module(framework)
    except ImportError as exc:
        raise FrameworkUnavailable(
            f"{framework} is not installed: pip install 'mlscope[{_extra(framework)}]'",
            framework=framework,
        ) from exc
    pred: Predictor = mod.open(model_path, manifest, options)
    return pred


def _extra(framework: str) -> str:
    return {"onnxruntime": "onnx", "pytorch": "torch", "tensorflow": "tf"}.get(framework, framework)


@dataclass(frozen=True)
class TensorSig:
    """What one model input accepts: its name, dtype and full shape (None = any size)."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int | None, ...]
    accepts: tuple[np.dtype[Any], ...] = ()
    """Further dtypes also accepted (a quantized model takes float32 or its own type)."""
    batch_axis: int | None = 0
    """The axis that is the batch (None: an input the whole batch shares)."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": str(self.dtype), "shape": list(self.shape)}


def manifest_signature(manifest: ModelManifest) -> list[TensorSig]:
    """Input signatures from the manifest: the sample shape with a dynamic batch axis
    at each input's ``batch_axis`` (none for an input the batch shares)."""
    out = []
    for i, spec in enumerate(manifest.inputs):
        shape: tuple[int | None, ...] = tuple(spec.shape)
        if spec.batch_axis is not None:
            shape = (*shape[: spec.batch_axis], None, *shape[spec.batch_axis :])
        out.append(
            TensorSig(
                name=spec.layer_name or f"input_{i}",
                dtype=np.dtype(spec.element_type),
                shape=shape,
                batch_axis=spec.batch_axis,
            )
        )
    return out


def batch_axes(manifest: ModelManifest, names: Sequence[str]) -> list[int | None]:
    """The batch axis of each of a runtime's inputs (``names``, in the runtime's order),
    from the manifest input of that layer name, else of that position; 0 otherwise."""
    by_name = {s.layer_name: s.batch_axis for s in manifest.inputs if s.layer_name}
    specs = manifest.inputs
    return [
        by_name[n] if n in by_name else specs[i].batch_axis if i < len(specs) else 0
        for i, n in enumerate(names)
    ]


def check_inputs(
    inputs: Sequence[np.ndarray], sigs: Sequence[TensorSig], *, model: str, framework: str
) -> None:
    """Raise InputMismatchError (model, framework, expected, actual) on the first mismatch.

    Checked in order: the number of inputs, each input's dtype, each input's rank and
    fixed dimensions. Inputs of one batch must agree on the batch size (each along its
    own ``batch_axis``).
    """
    if len(inputs) != len(sigs):
        raise InputMismatchError(
            f"{model} takes {len(sigs)} input(s), got {len(inputs)}",
            model=model,
            framework=framework,
            expected=[s.name for s in sigs],
            actual=len(inputs),
        )
    for sig, arr in zip(sigs, inputs, strict=True):
        dtype = getattr(arr, "dtype", None)
        if dtype != sig.dtype and dtype not in sig.accepts:
            raise InputMismatchError(
                f"{model}: input {sig.name} wants {sig.dtype}, got {dtype}",
                model=model,
                framework=framework,
                input=sig.name,
                expected=str(sig.dtype),
                actual=str(dtype),
            )
        shape = tuple(arr.shape)
        fixed = zip(sig.shape, shape, strict=False)  # ranks compared first
        if len(shape) != len(sig.shape) or any(w is not None and w != g for w, g in fixed):
            raise InputMismatchError(
                f"{model}: input {sig.name} wants shape {_fmt(sig.shape)}, got {list(shape)}",
                model=model,
                framework=framework,
                input=sig.name,
                expected=list(sig.shape),
                actual=list(shape),
            )
    batches = {
        int(a.shape[s.batch_axis])
        for s, a in zip(sigs, inputs, strict=True)
        if s.batch_axis is not None and a.ndim > s.batch_axis
    }
    if len(batches) > 1:
        raise InputMismatchError(
            f"{model}: inputs disagree on the batch size {sorted(batches)}",
            model=model,
            framework=framework,
            expected="one batch size",
            actual=sorted(batches),
        )


def device_index(device: str) -> int:
    """``cuda:1`` -> 1; ``cuda`` / ``fpga`` -> 0."""
    _, _, idx = device.partition(":")
    try:
        return int(idx) if idx else 0
    except ValueError as exc:
        raise ConfigError(f"bad device {device!r} (want kind or kind:N)") from exc


def _fmt(shape: Sequence[int | None]) -> str:
    return "[" + ", ".join("N" if d is None else str(d) for d in shape) + "]"
