"""Which live agent runs a job: the one resolution rule, and the error that says why
none can.

An agent fits a job when it serves the model's version on the framework, version and
device the job and its manifest allow, meets the system the job requires, and (for
placement agent) can run the load itself. Equal agents share jobs by the job id's hash,
so a redelivered job finds the same agent.
"""

from __future__ import annotations

import zlib

from mlscope import sysmatch
from mlscope.catalog import Catalog, Entry
from mlscope.contracts import (
    LOCAL_RUN,
    MLPERF_LOADGEN,
    AgentDescription,
    JobRequest,
    SystemRequirement,
)
from mlscope.errors import MLScopeError, ResolutionError
from mlscope.provision import AGENT_TTL_S
from mlscope.versions import satisfies

__all__ = ["RESOLVE_GRACE_S", "recently_alive", "resolve"]


def resolve(
    job: JobRequest, agents: list[AgentDescription], catalog: Catalog
) -> tuple[AgentDescription, Entry]:
    """The model manifest and a live agent for a job; errors name what exists."""
    entry = catalog.find(job.model, version=job.model_version, framework=job.framework)
    m = entry.manifest
    if job.manifest_sha256 is not None and m.digest != job.manifest_sha256:
        raise ResolutionError(
            f"{m.key}: the manifest ({entry.path}) is not the one this job pins "
            f"(content sha256 {m.digest}, pinned {job.manifest_sha256}): it changed since "
            f"{job.rerun_of or 'the pinned evaluation'} ran",
            model=m.name,
            framework=job.framework,
        )

    system = sysmatch.effective(sysmatch.from_manifest(m.system), job.system)

    # Placement agent needs the agent to generate the load: a local run, or LoadGen.
    feature = MLPERF_LOADGEN if job.mlperf is not None else LOCAL_RUN

    def fits(a: AgentDescription) -> bool:
        return serves(a) and (job.placement == "server" or feature in a.features)

    def serves(a: AgentDescription) -> bool:
        fw = next((f for f in a.frameworks if f.name == job.framework), None)
        return (
            fw is not None
            and _has_device(fw.devices, job.device)
            and satisfies(fw.version, job.framework_version)
            and satisfies(fw.version, m.framework.version)
            and any(o.name == m.name and o.version == m.version for o in a.models)
            and (job.agent_id is None or a.agent_id == job.agent_id)
            and not sysmatch.misses(system, a, framework=job.framework)
        )

    matches = [a for a in agents if fits(a)]
    unable = [a.agent_id for a in agents if serves(a) and not fits(a)]
    if not matches and unable:
        raise ResolutionError(
            f"placement agent: agent(s) {', '.join(unable)} serve {m.name}@{m.version} on "
            f"{job.framework} but cannot run load themselves (no {feature!r} feature: an "
            "older mlscope, started without it, or without mlcommons-loadgen for an MLPerf "
            "run); submit with --placement server",
            model=m.name,
            framework=job.framework,
            placement=job.placement,
            agents=unable,
        )
    if not matches:
        raise _nothing_serves(job, entry, agents, system)
    # Spread jobs over equal agents deterministically by job id.
    return matches[zlib.crc32(job.job_id.encode()) % len(matches)], entry


RESOLVE_GRACE_S = 2 * AGENT_TTL_S
"""How long a job waits for a matching agent that heartbeated moments ago: a cluster
failover (the registry bucket electing a new leader) or a client reconnect can hold an
agent's heartbeats back for seconds while the agent itself is fine."""


def recently_alive(
    job: JobRequest,
    agents: list[AgentDescription],
    catalog: Catalog,
    *,
    now: float,
    grace_s: float = RESOLVE_GRACE_S,
) -> bool:
    """True when an agent whose last heartbeat is at most ``grace_s`` old would serve
    ``job``: worth waiting for its next heartbeat. A job that no recently seen agent
    matches (unknown framework or version, an agent gone for longer) fails at once."""
    recent = [a for a in agents if now - a.heartbeat_at <= grace_s]
    try:
        resolve(job, recent, catalog)
    except MLScopeError:
        return False
    return True


def _has_device(devices: tuple[str, ...], wanted: str) -> bool:
    """'cuda' matches any 'cuda:N'; 'cuda:1' matches only itself."""
    if ":" in wanted:
        return wanted in devices
    return any(d.split(":")[0] == wanted for d in devices)


def _describe(a: AgentDescription) -> str:
    fws = ", ".join(f"{f.name} {f.version} {'/'.join(f.devices)}" for f in a.frameworks)
    models = ", ".join(sorted({f"{o.name}@{o.version}" for o in a.models})) or "no models"
    return f"{a.agent_id} ({fws}: {models})"


def _nothing_serves(
    job: JobRequest,
    entry: Entry,
    agents: list[AgentDescription],
    system: SystemRequirement | None,
) -> ResolutionError:
    """Why no live agent serves ``job``: what it wants, each agent's refusal of the model
    and the command that mends it, the system requirements each agent of its framework
    misses, and every live agent with its models."""
    m = entry.manifest
    live = "; ".join(_describe(a) for a in agents) or "none"
    want = (
        f"{m.name}@{m.version} on {job.framework} "
        f"{job.framework_version or m.framework.version} ({job.device})"
    )
    if job.agent_id:
        want += f" on agent {job.agent_id}"
    refusals = [
        (a.agent_id, r)
        for a in agents
        for r in a.refused
        if (r.name, r.version, r.framework) == (m.name, m.version, job.framework)
    ]
    why = "".join(f"; agent {aid} refuses it: {r.message}" for aid, r in refusals)
    fixes = sorted({r.fix for _, r in refusals if r.fix})
    fix = f"; to fix it, run {' and '.join(f'`{f}`' for f in fixes)}" if fixes else ""
    missed = {  # the agents of the job's framework: another's misses are no reason
        a.agent_id: sysmatch.misses(system, a, framework=job.framework)
        for a in agents
        if any(f.name == job.framework for f in a.frameworks)
    }
    if system is not None:
        want += f" on a system with {sysmatch.describe(system)}"
        why += "".join(f"; agent {aid} misses {', '.join(v)}" for aid, v in missed.items() if v)
    return ResolutionError(
        f"no live agent serves {want}{why}{fix}; live agents: {live}",
        model=m.name,
        framework=job.framework,
        refused=[r.model_dump() for _, r in refusals],
        fixes=fixes,
        system_misses={aid: v for aid, v in missed.items() if v},
    )
