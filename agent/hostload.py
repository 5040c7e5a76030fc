"""Who else used the agent's host while an evaluation ran.

A model measured on a host that other processes keep busy gets less CPU than on a quiet
one, and its figures do not reproduce there; on a virtual machine the hypervisor may
take CPU time too (*steal*). Neither shows in the figures themselves, so the agent reads
the host's cumulative CPU counters at prepare and at release, as it reads its energy
counters (:mod:`agent.energy`):

- every CPU's busy time (``/proc/stat``: user, nice, system, irq, softirq; guest time is
  part of user), less the agent process's own (its user and system time, and its
  children's once reaped: a LoadGen child of an MLPerf run) is what **other processes**
  used;
- the ``steal`` column is what the hypervisor took.

Both are CPU seconds over the window; the server turns them into cores kept busy on
average. Where ``/proc/stat`` is not readable (not Linux) the figures are None, "not
known", never 0.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["HostCpu", "HostLoad", "HostUse", "read_host_cpu"]

PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True, slots=True)
class HostCpu:
    """Cumulative CPU seconds of the host and of this process at one moment."""

    busy_s: float
    """Every CPU's busy time since boot (user, nice, system, irq, softirq)."""
    steal_s: float
    """Time the hypervisor ran something else on this host's virtual CPUs."""
    own_s: float
    """This process's user and system time, and its reaped children's."""
    at_s: float
    """``time.monotonic()`` when read."""


@dataclass(frozen=True, slots=True)
class HostUse:
    """What the host did between two :class:`HostCpu` readings (CPU seconds)."""

    other_cpu_s: float
    """Busy time of every process but this one (never below 0: the counters tick at
    different moments)."""
    steal_s: float
    window_s: float


def read_host_cpu(stat: Path = PROC_STAT) -> HostCpu | None:
    """The host's counters now; None where ``stat`` cannot be read or parsed."""
    try:
        with stat.open() as fh:
            first = fh.readline().split()
    except OSError:
        return None
    if len(first) < 9 or first[0] != "cpu":
        return None
    try:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, first[1:9])
    except ValueError:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return HostCpu(
        busy_s=(user + nice + system + irq + softirq) / hz,
        steal_s=steal / hz,
        own_s=own.user + own.system + own.children_user + own.children_system,
        at_s=time.monotonic(),
    )


def between(a: HostCpu, b: HostCpu) -> HostUse:
    """What the host did from reading ``a`` to reading ``b``."""
    return HostUse(
        other_cpu_s=max((b.busy_s - a.busy_s) - (b.own_s - a.own_s), 0.0),
        steal_s=max(b.steal_s - a.steal_s, 0.0),
        window_s=max(b.at_s - a.at_s, 0.0),
    )


@dataclass
class HostLoad:
    """The host's use by others over each evaluation, from :meth:`start` to :meth:`stop`."""

    stat: Path = PROC_STAT
    _started: dict[str, HostCpu] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, key: str) -> None:
        now = read_host_cpu(self.stat)
        if now is not None:
            with self._lock:
                self._started.setdefault(key, now)

    def stop(self, key: str) -> HostUse | None:
        """Since :meth:`start` of ``key``; None when the counters were not readable."""
        with self._lock:
            before = self._started.pop(key, None)
        after = read_host_cpu(self.stat)
        if before is None or after is None:
            return None
        return between(before, after)
