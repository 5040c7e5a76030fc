"""One job's evaluation as the server runs it, after the job is taken.

An agent is resolved from the watched registry and must answer a ping before it is
used; the run goes under the job's own cancel scope, with its progress as job events.
Cancelled (now, or before any server took it: cancels are remembered here and in
``mlscope_cancels``), the evaluation is stored as ``cancelled`` (:mod:`broker.cancel`).
A restarted job first forgets what its lost attempt left (load-generator slices,
agent runs, spans and rows); a job whose evaluation is stored already gets that result.

:class:`JobEvaluation` is the part of :class:`broker.server.Server` that does this; the
server sets up what it declares (the bus, the database, the evaluator...) as it starts.
"""

from __future__ import annotations

import functools
import logging
import time

import anyio

from broker.cancel import Cancels, cancelled_rows, cancelled_summary, issued_part
from broker.db import Database
from broker.evalspec import specification
from broker.evaluate import Evaluator
from broker.ingest import TRACE_ACK_WAIT_S, Ingester
from broker.lgcontrol import stop_runs
from broker.loadgen import best_effort, running_p50_ms
from broker.resolve import RESOLVE_GRACE_S, recently_alive, resolve
from broker.run import RunsSoFar
from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.bus import Bus, bus_errors, if_found
from mlscope.catalog import Catalog, Entry
from mlscope.contracts import (
    AgentDescription,
    CancelRequest,
    EvaluationSummary,
    JobEvent,
    JobRequest,
    LoadgenStopOp,
    PingOp,
)
from mlscope.errors import BusError, MLScopeError, ResolutionError
from mlscope.loadgens import list_loadgens
from mlscope.model_registry import ManifestWatcher
from mlscope.record import RunRecord
from mlscope.registry import AgentCache, list_agents
from mlscope.serving import Boundary

__all__ = ["JobEvaluation"]

ATTEMPT_RELEASE_S = 20.0
"""How long a restarted job waits for each agent to stop what a lost attempt left
running there (an agent waits up to 15 s for a stopped run's final rows)."""
ATTEMPT_DRAIN_S = TRACE_ACK_WAIT_S + 5.0
"""How long a restarted job waits for the lost attempt's spans to be stored before
it deletes that attempt's rows: longer than the trace ack wait, since the batches the
lost server held unacknowledged come back only after it, whatever the job's own
(shorter) ack wait; usually the wait ends at once, with nothing pending."""
log = logging.getLogger("mlscope.server")


class JobEvaluation:
    """What a server needs to evaluate a job (set up by :meth:`broker.server.Server.run`)
    and how it does it."""

    server_id: str
    cancels: Cancels
    catalog: Catalog
    db: Database
    bus: Bus
    boundary: Boundary
    evaluator: Evaluator
    ingester: Ingester
    remote: ManifestWatcher
    agent_cache: AgentCache

    async def _remember_cancel(self, req: CancelRequest) -> None:
        """A cancel of a job not running here, for whichever server takes it later:
        this one remembers it, and the bus does (``mlscope_cancels``) for servers that
        start after the request. Every server hears it, so every one writes it."""
        try:
            kv = await self.bus.kv(names.CANCELS_BUCKET)
            with bus_errors("cannot remember a cancel"):
                await kv.put(names.token(req.job_id), req.reason.encode()[:1024])
        except BusError as exc:  # remembered here at least
            log.warning("job %s: cancel not written to the bus: %s", req.job_id, exc)

    async def _cancel_remembered(self, job_id: str) -> None:
        """Whether a cancel of ``job_id`` came before this server started."""
        if job_id in self.cancels.requested:
            return
        try:
            kv = await self.bus.kv(names.CANCELS_BUCKET)
            with bus_errors("cannot read the cancels"):
                entry = await if_found(kv.get(names.token(job_id)))
        except BusError as exc:  # a job runs rather than waits on the bus
            log.warning("job %s: cancels not read: %s", job_id, exc)
            return
        if entry is not None:
            self.cancels.request(job_id, (entry.value or b"cancelled").decode(errors="replace"))

    async def _evaluate_cancellable(self, job: JobRequest, subject: str) -> EvaluationSummary:
        """:meth:`_evaluate` under the job's own cancel scope; cancelled (now or before
        it was taken, by any server), its evaluation is stored as ``cancelled``."""
        started = time.time()
        await self._cancel_remembered(job.job_id)
        with self.cancels.running(job.job_id):
            return await self._evaluate(job, subject)
        runs, resolved = self.cancels.progress.get(job.job_id, (RunsSoFar(), None))
        live = runs.record
        rec = issued_part(live) if live is not None else None
        summary = cancelled_summary(
            job,
            resolved,
            reason=self.cancels.requested.get(job.job_id, "cancelled"),
            rec=rec,
            started_at=started,
            # Load generators of their own report a count; their rows are theirs.
            tallied=live.done if live is not None and live.n == 0 else 0,
        )
        # What it ran on, once resolved (a report names its system, a rerun its model).
        spec_doc = {
            **(
                specification(job, *resolved, {})
                if resolved is not None
                else {"job": job.model_dump(mode="json")}
            ),
            "cancelled": True,
        }
        # A sweep's or search's finished runs are stored already; the job's row last.
        rows = cancelled_rows(summary, runs, rec)
        with anyio.CancelScope(shield=True):
            for s, r in rows:
                await anyio.to_thread.run_sync(self.evaluator.store_unfinished, s, r, spec_doc)
        log.info("job %s: cancelled after %d queries; stored", job.job_id, summary.queries)
        return rows[-1][0]

    async def _evaluate(self, job: JobRequest, subject: str) -> EvaluationSummary:
        if job.mlperf_import is not None:  # logs made elsewhere: no agent to resolve
            return await self.evaluator.import_mlperf(job)
        # A resolved agent must answer before it is used: a SIGKILLed agent's registry
        # entry outlives it by up to the TTL, its subscriptions do not.
        gone: set[str] = set()
        while True:
            agent, entry = await self._resolve(job, gone)
            try:
                await busmod.request(
                    self.bus,
                    names.agent_ctl(agent.agent_id),
                    codec.encode_model(PingOp()),
                    timeout=2.0,
                )
                break
            except MLScopeError as exc:
                log.warning(
                    "job %s: agent %s does not answer (%s); resolving again",
                    job.job_id,
                    agent.agent_id,
                    exc.message,
                )
                gone.add(agent.agent_id)
        runs = RunsSoFar()
        self.cancels.progress[job.job_id] = (runs, (agent, entry))

        async def progress(eval_id: str, rec: RunRecord, elapsed: float) -> None:
            runs.record = rec
            await self._emit(
                subject,
                JobEvent(
                    job_id=job.job_id,
                    event="progress",
                    server_id=self.server_id,
                    evaluation_id=eval_id,
                    queries_done=rec.done,
                    elapsed_s=elapsed,
                    p50_ms=running_p50_ms(rec),
                ),
            )

        reported = best_effort(progress, f"job {job.job_id}")
        return await self.evaluator.run(job, agent, entry, reported, runs)

    async def _forget_attempt(self, eval_id: str) -> None:
        """Before a restarted job runs again: stop what the lost attempt left running
        on any load-generator service or agent (their slices, and a placement-agent or
        LoadGen run, go on without their server: their queries would reach the new
        attempt's agent and their spans land under the evaluation), let its spans on
        the trace stream be stored, then delete every row it left (its evaluation row
        was never stored, or the job would not run again)."""
        try:  # load generators first: their queries would reach a released agent
            services = await list_loadgens(self.bus)
            await stop_runs(self.bus, services, LoadgenStopOp(evaluation_id=eval_id))
        except MLScopeError as exc:
            log.warning(
                "evaluation %s: load generators not read; a slice may go on: %s", eval_id, exc
            )
        try:
            agents = await list_agents(self.bus)
        except MLScopeError as exc:
            log.warning("evaluation %s: agents not read; a lost run may go on: %s", eval_id, exc)
            agents = []
        async with anyio.create_task_group() as tg:  # a release answers once spans are out
            for a in agents:
                release = functools.partial(self.evaluator.release, timeout=ATTEMPT_RELEASE_S)
                tg.start_soon(release, a.agent_id, eval_id)
        if not await self.ingester.drained(ATTEMPT_DRAIN_S):
            log.warning("evaluation %s: traces not all stored; late spans may stay", eval_id)
        try:
            await anyio.to_thread.run_sync(self.evaluator.forget_attempt, eval_id)
        except MLScopeError as exc:  # the job runs all the same; the rows may mix
            log.error("evaluation %s: a lost attempt's rows not deleted: %s", eval_id, exc)

    async def _stored(self, eval_id: str) -> EvaluationSummary | None:
        rows = await anyio.to_thread.run_sync(
            self.db.rows,
            "SELECT summary FROM evaluations FINAL WHERE evaluation_id = {id:String}",
            {"id": eval_id},
        )
        return EvaluationSummary.model_validate_json(rows[0][0]) if rows else None

    async def _resolve(
        self, job: JobRequest, gone: set[str] | None = None
    ) -> tuple[AgentDescription, Entry]:
        """From the watched registry (no round trip); a miss is checked against a
        fresh read of the bucket, and waited out for up to ``RESOLVE_GRACE_S`` while a
        matching agent heartbeated moments ago (a failover delays heartbeats)."""
        catalog = self.remote.catalog(self.catalog)
        deadline = time.monotonic() + RESOLVE_GRACE_S
        gone = gone or set()

        def alive(agents: list[AgentDescription]) -> list[AgentDescription]:
            return [a for a in agents if a.agent_id not in gone]

        while True:
            if self.agent_cache.ready.is_set():
                try:
                    return resolve(job, alive(self.agent_cache.agents()), catalog)
                except ResolutionError:
                    pass
            try:
                return resolve(job, alive(await list_agents(self.bus)), catalog)
            except ResolutionError:
                seen = alive(self.agent_cache.agents(include_stale=True))
                if time.monotonic() >= deadline or not recently_alive(
                    job, seen, catalog, now=time.time()
                ):
                    raise
            await anyio.sleep(0.5)

    async def _emit(self, subject: str, event: JobEvent) -> None:
        try:
            await self.bus.nc.publish(subject, codec.encode_model(event))
        except Exception as exc:  # events are best effort; the job goes on
            self.boundary.failed(exc, subject, what="event on")
