"""What this machine is: host, architecture, CPU, memory, accelerators."""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path

import psutil

from mlscope.contracts import Accelerator

__all__ = ["cpu_model", "host_facts", "nvml_gpus"]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Hardware", "Model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_facts() -> dict[str, object]:
    """The hardware half of an agent description (fields of AgentDescription)."""
    return {
        "host": socket.gethostname(),
        "arch": platform.machine(),
        "os": f"{platform.system()} {platform.release()}",
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count() or 1,
        "memory_bytes": psutil.virtual_memory().total,
    }


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
                )
            )
        return out
    finally:
        pynvml.nvmlShutdown()
