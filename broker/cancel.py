"""What a cancelled job leaves in the database: one evaluation row, status
``cancelled``, never VALID, with the reason and how far the run got, and the raw rows
of the queries it had issued.

The server (:mod:`broker.server`) cancels a job's own cancel scope on a
``CancelRequest``. The figures of a run stopped part-way would describe a different
run than the one specified, so the summary holds none (no latency, no rates); the
per-query rows issued before the cancel are kept as measured (a query still in flight
is stored as lost, its error saying it was cancelled), so the partial run can be
inspected. Of a sweep, only the run in progress is kept, under the job's id.
"""

from __future__ import annotations

import time

import numpy as np

from broker.record import ARRAYS, RunRecord
from mlscope.catalog import Entry
from mlscope.contracts import (
    AgentDescription,
    EvaluationSummary,
    JobRequest,
    LatencyStats,
    evaluation_id_for,
)

__all__ = ["IN_FLIGHT", "cancelled_summary", "issued_part"]

IN_FLIGHT = "cancelled before its reply"
"""The error of a query that was in flight when its job was cancelled."""


def issued_part(rec: RunRecord) -> RunRecord:
    """A copy of ``rec`` up to its last issued query (the rest were never due): the
    rows a cancelled run stores."""
    sent = np.flatnonzero((rec.issued > 0) | (rec.completed > 0))
    count = int(sent[-1]) + 1 if sent.size else 0
    part = RunRecord(
        n=count, batch_size=rec.batch_size, t0_ns=rec.t0_ns, warmup=min(rec.warmup, count)
    )
    for name in ARRAYS:
        getattr(part, name)[:] = getattr(rec, name)[:count]
    part.errors = {i: e for i, e in rec.errors.items() if i < count}
    for i in np.flatnonzero(part.completed == 0).tolist():
        part.errors.setdefault(i, IN_FLIGHT)
    part.done = int(np.count_nonzero(part.completed))
    return part


def cancelled_summary(
    job: JobRequest,
    resolved: tuple[AgentDescription, Entry] | None,
    *,
    reason: str,
    issued: int,
    answered: int,
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
            f"cancelled: {reason} after {now - started_at:.1f} s, "
            f"{answered} of {issued} issued queries answered",
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
        queries=issued,
        samples=0,
        errors=issued - answered,
        lost=issued - answered,
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
