"""XRT predictor (Xilinx/AMD FPGAs) through ``pyxrt``, the XRT native API for Python.

``model_path`` is the xclbin. The data path of one ``predict``::

    bo.write(x) -> bo.sync(TO_DEVICE) -> run = kernel(args...) -> run.wait()
      -> bo.sync(FROM_DEVICE) -> bo.read()

How the kernel is called comes from ``manifest.attributes["xrt"]``, overridden
key by key by ``options.runtime``:

``kernel``
    Kernel name in the xclbin (default: the xclbin's only kernel).
``args``
    The kernel's argument layout, in order: ``"input:N"`` / ``"output:N"`` (the
    buffer object of that tensor), ``"batch"`` (the batch size as a scalar), or an
    integer constant. Default: every input, every output, then ``batch``.
``outputs``
    ``[{"shape": [...], "element_type": "float32"}, ...]`` per output, one sample
    (output specs in a manifest carry no shape; an FPGA needs it to size buffers).
``cu_access``
    ``shared`` (default) or ``exclusive`` compute-unit access.

Input sizes come from ``manifest.inputs`` (shape and element type). Buffers are
allocated once for ``options.batch_size`` samples, in the memory bank of their
kernel argument (``kernel.group_id``), and grown when a larger batch arrives.

``pyxrt`` is imported only when used: without it ``probe()`` returns None (the
agent does not advertise xrt) and ``open`` raises FrameworkUnavailable.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from agent.predictors import check_inputs, device_index, manifest_signature
from mlscope.contracts import Accelerator, FrameworkInfo
from mlscope.errors import FrameworkUnavailable, InferenceError, ModelLoadError
from mlscope.manifest import ModelManifest
from mlscope.predictor import PredictorOptions

__all__ = ["XrtPredictor", "accelerators", "open", "probe"]

FRAMEWORK = "xrt"
INSTALL_HINT = (
    "pyxrt is not importable: install Xilinx/AMD XRT (https://xilinx.github.io/XRT/) and "
    "run `source /opt/xilinx/xrt/setup.sh` before starting the agent, so that "
    "/opt/xilinx/xrt/python is on PYTHONPATH"
)


def _pyxrt() -> ModuleType | None:
    try:
        return importlib.import_module("pyxrt")
    except ImportError:
        return None


def probe() -> FrameworkInfo | None:
    """XRT's version and ``fpga:N`` per device; None without pyxrt or without a device."""
    pyxrt = _pyxrt()
    if pyxrt is None:
        return None
    count = int(pyxrt.enumerate_devices())
    if count == 0:
        return None
    return FrameworkInfo(
        name=FRAMEWORK, version=_version(pyxrt), devices=tuple(f"fpga:{i}" for i in range(count))
    )


def accelerators() -> list[Accelerator]:
    """Each FPGA XRT enumerates, by the name the device reports."""
    pyxrt = _pyxrt()
    if pyxrt is None:
        return []
    out = []
    for i in range(int(pyxrt.enumerate_devices())):
        try:
            name = str(pyxrt.device(i).get_info(pyxrt.xrt_info_device.name))
        except Exception:  # a device that cannot be opened is still one we saw
            name = "unknown"
        out.append(Accelerator(kind="fpga", model=name, index=i))
    return out


def _version(pyxrt: ModuleType) -> str:
    """From the device's host report (``{"xrt": {"version": ...}}``), else the install."""
    try:
        host = json.loads(pyxrt.device(0).get_info(pyxrt.xrt_info_device.host))
        return str(host["xrt"]["version"])
    except Exception:  # older XRT without the host report: fall back to version.json
        pass
    root = Path(os.environ.get("XILINX_XRT", "/opt/xilinx/xrt"))
    try:
        return str(json.loads((root / "version.json").read_text())["BUILD_VERSION"])
    except (OSError, ValueError, KeyError):
        return str(getattr(pyxrt, "__version__", "unknown"))


@dataclass(frozen=True)
class _Tensor:
    dtype: np.dtype[Any]
    shape: tuple[int, ...]

    @property
    def sample_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class XrtPredictor:
    framework = FRAMEWORK

    def __init__(
        self,
        pyxrt: ModuleType,
        dev: Any,
        kernel: Any,
        manifest: ModelManifest,
        *,
        device: str,
        args: list[str | int],
        outputs: list[_Tensor],
        capacity: int,
    ) -> None:
        self._pyxrt = pyxrt
        self._dev: Any = dev
        self._kernel: Any = kernel
        self.model = manifest.name
        self.device = device
        self._args = args
        self._sigs = manifest_signature(manifest)
        self._inputs = [_Tensor(np.dtype(s.element_type), tuple(s.shape)) for s in manifest.inputs]
        self._outputs = outputs
        self._to_dev = pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE
        self._from_dev = pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE
        self._done = pyxrt.ert_cmd_state.ERT_CMD_STATE_COMPLETED
        self._lock = threading.Lock()
        self._capacity = 0
        self._in_bos: list[Any] = []
        self._out_bos: list[Any] = []
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        """Buffer objects for ``capacity`` samples, each in its argument's memory bank."""

        def make(kind: str, i: int, t: _Tensor) -> Any:
            pos = self._args.index(f"{kind}:{i}")
            return self._pyxrt.bo(
                self._dev,
                capacity * t.sample_bytes,
                self._pyxrt.bo.normal,
                self._kernel.group_id(pos),
            )

        self._in_bos = [make("input", i, t) for i, t in enumerate(self._inputs)]
        self._out_bos = [make("output", i, t) for i, t in enumerate(self._outputs)]
        self._capacity = capacity

    def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        with self._lock:
            if self._kernel is None:
                raise InferenceError(
                    f"{self.model}: predictor is closed", model=self.model, framework=FRAMEWORK
                )
            check_inputs(inputs, self._sigs, model=self.model, framework=FRAMEWORK)
            batch = len(inputs[0])
            try:
                return self._run(inputs, batch)
            except InferenceError:
                raise
            except Exception as exc:  # pyxrt raises RuntimeError; translated here only
                raise InferenceError(
                    f"{self.model}: {exc}",
                    model=self.model,
                    framework=FRAMEWORK,
                    device=self.device,
                    batch_size=batch,
                ) from exc

    def _run(self, inputs: list[np.ndarray], batch: int) -> list[np.ndarray]:
        if batch > self._capacity:
            self._allocate(batch)
        for bo, arr in zip(self._in_bos, inputs, strict=True):
            data = np.ascontiguousarray(arr)
            bo.write(data, 0)
            bo.sync(self._to_dev, data.nbytes, 0)
        run = self._kernel(*self._call_args(batch))
        state = run.wait()
        if state != self._done:
            raise InferenceError(
                f"{self.model}: kernel run ended in {state!r}",
                model=self.model,
                framework=FRAMEWORK,
                device=self.device,
                batch_size=batch,
                state=str(state),
            )
        outs = []
        for bo, t in zip(self._out_bos, self._outputs, strict=True):
            nbytes = batch * t.sample_bytes
            bo.sync(self._from_dev, nbytes, 0)
            raw = np.asarray(bo.read(nbytes, 0))
            outs.append(raw.view(t.dtype).reshape(batch, *t.shape))
        return outs

    def _call_args(self, batch: int) -> list[Any]:
        out: list[Any] = []
        for a in self._args:
            if isinstance(a, int):
                out.append(a)
            elif a == "batch":
                out.append(batch)
            else:
                kind, _, idx = a.partition(":")
                out.append((self._in_bos if kind == "input" else self._out_bos)[int(idx)])
        return out

    def close(self) -> None:
        with self._lock:
            self._in_bos, self._out_bos = [], []
            self._kernel = None
            self._dev = None


def open(model_path: Path, manifest: ModelManifest, options: PredictorOptions) -> XrtPredictor:
    pyxrt = _pyxrt()
    if pyxrt is None:
        raise FrameworkUnavailable(INSTALL_HINT, framework=FRAMEWORK, model=manifest.name)
    cfg = {**dict(manifest.attributes.get("xrt") or {}), **options.runtime}
    kind = options.device.split(":")[0]
    if kind != "fpga":
        raise ModelLoadError(
            f"xrt runs on fpga:N devices, not {options.device!r}",
            model=manifest.name,
            framework=FRAMEWORK,
            device=options.device,
        )
    outputs = _output_tensors(cfg, manifest)
    args = _arg_layout(cfg, manifest, len(outputs))
    try:
        dev = pyxrt.device(device_index(options.device))
        xbin = pyxrt.xclbin(str(model_path))
        uuid = dev.load_xclbin(xbin)
        name = cfg.get("kernel") or _only_kernel(xbin)
        mode = getattr(pyxrt.kernel.cu_access_mode, str(cfg.get("cu_access", "shared")))
        kernel = pyxrt.kernel(dev, uuid, name, mode)
        return XrtPredictor(
            pyxrt,
            dev,
            kernel,
            manifest,
            device=options.device,
            args=args,
            outputs=outputs,
            capacity=max(1, options.batch_size),
        )
    except Exception as exc:  # pyxrt raises RuntimeError for a bad xclbin, device or kernel
        raise ModelLoadError(
            f"cannot load {model_path} on {options.device}: {exc}",
            model=manifest.name,
            framework=FRAMEWORK,
            device=options.device,
        ) from exc


def _only_kernel(xbin: Any) -> str:
    names = [k.get_name() for k in xbin.get_kernels()]
    if len(names) != 1:
        raise ValueError(f"xclbin has kernels {names}: name one in attributes.xrt.kernel")
    return str(names[0])


def _output_tensors(cfg: dict[str, Any], manifest: ModelManifest) -> list[_Tensor]:
    specs = cfg.get("outputs")
    if not specs or len(specs) != len(manifest.outputs):
        raise ModelLoadError(
            f"{manifest.name}: xrt needs attributes.xrt.outputs with one "
            f"{{shape, element_type}} per output ({len(manifest.outputs)})",
            model=manifest.name,
            framework=FRAMEWORK,
            expected=len(manifest.outputs),
            actual=len(specs or []),
        )
    return [
        _Tensor(np.dtype(s.get("element_type", "float32")), tuple(int(d) for d in s["shape"]))
        for s in specs
    ]


def _arg_layout(cfg: dict[str, Any], manifest: ModelManifest, n_out: int) -> list[str | int]:
    n_in = len(manifest.inputs)
    default: list[str | int] = [
        *(f"input:{i}" for i in range(n_in)),
        *(f"output:{i}" for i in range(n_out)),
        "batch",
    ]
    args: list[str | int] = list(cfg.get("args") or default)
    needed = {f"input:{i}" for i in range(n_in)} | {f"output:{i}" for i in range(n_out)}
    bad = [a for a in args if not isinstance(a, int) and a != "batch" and a not in needed]
    missing = needed - {a for a in args if isinstance(a, str)}
    if bad or missing:
        raise ModelLoadError(
            f"{manifest.name}: bad xrt argument layout {args} (unknown {bad}, "
            f"missing {sorted(missing)})",
            model=manifest.name,
            framework=FRAMEWORK,
            expected=default,
            actual=args,
        )
    return args
