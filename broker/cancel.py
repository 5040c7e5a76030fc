"""What a cancelled job leaves in the database: one evaluation row, status
``cancelled``, never VALID, with the reason and how far the run got.

The server (:mod:`broker.server`) cancels a job's own cancel scope on a
``CancelRequest``; the figures of a run stopped part-way would describe a different
run than the one specified, so none are stored (no latency, no rates, no query rows).
"""

from __future__ import annotations

import time

from mlscope.catalog import Entry
from mlscope.contracts import (
    AgentDescription,
    EvaluationSummary,
    JobRequest,
    LatencyStats,
    evaluation_id_for,
)

__all__ = ["cancelled_summary"]


def cancelled_summary(
    job: JobRequest,
    resolved: tuple[AgentDescription, Entry] | None,
    *,
    reason: str,
    queries_done: int,
    started_at: float,
) -> EvaluationSummary:
    """The stored summary of a cancelled job: no figures, never VALID, the reason and
    how far it got (the agent and versions when it had been resolved)."""
    now = time.time()
    agent, entry = resolved if resolved is not None else (None, None)
    fw = next((f for f in agent.frameworks if f.name == job.framework), None) if agent else None
    spec = job.scenario
    return EvaluationSummary(
        evaluation_id=evaluation_id_for(job.job_id),
        job_id=job.job_id,
        status="cancelled",
        valid=False,
        invalid_reasons=(
            f"cancelled: {reason} after {now - started_at:.1f} s, {queries_done} queries done",
        ),
        model={
            "name": job.model,
            "version": entry.manifest.version if entry else job.model_version or "",
        },
        framework={
            "name": job.framework,
            "version": fw.version if fw else job.framework_version or "",
        },
        agent_id=agent.agent_id if agent else "",
        host=agent.host if agent else "",
        device=job.device,
        scenario=spec.model_dump(),
        trace_level=job.trace_level,
        queries=queries_done,
        samples=0,
        errors=0,
        not_issued=0,
        duration_s=now - started_at,
        requested_qps=spec.qps if spec.name in ("online", "constant", "multi-stream") else None,
        achieved_qps=None,
        parallel=job.parallel,
        latency_ms=LatencyStats(trimmed_mean=None, p50=None, p90=None, p99=None, max=None),
        issue_lag_us={},
        throughput_ips=None,
        started_at=started_at,
        finished_at=now,
    )
