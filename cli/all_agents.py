"""``mlscope-submit --all-agents``: one evaluation on every matching agent, gathered.

:func:`submit_all` returns the summaries (one per agent, in agent order) and
:func:`comparison_table` renders them side by side. Output divergence across
frameworks is computed elsewhere (broker/compare.py) from the same summaries.
"""

from __future__ import annotations

import anyio

from cli.submit_errors import InFlight
from mlscope import bus as busmod
from mlscope import sysmatch
from mlscope.contracts import AgentDescription, EvaluationSummary, JobRequest, new_id
from mlscope.errors import MLScopeError, ResolutionError
from mlscope.registry import list_agents
from mlscope.settings import Settings

__all__ = ["comparison_table", "matching_agents", "submit_all"]


def matching_agents(
    job: JobRequest, agents: list[AgentDescription], *, any_framework: bool = False
) -> list[tuple[AgentDescription, str]]:
    """(agent, framework) for every live agent that offers the job's model and meets
    the job's system requirements (the model manifest's are the server's to apply)."""
    out = []
    for a in agents:
        for offer in a.models:
            if offer.name != job.model:
                continue
            if job.model_version and offer.version != job.model_version:
                continue
            if not any_framework and offer.framework != job.framework:
                continue
            fw = next((f for f in a.frameworks if f.name == offer.framework), None)
            if fw is None or not any(
                d.split(":")[0] == job.device.split(":")[0] for d in fw.devices
            ):
                continue
            if sysmatch.misses(job.system, a, framework=offer.framework):
                continue
            out.append((a, offer.framework))
            break
    return out


async def submit_all(
    settings: Settings,
    job: JobRequest,
    *,
    any_framework: bool = False,
    timeout: float | None = None,
    in_flight: InFlight | None = None,
) -> list[EvaluationSummary | MLScopeError]:
    """Submit one copy of ``job`` per matching agent; one result each (the summary, or
    the typed error that evaluation failed with). Agents on different hosts run at once;
    agents sharing a host one after another, unless ``job.parallel``. ``in_flight``
    knows which jobs are running (Ctrl-C cancels those)."""
    send = (in_flight or InFlight()).submit
    async with busmod.connect(settings, name="mlscope-submit --all-agents") as bus:
        agents = await list_agents(bus)
    targets = matching_agents(job, agents, any_framework=any_framework)
    if not targets:
        raise ResolutionError(
            f"no live agent offers {job.model} "
            f"({'any framework' if any_framework else job.framework})",
            model=job.model,
        )
    results: list[EvaluationSummary | MLScopeError | None] = [None] * len(targets)

    async def one(i: int, agent: AgentDescription, framework: str) -> None:
        copy = job.model_copy(
            update={
                "job_id": new_id("job"),
                "agent_id": agent.agent_id,
                "framework": framework,
                "framework_version": None,
            }
        )
        try:
            results[i] = await send(settings, copy, timeout=timeout)
        except MLScopeError as exc:
            results[i] = exc

    lanes: dict[str, list[int]] = {}
    for i, (agent, _) in enumerate(targets):
        lanes.setdefault(str(i) if job.parallel else agent.host, []).append(i)

    async def lane(indices: list[int]) -> None:
        for i in indices:
            await one(i, *targets[i])

    async with anyio.create_task_group() as tg:
        for indices in lanes.values():
            tg.start_soon(lane, indices)
    return [r for r in results if r is not None]


def comparison_table(results: list[EvaluationSummary | MLScopeError]) -> str:
    """One row per evaluation: agent, framework, verdict, latency, throughput."""
    head = (
        f"{'agent':<34} {'framework':<20} {'verdict':<8} {'queries':>8} "
        f"{'p50 ms':>9} {'p99 ms':>9} {'QPS':>9} {'top1':>7}"
    )
    rows = [head, "-" * len(head)]
    for r in results:
        if isinstance(r, MLScopeError):
            rows.append(f"{'?':<34} {'':<20} {'FAILED':<8} {r.message}")
            continue
        top1 = (r.accuracy or {}).get("top1")
        fw = f"{r.framework['name']} {r.framework['version']}"[:20]
        rows.append(
            f"{r.agent_id[:34]:<34} {fw:<20} "
            f"{'valid' if r.valid else 'INVALID':<8} {r.queries:>8} "
            f"{_f(r.latency_ms.p50):>9} {_f(r.latency_ms.p99):>9} {_f(r.achieved_qps, 1):>9} "
            f"{_f(top1, 4):>7}"
        )
    return "\n".join(rows)


def _f(v: float | None, nd: int = 3) -> str:
    return "-" if v is None else f"{v:.{nd}f}"
