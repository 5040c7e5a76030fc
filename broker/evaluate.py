"""One evaluation end to end: resolve, prepare the agent, drive load, summarize, store.

What happens before the clock starts (intake's size check, the agent's prepare) is in
:mod:`broker.evalprep`, the summaries in :mod:`broker.evalsummary`, the rows an
evaluation leaves in :mod:`broker.evalstore`. An agent that disappears mid-run does not
lose the run: the queries measured so far are stored in an INVALID evaluation whose
reason says after how many queries the agent was lost, and each query that never got
an answer is stored with the reason it was lost.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from broker import accuracy, agentrun, evalstore, scenario, scenarios
from broker.context import Context
from broker.db import Database
from broker.evalprep import Prepared, prepare_agent
from broker.evalspec import specification
from broker.evalsummary import (
    Summarizer,
    budget_warnings,
    host_warnings,
    parent_summary,
    release_agent,
    release_figures,
)
from broker.run import RunsSoFar
from mlscope import names, samples
from mlscope.bus import Bus
from mlscope.catalog import Entry
from mlscope.contracts import (
    AgentDescription,
    EvaluationSummary,
    JobRequest,
    evaluation_id_for,
)
from mlscope.errors import EvaluationError
from mlscope.record import RunRecord
from mlscope.settings import DEFAULT_LOADGEN_READY_S
from mlscope.tuning import ProcessTuning
from mlscope.validity import ValidityPolicy

__all__ = ["Evaluator"]

Progress = Callable[[str, RunRecord, float], Awaitable[None]]


@dataclass
class Evaluator:
    bus: Bus
    db: Database
    zoo_dir: Path
    tuning: ProcessTuning
    """The server's one owner of GC, switch interval and priority during runs."""
    policy: ValidityPolicy = field(default_factory=ValidityPolicy)
    loadgen_ready_s: float = DEFAULT_LOADGEN_READY_S
    """How long a job's load-generator processes have to start (``Settings``)."""

    host_lock: anyio.Lock = field(default_factory=anyio.Lock)
    """One measurement at a time: every run of this server shares its host (the load
    generator runs here), so jobs run one after another unless they opt out with
    ``parallel`` (and are marked so)."""
    import_lock: anyio.Lock = field(default_factory=anyio.Lock)
    """MLPerf imports one at a time on this server, each looking for its run before it
    stores it (:func:`broker.mlperf.import_logs`), so two imports of one run store it
    once; an import is a parse and a few inserts."""

    async def run(
        self,
        job: JobRequest,
        agent: AgentDescription,
        entry: Entry,
        progress: Progress,
        runs: RunsSoFar | None = None,
    ) -> EvaluationSummary:
        """Prepare the agent, drive the scenario, summarize and store (serialized with
        this server's other runs unless ``job.parallel``). ``runs``: where a sweep's or
        search's runs record how far they got; cancelled, the runs it finished are
        stored before the cancel goes on (the rest is the canceller's,
        :mod:`broker.cancel`)."""
        runs = runs if runs is not None else RunsSoFar()
        if job.parallel:
            return await self._run(job, agent, entry, progress, runs)
        async with self.host_lock:
            return await self._run(job, agent, entry, progress, runs)

    async def _run(
        self,
        job: JobRequest,
        agent: AgentDescription,
        entry: Entry,
        progress: Progress,
        runs: RunsSoFar,
    ) -> EvaluationSummary:
        if job.mlperf is not None:
            from broker import mlperf  # LoadGen runs in its own process

            return await mlperf.run(self, job, agent, entry)
        # Intake: a spec the scenario cannot use fails here, no agent prepared.
        scenarios.refuse(job.scenario, self.policy)
        released: dict[str, Any] | None = None
        try:
            p = await prepare_agent(self.bus, self.zoo_dir, job, agent, entry)
            started = time.time()
            # Cancelled, a sweep's or search's finished runs are stored as they are.
            try:
                outcome = await scenarios.execute(
                    self._context(job, agent, entry, p, progress, runs), job.scenario
                )
                lost = await self._agent_lost(agent, outcome.main.record)
                # A local run (placement agent) reports a lost agent in its own reasons.
                gone = bool(lost) or any(" lost after " in r for r in outcome.main.verdict.reasons)
                acc = (
                    None
                    if gone
                    else await self._accuracy(job, entry, p.data, p.eval_id, agent.agent_id)
                )
                finished = time.time()
                # An agent gone since then ended its session with it.
                released = {} if gone else await self.release(agent.agent_id, p.eval_id)
            except anyio.get_cancelled_exc_class():
                with anyio.CancelScope(shield=True):
                    await self._store_finished(job, agent, entry, p, runs, started)
                raise
        finally:
            if released is None:  # failed or cancelled on the way: its session ends too
                with anyio.CancelScope(shield=True):
                    await self.release(agent.agent_id, evaluation_id_for(job.job_id))
        summarize = Summarizer.of(job, agent, entry, p, outcome, (started, finished))
        summary = parent_summary(summarize, p.eval_id, outcome, lost)
        if acc is not None:
            m = entry.manifest
            metric = m.dataset.metric if m.dataset else "top1"
            summary = summary.model_copy(update={"accuracy": accuracy.metrics(acc, metric)})
        figures = release_figures(released, summary.samples)
        summary = summary.model_copy(
            update={
                **figures,
                "warnings": (
                    *summary.warnings,
                    *budget_warnings(released),
                    *host_warnings(figures, summary.loadgen_cost or {}),
                ),
            }
        )
        # Every row an evaluation has before its evaluation row, which goes last: a
        # server that finds that row takes the evaluation as stored whole. The runs are
        # over: a cancel heard now comes too late to stop them, and must not cut their
        # storing short (a sweep's runs stored in part under a cancelled parent).
        with anyio.CancelScope(shield=True):
            if acc is not None:
                await anyio.to_thread.run_sync(accuracy.store_outputs, self.db, p.eval_id, acc)
            await evalstore.store_runs(
                self.db,
                summarize,
                summary,
                outcome,
                specification(job, agent, entry, p.prep.dump()),
            )
        return summary

    def _context(
        self,
        job: JobRequest,
        agent: AgentDescription,
        entry: Entry,
        p: Prepared,
        progress: Progress,
        runs: RunsSoFar,
    ) -> Context:
        """What the job's scenario runs against: the prepared agent, its data, this
        server's bus and settings."""
        m, spec = entry.manifest, job.scenario
        shape = m.inputs[0].shape
        url = self.bus.nc.connected_url
        return Context(
            bus=self.bus,
            evaluation_id=p.eval_id,
            subject=names.agent_query(agent.agent_id),
            trace_level=p.level,
            offset_ns=p.offset,
            feeders=lambda b: samples.scored(samples.feeders(p.data, shape, b, spec.seed), m),
            policy=self.policy,
            tuning=self.tuning,
            on_progress=lambda rec, el: progress(p.eval_id, rec, el),
            nats_url=url.geturl() if url is not None else None,
            loadgen_ready_s=self.loadgen_ready_s,
            agent=agent,
            prepare=p.prepare,
            placement=job.placement,
            runs=runs,
        )

    async def _store_finished(
        self,
        job: JobRequest,
        agent: AgentDescription,
        entry: Entry,
        p: Prepared,
        runs: RunsSoFar,
        started: float,
    ) -> None:
        """The runs a cancelled sweep or search finished, each stored as a finished
        one's (:func:`broker.evalstore.store_separate`)."""
        if not runs.finished:
            return
        so_far = scenario.Outcome(runs.finished[0], list(runs.finished))
        summarize = Summarizer.of(job, agent, entry, p, so_far, (started, time.time()))
        spec_doc = specification(job, agent, entry, p.prep.dump())
        await evalstore.store_separate(self.db, summarize, runs.finished, spec_doc)

    async def _accuracy(
        self,
        job: JobRequest,
        entry: Entry,
        data: tuple[np.ndarray, np.ndarray] | None,
        eval_id: str,
        agent_id: str,
    ) -> accuracy.DatasetRun | None:
        """The data-set pass (outputs kept per sample) when the job asks for accuracy."""
        if not job.accuracy:
            return None
        if data is None:
            raise EvaluationError(
                f"{entry.manifest.name} has no labelled data set "
                "in its manifest: accuracy cannot be measured"
            )
        return await accuracy.dataset_pass(
            self.bus,
            subject=names.agent_query(agent_id),
            evaluation_id=eval_id,
            x=data[0],
            y=data[1],
            batch_size=job.scenario.batch_size,
            kind=accuracy.output_kind(entry.manifest),
            limit=job.accuracy_samples,
        )

    async def import_mlperf(self, job: JobRequest) -> EvaluationSummary:
        """Store the MLPerf logs a job carries as an evaluation (no agent involved)."""
        from broker import mlperf

        return await mlperf.import_logs(self, job)

    async def release(self, agent_id: str, eval_id: str, *, timeout: float = 5.0) -> dict[str, Any]:
        """End the agent's session of ``eval_id`` (a run it runs for it stopped, its
        spans published): its release reply (memory, energy), or {} when it does not
        answer within ``timeout`` seconds."""
        return await release_agent(self.bus, agent_id, eval_id, timeout=timeout)

    async def _agent_lost(self, agent: AgentDescription, rec: RunRecord) -> str:
        """ "agent <id> lost after N of M queries" when queries went unanswered and the
        agent that ran them is gone (:func:`broker.agentrun.gone`: silent, or restarted
        under its id); "" while it is there."""
        unanswered = int(np.count_nonzero(np.asarray(rec.completed[: rec.n]) == 0))
        if rec.n == 0 or not unanswered:
            return ""
        absence = await agentrun.gone(self.bus, agent)
        if not absence:
            return ""
        answered = int(np.count_nonzero(np.asarray(rec.ok[: rec.n])))
        lost = f"agent {agent.agent_id} lost after {answered} of {rec.n} queries"
        return f"{lost} (it restarted)" if absence == "restarted" else lost

    def store_unfinished(
        self, s: EvaluationSummary, rec: RunRecord | None, spec_doc: dict[str, Any]
    ) -> None:
        """Store a run that did not finish (a cancelled one): its summary and the rows
        of ``rec``, the queries it had issued."""
        self.store_evaluation(s, rec, spec_doc)

    def forget_attempt(self, eval_id: str) -> None:
        """Delete what an earlier, unfinished attempt of ``eval_id`` stored
        (:func:`broker.evalstore.forget_attempt`)."""
        evalstore.forget_attempt(self.db, eval_id)

    def store_evaluation(
        self, s: EvaluationSummary, rec: RunRecord | None, spec_doc: dict[str, Any]
    ) -> None:
        """Store ``s`` and the query rows of ``rec`` in this server's database
        (:func:`broker.evalstore.store_evaluation`; an MLPerf run stores through it)."""
        evalstore.store_evaluation(self.db, s, rec, spec_doc)
