"""What a cancelled job leaves in the database: an evaluation row with status
``cancelled``, never VALID, with the reason and how far the run got, and the raw rows
of the queries it had issued; of a sweep or search, also every run it finished.

The server (:mod:`broker.server`) cancels a job's own cancel scope on a
``CancelRequest``. The figures of a run stopped part-way would describe a different
run than the one specified, so the summary holds none (no latency, no rates); the
per-query rows issued before the cancel are kept as measured (a query still in flight
is stored as lost, its error saying it was cancelled), so the partial run can be
inspected.

A job of one run (a sweep of one point included) is that run, stored under the job's
id. A sweep or search (several runs, each traced under its own id ``<job>-<k>``) is
stored as a finished one is, as far as it got (:func:`cancelled_rows`): each run that
finished before the cancel as its own evaluation with its verdict (stored by
:class:`broker.evaluate.Evaluator`, :func:`broker.evalstore.store_separate`); the run
in progress under its own id as ``cancelled`` (no figures, its issued query rows, so
its spans have their evaluation); then the parent under the job's id, ``cancelled``,
its ``points`` naming every run (the one in progress with ``status`` ``cancelled``)
and a reason saying which run was in progress. How far the scenario got is its
:class:`broker.run.RunsSoFar`.

The load generators' CPU time up to the cancel is kept too (``loadgen_cost``:
``cpu_s``, ``cpu_us_per_query``, ``loadgens``, and ``services`` for load-generator
services), where they report it: a server's own load generator, every process of a
run dealt to several (``loadgens``), every service (``loadgen_hosts``). A dealt run
keeps rows and CPU time only when every load generator wrote what it had issued when
stopped (else it keeps neither, its progress count aside); its record is cut where the
first of them stopped (:func:`broker.lgresults.until_first_stop`), while each one's
CPU time runs to its own stop, so the time per query is over the queries kept.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np

from broker.run import Run, RunsSoFar
from broker.summary import cpu_us_per_query, process_cpu
from mlscope import outcomes, scenario_traits
from mlscope.catalog import Entry
from mlscope.contracts import (
    AgentDescription,
    EvaluationSummary,
    JobRequest,
    LatencyStats,
    Placement,
    evaluation_id_for,
)
from mlscope.record import ARRAYS, RunRecord

__all__ = [
    "IN_FLIGHT",
    "REMEMBERED",
    "Cancels",
    "cancelled_rows",
    "cancelled_summary",
    "issued_part",
]

REMEMBERED = 1024
"""Ids of cancelled jobs a server keeps, to refuse one it takes after the request."""

IN_FLIGHT = "cancelled before its reply"
"""The error of a query that was in flight when its job was cancelled."""


@dataclass
class Cancels:
    """A server's cancel bookkeeping: which jobs run here under which cancel scope,
    which were asked to stop, and how far each got (for what is stored)."""

    scopes: dict[str, anyio.CancelScope] = field(default_factory=dict)
    """Job id -> the cancel scope of its run here."""
    requested: dict[str, str] = field(default_factory=dict)
    """Job id -> reason, for every cancel heard (bounded: the oldest are dropped)."""
    ended: dict[str, anyio.Event] = field(default_factory=dict)
    """Job id -> set when the job has ended here (a cancel's reply waits for it)."""
    progress: dict[str, tuple[RunsSoFar, Any]] = field(default_factory=dict)
    """Job id -> (how far its scenario got: its live run record, a sweep's runs; its
    resolved (agent, entry), None until known)."""

    def request(self, job_id: str, reason: str, *, taken: bool = False) -> anyio.Event | None:
        """Remember a cancel and stop the job if it runs here: the event that is set
        when it has ended, or None when it does not run here. ``taken``: the server
        took the job and has not started its run yet (it checks for a stored result,
        or cleans up a lost attempt): its run is cancelled as it starts."""
        self.requested[job_id] = reason
        while len(self.requested) > REMEMBERED:
            del self.requested[next(iter(self.requested))]
        scope = self.scopes.get(job_id)
        if scope is None and not taken:
            return None
        if scope is not None:
            scope.cancel()
        return self.ended.setdefault(job_id, anyio.Event())

    @contextmanager
    def running(self, job_id: str) -> Iterator[anyio.CancelScope]:
        """The job's cancel scope, cancelled at once if a cancel came before it ran."""
        self.progress[job_id] = (RunsSoFar(), None)
        try:
            with anyio.CancelScope() as scope:
                self.scopes[job_id] = scope
                if job_id in self.requested:
                    scope.cancel()
                yield scope
        finally:
            self.scopes.pop(job_id, None)

    def finish(self, job_id: str) -> tuple[RunsSoFar, Any] | None:
        """The job ended here (however): wake a waiting cancel; (runs, resolved)."""
        if (ended := self.ended.pop(job_id, None)) is not None:
            ended.set()
        return self.progress.pop(job_id, None)


def issued_part(rec: RunRecord) -> RunRecord:
    """A copy of ``rec`` up to its last issued query (the rest were never sent): the
    rows a cancelled run stores. An issued query without a reply is lost, its error
    :data:`IN_FLIGHT`; one the outstanding bound kept from being sent stays not issued.

    Every load generator stamps a query's issue time as it sends it (the server's
    :class:`broker.loadgen.Driver`, the agent's :class:`agent.localrun.LocalRun`), so
    the live record holds every query sent up to the cancel."""
    sent = outcomes.was_sent(rec.issued, rec.completed)
    last = np.flatnonzero(sent)
    count = int(last[-1]) + 1 if last.size else 0
    part = RunRecord(
        n=count, batch_size=rec.batch_size, t0_ns=rec.t0_ns, warmup=min(rec.warmup, count)
    )
    for name in ARRAYS:
        getattr(part, name)[:] = getattr(rec, name)[:count]
    part.errors = {i: e for i, e in rec.errors.items() if i < count}
    for i in np.flatnonzero(sent[:count] & (part.completed == 0)).tolist():
        part.errors.setdefault(i, IN_FLIGHT)
    part.done = int(np.count_nonzero(part.completed))
    part.preprocessed, part.streamed, part.sources = rec.preprocessed, rec.streamed, rec.sources
    part.cpu_s, part.process_cpu_s = rec.cpu_s, rec.process_cpu_s
    return part


def cancelled_summary(
    job: JobRequest,
    resolved: tuple[AgentDescription, Entry] | None,
    *,
    reason: str,
    started_at: float,
    rec: RunRecord | None = None,
    tallied: int = 0,
) -> EvaluationSummary:
    """The stored summary of a cancelled job: no figures, never VALID, the reason and
    how far it got (the agent and versions when it had been resolved).

    ``rec``: the rows stored (:func:`issued_part`); its counts are those of its rows'
    outcomes (:mod:`mlscope.outcomes`, warm-up included: a cancelled run has no
    statistics to leave it out of); None when no query was issued. ``tallied``: the
    queries answered so far by load generators of their own (``loadgens`` > 1,
    ``loadgen_hosts``) when one of them kept no record of its slice when stopped: the
    run then keeps no rows."""
    now = time.time()
    counts = _counts(rec) if rec is not None else dict.fromkeys(_NONE, 0)
    sent = counts["queries"] - counts["not_issued"]
    how_far = (
        f"{tallied} queries answered by its load generators, whose rows a cancelled run "
        "does not keep"
        if tallied and not sent
        else f"{sent - counts['lost']} of {sent} issued queries answered"
    )
    agent, entry = resolved if resolved is not None else (None, None)
    fw = next((f for f in agent.frameworks if f.name == job.framework), None) if agent else None
    spec = job.scenario
    return EvaluationSummary(
        evaluation_id=evaluation_id_for(job.job_id),
        job_id=job.job_id,
        status="cancelled",
        valid=False,
        invalid_reasons=(f"cancelled: {reason} after {now - started_at:.1f} s, {how_far}",),
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
        queries=counts["queries"],
        samples=0,
        errors=counts["errors"],
        failed=counts["failed"],
        refused=counts["refused"],
        lost=counts["lost"],
        not_issued=counts["not_issued"],
        duration_s=now - started_at,
        requested_qps=spec.qps if scenario_traits.get(spec.name).rate_driven else None,
        achieved_qps=None,
        parallel=job.parallel,
        placement=job.placement,
        latency_ms=LatencyStats(trimmed_mean=None, p50=None, p90=None, p99=None, max=None),
        issue_lag_us={},
        throughput_ips=None,
        loadgen_cost=_loadgen_cost(rec, spec.loadgens, job.placement),
        started_at=started_at,
        finished_at=now,
    )


def cancelled_rows(
    summary: EvaluationSummary, runs: RunsSoFar, rec: RunRecord | None
) -> list[tuple[EvaluationSummary, RunRecord | None]]:
    """What a cancelled job stores, in order (its evaluation row last): each
    (summary, query rows). ``summary``: :func:`cancelled_summary` of the run in
    progress with ``rec``, its rows. A job of one run is that run, under the job's id.
    Of a sweep or search (``runs`` holds runs of their own), the run in progress goes
    under its own id and the parent, with no rows, names every run in its ``points``
    (those that finished are stored already, :func:`broker.evalstore.store_separate`)."""
    if runs.current is None and not runs.finished:
        return [(summary, rec)]
    rows: list[tuple[EvaluationSummary, RunRecord | None]] = []
    points = [r.point() for r in runs.finished]
    during = f"after {_named(runs.finished)} finished"
    if runs.current is not None:
        run_id, spec, qps = runs.current
        run = summary.model_copy(
            update={"evaluation_id": run_id, "scenario": spec.model_dump(), "requested_qps": qps}
        )
        rows.append((run, rec))
        points.append(Run.cancelled_point(run_id, spec, qps, run.queries, run.invalid_reasons[0]))
        during = f"during run {run_id}, {during}"
    why = f"cancelled {during}"
    parent = summary.model_copy(
        update={"invalid_reasons": (*summary.invalid_reasons, why), "points": tuple(points)}
    )
    return [*rows, (parent, None)]


def _named(finished: list[Run]) -> str:
    """The runs that finished, as a reason names them."""
    if not finished:
        return "no run"
    ids = ", ".join(r.evaluation_id for r in finished)
    return f"run {ids}" if len(finished) == 1 else f"runs {ids}"


def _loadgen_cost(
    rec: RunRecord | None, loadgens: int, placement: Placement
) -> dict[str, Any] | None:
    """The CPU time the run's load generators report up to the cancel, and an agent's
    local run's process CPU time (:func:`broker.summary.process_cpu`); None where they
    report none."""
    if rec is None or (rec.cpu_s <= 0 and rec.process_cpu_s is None):
        return None
    return {
        "cpu_s": rec.cpu_s,
        "cpu_us_per_query": cpu_us_per_query(rec),
        "loadgens": loadgens,
        **({"services": list(rec.sources)} if rec.sources else {}),
        "placement": placement,
        **process_cpu(rec),
    }


def _counts(rec: RunRecord) -> dict[str, int]:
    """Rows and outcomes of a cancelled run's stored rows."""
    return {"queries": rec.n, **outcomes.count(rec.outcomes())}


_NONE = ("queries", "errors", "failed", "refused", "lost", "not_issued")
"""The counts of a cancelled job that issued nothing (all 0)."""
