"""Energy an evaluation used, from the cumulative counters a machine exposes.

Two sources, read at prepare and at release; the difference is the evaluation's energy:

- **NVML** (NVIDIA GPUs, ``nvidia-ml-py``): ``nvmlDeviceGetTotalEnergyConsumption``,
  millijoules since the driver loaded, summed over the visible GPUs. Used for runs on
  a ``cuda`` device.
- **RAPL** (Intel and AMD CPUs, Linux ``/sys/class/powercap``): each package's
  ``energy_uj`` counter, microjoules, wrapping at ``max_energy_range_uj``. Used for
  runs on the CPU. It counts the whole package, every process on it included.

Where neither is readable (no driver, no powercap, a container without access) the
figure is None: "not available", never 0.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EnergyMeter", "RaplCounter", "energy_between"]

POWERCAP = Path("/sys/class/powercap")


@dataclass(frozen=True)
class RaplCounter:
    """One RAPL package domain: its counter file and the value it wraps at (µJ)."""

    energy: Path
    wrap_uj: int

    def read_uj(self) -> int | None:
        try:
            return int(self.energy.read_text().strip())
        except (OSError, ValueError):  # unreadable (root only on recent kernels)
            return None


def rapl_counters(root: Path = POWERCAP) -> list[RaplCounter]:
    """The readable package domains (``intel-rapl:N``; AMD exposes the same names),
    not their subdomains (core, uncore, dram), which the package already counts."""
    out = []
    for domain in sorted(root.glob("intel-rapl:*")):
        if domain.name.count(":") != 1:
            continue  # a subdomain
        energy, wrap = domain / "energy_uj", domain / "max_energy_range_uj"
        try:
            counter = RaplCounter(energy, int(wrap.read_text().strip()))
        except (OSError, ValueError):
            continue
        if counter.read_uj() is not None:
            out.append(counter)
    return out


def energy_between(start_uj: int, end_uj: int, wrap_uj: int) -> int:
    """Microjoules from ``start_uj`` to ``end_uj`` on a counter that wraps at
    ``wrap_uj`` (at most one wrap between the two reads)."""
    return end_uj - start_uj if end_uj >= start_uj else end_uj + wrap_uj + 1 - start_uj


@dataclass
class EnergyMeter:
    """Cumulative energy readings of the agent's devices, and the energy of each
    evaluation between :meth:`start` and :meth:`stop`."""

    rapl: list[RaplCounter] = field(default_factory=rapl_counters)
    nvml: Any = None
    """The ``pynvml`` module once initialized (None: no NVIDIA driver or library)."""
    _started: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def readings(self, device: str) -> list[int] | None:
        """Each counter of ``device``'s source, in µJ; None when it has none readable."""
        if device.startswith("cuda"):
            return self._nvml_uj()
        values = [c.read_uj() for c in self.rapl]
        if not values or any(v is None for v in values):
            return None
        return [int(v) for v in values if v is not None]

    def _nvml_uj(self) -> list[int] | None:
        nv = self.nvml
        if nv is None:
            return None
        try:
            return [
                int(nv.nvmlDeviceGetTotalEnergyConsumption(nv.nvmlDeviceGetHandleByIndex(i))) * 1000
                for i in range(nv.nvmlDeviceGetCount())
            ] or None
        except Exception:
            return None

    def start(self, key: str, device: str) -> None:
        values = self.readings(device)
        if values is not None:
            with self._lock:
                self._started.setdefault(key, (device, values))

    def stop(self, key: str) -> float | None:
        """Joules since :meth:`start` of ``key``; None when no counter was readable."""
        with self._lock:
            got = self._started.pop(key, None)
        if got is None:
            return None
        device, before = got
        after = self.readings(device)
        if after is None or len(after) != len(before):
            return None
        if device.startswith("cuda"):  # NVML counts from driver load: no wrap
            return sum(b - a for a, b in zip(before, after, strict=True)) / 1e6
        uj = sum(
            energy_between(a, b, c.wrap_uj)
            for a, b, c in zip(before, after, self.rapl, strict=True)
        )
        return uj / 1e6
