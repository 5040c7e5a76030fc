"""PyTorch predictor: TorchScript (``.pt``, ``.ts``) and exported programs (``.pt2``).

The loader is chosen by the file's suffix, or by ``options.runtime["format"]``
(``torchscript`` or ``exported``). Devices: ``cpu`` and ``cuda`` / ``cuda:N``.
Inputs are checked against the manifest (TorchScript carries no input signature),
moved to the device, run under ``torch.inference_mode()``, and the device is
synchronized before ``predict`` returns, so a clock stopped after it is honest.

``options.threads`` (else the framework manifest's ``intra_op_threads``; 0 means
torch's default) sets ``torch.set_num_threads`` -- a process-wide setting in
PyTorch, so the last predictor opened in a process decides it. The manifest's
``inter_op_threads`` sets ``torch.set_num_interop_threads``, which torch accepts only
before its first parallel work: a later, different request is logged, not claimed.
``options.runtime["format"]`` comes from a framework manifest's ``options.extra``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agent.predictors import check_inputs, manifest_signature
from mlscope.contracts import Accelerator, FrameworkInfo
from mlscope.errors import InferenceError, ModelLoadError
from mlscope.manifest import ModelManifest
from mlscope.predictor import PredictorOptions

__all__ = ["TorchPredictor", "accelerators", "open", "probe"]

FRAMEWORK = "pytorch"
log = logging.getLogger(__name__)
_EXPORTED_SUFFIXES = (".pt2",)


def accelerators() -> list[Accelerator]:
    """Each CUDA device torch sees, with its name and memory."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append(
            Accelerator(kind="gpu", model=props.name, index=i, memory_bytes=int(props.total_memory))
        )
    return out


def probe() -> FrameworkInfo:
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return FrameworkInfo(
        name=FRAMEWORK, version=torch.__version__.split("+")[0], devices=tuple(devices)
    )


class TorchPredictor:
    framework = FRAMEWORK

    def __init__(self, module: Any, manifest: ModelManifest, device: torch.device) -> None:
        self._module: Any = module
        self.model = manifest.name
        self.device = str(device)
        self._device = device
        self._cuda = device.type == "cuda"
        self._sigs = manifest_signature(manifest)
        self._output_names = [o.layer_name for o in manifest.outputs]

    def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        module = self._module
        if module is None:
            raise InferenceError(
                f"{self.model}: predictor is closed", model=self.model, framework=FRAMEWORK
            )
        check_inputs(inputs, self._sigs, model=self.model, framework=FRAMEWORK)
        try:
            with torch.inference_mode():
                args = [self._to_device(a) for a in inputs]
                out = module(*args)
                tensors = self._flatten(out)
                if self._cuda:
                    torch.cuda.synchronize(self._device)
                return [t.detach().cpu().numpy() for t in tensors]
        except Exception as exc:  # torch raises RuntimeError and friends; translated here
            raise InferenceError(
                f"{self.model}: {exc}",
                model=self.model,
                framework=FRAMEWORK,
                device=self.device,
                batch_size=len(inputs[0]),
            ) from exc

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        # torch.from_numpy warns on read-only memory (e.g. decoded from a bus message);
        # the model never writes its inputs, but a copy is the only warning-free way.
        if not arr.flags.writeable:
            arr = arr.copy()
        t = torch.from_numpy(arr)
        return t.to(self._device, non_blocking=True) if self._cuda else t

    def _flatten(self, out: Any) -> list[torch.Tensor]:
        """Tensor, tuple/list of tensors, or dict (ordered by manifest output names)."""
        if isinstance(out, torch.Tensor):
            return [out]
        if isinstance(out, dict):
            names = self._output_names
            if all(n is not None for n in names) and len(names) == len(out):
                return [out[n] for n in names]
            return [out[k] for k in sorted(out)]
        if isinstance(out, (list, tuple)):
            return [t for item in out for t in self._flatten(item)]
        raise TypeError(f"model returned {type(out).__name__}, not tensors")

    def effective_options(self) -> dict[str, Any]:
        """What torch runs with now (its thread pools are process-wide)."""
        return {
            "device": self.device,
            "intra_op_threads": int(torch.get_num_threads()),
            "inter_op_threads": int(torch.get_num_interop_threads()),
        }

    def close(self) -> None:
        if self._module is None:
            return
        self._module = None
        if self._cuda:
            torch.cuda.empty_cache()


def open(model_path: Path, manifest: ModelManifest, options: PredictorOptions) -> TorchPredictor:
    device = _device(options, manifest)
    _set_threads(options)
    fmt = options.runtime.get("format") or (
        "exported" if Path(model_path).suffix in _EXPORTED_SUFFIXES else "torchscript"
    )
    try:
        if fmt == "exported":
            module = torch.export.load(str(model_path)).module().to(device)
        elif fmt == "torchscript":
            module = torch.jit.load(  # type: ignore[no-untyped-call]
                str(model_path), map_location=device
            ).eval()
        else:
            raise ValueError(f"unknown format {fmt!r} (torchscript or exported)")
    except Exception as exc:  # torch's load errors are RuntimeError, ValueError, zip errors...
        hint = ""
        if fmt == "torchscript" and "constants.pkl" in str(exc):
            hint = " (a torch.save'd module or state dict is not TorchScript)"
        raise ModelLoadError(
            f"cannot load {model_path} as {fmt}: {exc}{hint}",
            model=manifest.name,
            framework=FRAMEWORK,
            device=options.device,
        ) from exc
    return TorchPredictor(module, manifest, device)


def _set_threads(options: PredictorOptions) -> None:
    if options.intra_op_threads:
        torch.set_num_threads(options.intra_op_threads)
    inter = int(options.runtime.get("inter_op_threads") or 0)
    if inter and torch.get_num_interop_threads() != inter:
        try:
            torch.set_num_interop_threads(inter)
        except RuntimeError:  # parallel work already started: fixed for this process
            log.warning(
                "torch already runs %d inter-op threads; cannot use %d",
                torch.get_num_interop_threads(),
                inter,
            )


def _device(options: PredictorOptions, manifest: ModelManifest) -> torch.device:
    kind = options.device.split(":")[0]
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ModelLoadError(
            f"pytorch has no device {options.device!r}",
            model=manifest.name,
            framework=FRAMEWORK,
            device=options.device,
        )
    if not torch.cuda.is_available():
        raise ModelLoadError(
            f"no CUDA device for {options.device!r} (torch {torch.__version__})",
            model=manifest.name,
            framework=FRAMEWORK,
            device=options.device,
        )
    dev = torch.device(options.device if ":" in options.device else "cuda:0")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ModelLoadError(
            f"{options.device} not present ({torch.cuda.device_count()} GPUs)",
            model=manifest.name,
            framework=FRAMEWORK,
            device=options.device,
        )
    return dev
