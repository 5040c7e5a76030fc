"""What Linux's /proc says of a process: the independent view tests check its figures
against."""

from __future__ import annotations

from pathlib import Path


def proc_status_bytes(pid: int, field: str) -> int:
    """``field`` (VmRSS, VmHWM) of /proc/PID/status, in bytes (the kernel says kB: KiB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")
