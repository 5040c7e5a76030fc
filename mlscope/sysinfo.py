"""What this machine is: host, architecture, CPU, memory, accelerators."""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path
from typing import Any

import psutil

from mlscope.contracts import Accelerator

__all__ = ["cgroup_memory_limit", "cpu_model", "host_facts", "nvml_gpus", "usable_cores"]

CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Hardware", "Model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity: ``taskset``, a container's
    cpuset), which can be fewer than the machine has."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def cgroup_memory_limit(files: tuple[Path, ...] = CGROUP_LIMITS) -> int | None:
    """This process's cgroup memory limit in bytes; None when there is none."""
    for f in files:
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
        return None  # "max": unlimited
    return None


def host_facts() -> dict[str, object]:
    """The hardware half of an agent description (fields of AgentDescription)."""
    total = psutil.virtual_memory().total
    limit = cgroup_memory_limit()
    return {
        "host": socket.gethostname(),
        "arch": platform.machine(),
        "os": f"{platform.system()} {platform.release()}",
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count() or 1,
        "memory_bytes": total,
        "usable_cores": usable_cores(),
        "memory_limit_bytes": limit if limit is not None and limit < total else None,
    }


def _nvml_interconnect(pynvml: object, handle: object) -> str | None:
    """``nvlink`` when a link of the GPU is active, else ``pcie<generation>``; None
    when the driver does not say."""
    nv: Any = pynvml
    for link in range(18):  # NVML_NVLINK_MAX_LINKS
        try:
            if nv.nvmlDeviceGetNvLinkState(handle, link) == 1:
                return "nvlink"
        except Exception:  # no NVLink (or no such link): NVML raises its own errors
            break
    try:
        return f"pcie{int(nv.nvmlDeviceGetMaxPcieLinkGeneration(handle))}"
    except Exception:
        return None


def nvml_gpus() -> list[Accelerator]:
    """NVIDIA GPUs as NVML reports them; empty without pynvml or a driver."""
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no device: nothing to report
        return []
    try:
        out = []
        for i in range(int(pynvml.nvmlDeviceGetCount())):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            out.append(
                Accelerator(
                    kind="gpu",
                    model=name.decode() if isinstance(name, bytes) else str(name),
                    index=i,
                    memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total),
                    interconnect=_nvml_interconnect(pynvml, h),
                )
            )
        return out
    finally:
        pynvml.nvmlShutdown()
