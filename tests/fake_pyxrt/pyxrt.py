"""A stand-in for XRT's ``pyxrt`` module (the pybind11 wrapper of the XRT native API).

It mirrors the parts of the real API the XRT predictor uses, with the same names,
argument order and semantics (see XRT's ``pyxrt`` stub: ``device``, ``xclbin``,
``kernel``, ``bo``, ``run``, ``xclBOSyncDirection``, ``ert_cmd_state``,
``enumerate_devices``), and computes real results in numpy:

- a buffer object keeps *two* copies, host and device; ``write``/``read``/``map``
  touch the host copy, ``sync(TO_DEVICE)``/``sync(FROM_DEVICE)`` copy between them,
  and kernels see only device memory -- so a predictor that forgets a sync gets
  stale data, as on a real card;
- an "xclbin" is an ``.npz`` file: ``kernel`` (its name), ``uuid``, and the dense
  layers ``w0, b0, w1, b1, ...``; its kernel ``(in_bo, out_bo, batch)`` computes
  ``relu(...relu(x @ w0 + b0)...) @ wN + bN`` on float32 rows;
- ``FAKE_PYXRT_DEVICES`` (env, default 1) sets how many devices exist;
  ``kernel.fail_next_run = True`` makes the next run end in an error state.

Only for tests: the real module ships with an XRT install (/opt/xilinx/xrt).
"""

from __future__ import annotations

import enum
import json
import os
import zipfile
from typing import Any

import numpy as np

__version__ = "2.17.0+stand-in"
XCL_BO_FLAGS_NONE = 0


class xclBOSyncDirection(enum.IntEnum):
    XCL_BO_SYNC_BO_TO_DEVICE = 0
    XCL_BO_SYNC_BO_FROM_DEVICE = 1
    XCL_BO_SYNC_BO_GMIO_TO_AIE = 2
    XCL_BO_SYNC_BO_AIE_TO_GMIO = 3


class ert_cmd_state(enum.IntEnum):
    ERT_CMD_STATE_NEW = 1
    ERT_CMD_STATE_QUEUED = 2
    ERT_CMD_STATE_COMPLETED = 4
    ERT_CMD_STATE_ERROR = 5
    ERT_CMD_STATE_ABORT = 6
    ERT_CMD_STATE_SUBMITTED = 7
    ERT_CMD_STATE_TIMEOUT = 8


class xrt_info_device:  # a pybind11 enum in XRT; here plain ints ("name" clashes with Enum)
    bdf = 0
    name = 5
    host = 14


def enumerate_devices() -> int:
    return int(os.environ.get("FAKE_PYXRT_DEVICES", "1"))


class uuid:
    def __init__(self, text: str) -> None:
        self._text = text

    def to_string(self) -> str:
        return self._text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, uuid) and other._text == self._text

    def __hash__(self) -> int:
        return hash(self._text)


class xclbin:
    class xclbinkernel:
        def __init__(self, name: str, nargs: int) -> None:
            self._name, self._nargs = name, nargs

        def get_name(self) -> str:
            return self._name

        def get_num_args(self) -> int:
            return self._nargs

    def __init__(self, path: str) -> None:
        try:
            with np.load(path, allow_pickle=False) as z:
                self._data = {k: z[k] for k in z.files}
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            # The real binding raises RuntimeError for a file that is not an xclbin.
            raise RuntimeError(f"Invalid xclbin '{path}': {exc}") from exc
        self._uuid = uuid(str(self._data["uuid"]))

    def get_uuid(self) -> uuid:
        return self._uuid

    def get_kernels(self) -> list[xclbin.xclbinkernel]:
        return [xclbin.xclbinkernel(str(self._data["kernel"]), 3)]

    def get_xsa_name(self) -> str:
        return "stand_in_platform"


class device:
    def __init__(self, index: int = 0) -> None:
        if not 0 <= index < enumerate_devices():
            raise RuntimeError(f"No such device with index '{index}'")
        self.index = index
        self._xclbins: dict[uuid, xclbin] = {}
        self._loaded: uuid | None = None

    def load_xclbin(self, arg: xclbin | str) -> uuid:
        xb = arg if isinstance(arg, xclbin) else xclbin(arg)
        self._xclbins[xb.get_uuid()] = xb
        self._loaded = xb.get_uuid()
        return xb.get_uuid()

    def get_xclbin_uuid(self) -> uuid:
        if self._loaded is None:
            raise RuntimeError("no xclbin loaded")
        return self._loaded

    def get_info(self, key: int) -> str:
        if key == xrt_info_device.name:
            return "xilinx_stand_in_gen3x16"
        if key == xrt_info_device.bdf:
            return f"0000:0{self.index}:00.1"
        if key == xrt_info_device.host:
            return json.dumps(
                {"os": {"sysname": "Linux"}, "xrt": {"version": "2.17.0", "branch": "stand-in"}}
            )
        raise RuntimeError(f"unsupported info {key!r}")


class bo:
    class flags(enum.IntEnum):
        normal = 0
        cacheable = 1 << 24
        svm = 1 << 27
        device_only = 1 << 28
        host_only = 1 << 29
        p2p = 1 << 30

    normal = flags.normal
    cacheable = flags.cacheable
    device_only = flags.device_only
    host_only = flags.host_only

    def __init__(self, dev: device, size: int, flags: bo.flags, group: int) -> None:
        if size <= 0:
            raise RuntimeError("bo size must be positive")
        self._dev = dev
        self._host = np.zeros(size, np.int8)
        self._device = np.zeros(size, np.int8)
        self.group = group

    def size(self) -> int:
        return int(self._host.size)

    def write(self, data: Any, offset: int) -> None:
        raw = np.frombuffer(memoryview(data).cast("B"), np.int8)
        if offset + raw.size > self._host.size:
            raise RuntimeError("write out of bounds")
        self._host[offset : offset + raw.size] = raw

    def read(self, size: int, offset: int) -> np.ndarray:
        if offset + size > self._host.size:
            raise RuntimeError("read out of bounds")
        return self._host[offset : offset + size].copy()

    def map(self) -> memoryview:
        return self._host.data

    def sync(self, direction: xclBOSyncDirection, size: int | None = None, offset: int = 0) -> None:
        end = self._host.size if size is None else offset + size
        if direction == xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE:
            self._device[offset:end] = self._host[offset:end]
        elif direction == xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE:
            self._host[offset:end] = self._device[offset:end]
        else:
            raise RuntimeError(f"unsupported sync direction {direction!r}")


class run:
    def __init__(self, state: ert_cmd_state) -> None:
        self._state = state

    def wait(self, timeout_ms: int = 0) -> ert_cmd_state:
        return self._state

    def state(self) -> ert_cmd_state:
        return self._state


class kernel:
    class cu_access_mode(enum.IntEnum):
        exclusive = 0
        shared = 1
        none = 2

    exclusive = cu_access_mode.exclusive
    shared = cu_access_mode.shared
    fail_next_run = False
    """Test hook (not in the real API): the next run ends in ERT_CMD_STATE_ERROR."""

    def __init__(
        self,
        dev: device,
        xclbin_uuid: uuid,
        name: str,
        mode: kernel.cu_access_mode = cu_access_mode.shared,
    ) -> None:
        xb = dev._xclbins.get(xclbin_uuid)
        if xb is None:
            raise RuntimeError(f"xclbin {xclbin_uuid.to_string()} is not loaded on the device")
        if name != str(xb._data["kernel"]):
            raise RuntimeError(f"No compute units matching '{name}'")
        n = sum(1 for k in xb._data if k.startswith("w"))
        self._layers = [
            (xb._data[f"w{i}"].astype(np.float32), xb._data[f"b{i}"].astype(np.float32))
            for i in range(n)
        ]
        self.calls = 0

    def group_id(self, arg: int) -> int:
        return arg % 2  # inputs and outputs in different banks, as --sp often puts them

    def __call__(self, *args: Any) -> run:
        in_bo, out_bo, batch = args
        self.calls += 1
        n_in = self._layers[0][0].shape[0]
        n_out = self._layers[-1][0].shape[1]
        if kernel.fail_next_run:
            kernel.fail_next_run = False
            return run(ert_cmd_state.ERT_CMD_STATE_ERROR)
        if batch * n_in * 4 > in_bo.size() or batch * n_out * 4 > out_bo.size():
            return run(ert_cmd_state.ERT_CMD_STATE_ERROR)
        x = in_bo._device[: batch * n_in * 4].view(np.float32).reshape(batch, n_in)
        for i, (w, b) in enumerate(self._layers):
            x = x @ w + b
            if i < len(self._layers) - 1:
                x = np.maximum(x, 0)
        out_bo._device[: x.nbytes] = np.ascontiguousarray(x, np.float32).view(np.int8).ravel()
        return run(ert_cmd_state.ERT_CMD_STATE_COMPLETED)
