"""What this machine is: host, architecture, CPU, memory, accelerators."""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path

import psutil

__all__ = ["cpu_model", "host_facts"]


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
