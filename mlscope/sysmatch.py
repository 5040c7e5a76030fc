"""System requirements against what agents advertise (paper §4.3, "system requirements").

A job may require of the machine its agent runs on: an architecture, a device kind, an
accelerator model, host memory, CPU cores, an interconnect and (``mlscope rerun``) a
host. Requirements come from the model manifest's ``system`` and from the job
(``mlscope-submit`` flags or ``--system FILE``); a field the job sets wins
(:func:`effective`). :func:`misses` says, in words, every requirement one agent does
not meet, so a refused job can list per live agent why it was passed over.

What is matched is what the agent may use, not only what the machine has: cores in its
CPU affinity and memory under its cgroup limit (``mlscope.sysinfo``).
"""

from __future__ import annotations

from pydantic import BaseModel

from mlscope.contracts import AgentDescription, SystemRequirement
from mlscope.devices import device_kind

__all__ = ["describe", "effective", "from_manifest", "misses", "usable_memory"]

_ARCH = {"x86_64": "amd64", "x64": "amd64", "aarch64": "arm64", "armv8": "arm64"}
_GIB = float(1 << 30)


def _arch(name: str) -> str:
    low = name.strip().lower()
    return _ARCH.get(low, low)


def from_manifest(system: BaseModel | None) -> SystemRequirement | None:
    """The fields a manifest's ``system`` (or a ``kind: system`` file) sets explicitly;
    None when it sets none (a manifest's default device ``cpu`` asks for nothing)."""
    if system is None:
        return None
    wanted = set(SystemRequirement.model_fields) & system.model_fields_set
    values = {k: getattr(system, k) for k in wanted}
    return SystemRequirement(**values) if values else None


def effective(
    manifest: SystemRequirement | None, job: SystemRequirement | None
) -> SystemRequirement | None:
    """The manifest's requirements with the job's set fields over them."""
    if manifest is None or job is None:
        return job or manifest
    return manifest.model_copy(update=job.model_dump(exclude_none=True))


def usable_memory(agent: AgentDescription) -> int:
    """Host memory the agent may use: its cgroup limit when lower than the machine's."""
    limit = agent.memory_limit_bytes
    return min(agent.memory_bytes, limit) if limit is not None else agent.memory_bytes


def _gib(n: int) -> str:
    return f"{n / _GIB:.1f} GiB"


def _device_kinds(agent: AgentDescription, framework: str | None) -> set[str]:
    kinds = {"cpu"} | {a.kind for a in agent.accelerators}
    for fw in agent.frameworks:
        if framework is None or fw.name == framework:
            kinds |= {device_kind(d) for d in fw.devices}
    return kinds


def misses(
    req: SystemRequirement | None, agent: AgentDescription, *, framework: str | None = None
) -> list[str]:
    """Every requirement ``agent`` does not meet, each in words with what it has."""
    if req is None:
        return []
    out = []
    if req.host is not None and agent.host != req.host:
        out.append(f"host {agent.host}, not {req.host}")
    if req.arch is not None and _arch(agent.arch) != _arch(req.arch):
        out.append(f"arch {agent.arch}, not {req.arch}")
    if req.device is not None and req.device not in (kinds := _device_kinds(agent, framework)):
        out.append(f"no {req.device} device (has {', '.join(sorted(kinds))})")
    accs = list(agent.accelerators)
    if req.accelerator is not None:
        accs = [a for a in accs if req.accelerator.casefold() in a.model.casefold()]
        if not accs:
            have = ", ".join(a.model for a in agent.accelerators) or "none"
            out.append(f"no accelerator {req.accelerator!r} (has {have})")
    if req.min_memory_bytes is not None and usable_memory(agent) < req.min_memory_bytes:
        out.append(f"memory {_gib(usable_memory(agent))} < {_gib(req.min_memory_bytes)}")
    cores = agent.usable_cores or agent.cpu_cores
    if req.min_cores is not None and cores < req.min_cores:
        out.append(f"{cores} usable cores < {req.min_cores}")
    if req.interconnect is not None and not any(
        (a.interconnect or "").casefold() == req.interconnect.casefold() for a in accs
    ):
        have = ", ".join(sorted({a.interconnect or "unknown" for a in accs})) or "no accelerator"
        out.append(f"no {req.interconnect} interconnect (has {have})")
    return out


def describe(req: SystemRequirement) -> str:
    """``arch amd64, >= 4 cores, >= 8.0 GiB memory`` (the fields that are set)."""
    parts = []
    if req.host is not None:
        parts.append(f"host {req.host}")
    if req.arch is not None:
        parts.append(f"arch {req.arch}")
    if req.device is not None:
        parts.append(f"a {req.device} device")
    if req.accelerator is not None:
        parts.append(f"accelerator {req.accelerator!r}")
    if req.min_memory_bytes is not None:
        parts.append(f">= {_gib(req.min_memory_bytes)} memory")
    if req.min_cores is not None:
        parts.append(f">= {req.min_cores} cores")
    if req.interconnect is not None:
        parts.append(f"interconnect {req.interconnect}")
    return ", ".join(parts) or "nothing"
