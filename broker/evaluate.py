"""One evaluation end to end: resolve, prepare the agent, drive load, summarize, store.

Intake refuses, before anything runs, a job whose one query would not fit through the
bus (its encoded size against the connection's max payload, for every batch size the
job uses). The evaluation id is derived from the job (one evaluation per job). An agent
that disappears mid-run does not lose the run: the queries measured so far are stored
in an INVALID evaluation whose reason says after how many queries the agent was lost,
and each query that never got an answer is stored with the reason it was lost.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from broker import accuracy, agentrun, scenario, scenarios
from broker.context import Context
from broker.db import EVALUATION_COLUMNS, QUERY_COLUMNS, Database
from broker.evalspec import specification
from broker.loadgen import estimate_offset
from broker.summary import LoadgenCost, stream_warnings, tracing_warnings
from mlscope import codec, names, samples, schema
from mlscope.bus import PAYLOAD_HEADROOM, Bus, request, request_model
from mlscope.catalog import Entry
from mlscope.contracts import (
    AgentDescription,
    EvaluationSummary,
    JobRequest,
    PrepareOp,
    PrepareReply,
    Query,
    ReleaseOp,
    TraceLevel,
    evaluation_id_for,
)
from mlscope.errors import ConfigError, EvaluationError, MLScopeError
from mlscope.outcomes import Outcome
from mlscope.record import RunRecord
from mlscope.samples import dataset
from mlscope.tuning import ProcessTuning
from mlscope.validity import ValidityPolicy

__all__ = ["Evaluator"]

PREPARE_TIMEOUT_S = 300.0
ATTEMPT_TABLES = tuple(
    t.name
    for t in (
        schema.QUERIES,
        schema.SPANS,
        schema.SYSTEM_SAMPLES,
        schema.OUTPUTS,
        schema.MLPERF_LOGS,
        schema.EVALUATIONS,
    )
)
"""Every table that holds an evaluation's rows under its id."""
LOST = "lost in transit: no reply before the run ended"
"""Synthetic rows a model without a data set cycles through."""
Progress = Callable[[str, RunRecord, float], Awaitable[None]]


@dataclass
class Evaluator:
    bus: Bus
    db: Database
    zoo_dir: Path
    tuning: ProcessTuning
    """The server's one owner of GC, switch interval and priority during runs."""
    policy: ValidityPolicy = field(default_factory=ValidityPolicy)

    host_lock: anyio.Lock = field(default_factory=anyio.Lock)
    """One measurement at a time: every run of this server shares its host (the load
    generator runs here), so jobs run one after another unless they opt out with
    ``parallel`` (and are marked so)."""

    async def run(
        self, job: JobRequest, agent: AgentDescription, entry: Entry, progress: Progress
    ) -> EvaluationSummary:
        """Prepare the agent, drive the scenario, summarize and store (serialized with
        this server's other runs unless ``job.parallel``)."""
        if job.parallel:
            return await self._run(job, agent, entry, progress)
        async with self.host_lock:
            return await self._run(job, agent, entry, progress)

    async def _run(
        self, job: JobRequest, agent: AgentDescription, entry: Entry, progress: Progress
    ) -> EvaluationSummary:
        if job.mlperf is not None:
            from broker import mlperf  # LoadGen runs in its own process

            return await mlperf.run(self, job, agent, entry)
        # Intake: a spec the scenario cannot use fails here, no agent prepared.
        scenarios.refuse(job.scenario, self.policy)
        released: dict[str, Any] | None = None
        try:
            p = await self._prepare_run(job, agent, entry)
            started = time.time()
            outcome = await scenarios.execute(
                self._context(job, agent, entry, p, progress), job.scenario
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
        finally:
            if released is None:  # failed or cancelled on the way: its session ends too
                with anyio.CancelScope(shield=True):
                    await self.release(agent.agent_id, evaluation_id_for(job.job_id))
        summarize = self._summarizer(job, agent, entry, p, outcome, (started, finished))
        summary = self._parent_summary(summarize, p.eval_id, outcome, lost)
        if acc is not None:
            m = entry.manifest
            metric = m.dataset.metric if m.dataset else "top1"
            summary = summary.model_copy(update={"accuracy": accuracy.metrics(acc, metric)})
        summary = summary.model_copy(update=memory_figures(released, summary.samples))
        # Every row an evaluation has before its evaluation row, which goes last: a
        # server that finds that row takes the evaluation as stored whole.
        if acc is not None:
            await anyio.to_thread.run_sync(accuracy.store_outputs, self.db, p.eval_id, acc)
        await self._store_runs(
            summarize, summary, outcome, specification(job, agent, entry, p.prep.dump())
        )
        return summary

    async def _prepare_run(
        self, job: JobRequest, agent: AgentDescription, entry: Entry
    ) -> _Prepared:
        """Intake's size check, the agent's prepare and its clock offset."""
        eval_id = evaluation_id_for(job.job_id)
        m, spec = entry.manifest, job.scenario
        level = TraceLevel.parse(job.trace_level)
        # Off the event loop: a data set is read from disk, and a query may be encoded.
        data = await anyio.to_thread.run_sync(dataset, entry, self.zoo_dir)
        if job.placement == "server" or job.accuracy:  # only these send queries over the bus
            await anyio.to_thread.run_sync(
                check_query_size, data, m.inputs[0].shape, spec, int(self.bus.nc.max_payload)
            )
        prepare = PrepareOp(
            evaluation_id=eval_id,
            model=m.name,
            model_version=m.version,
            batch_size=spec.batch_size,
            trace_level=level.name.lower(),
        ).dump()
        prep = await request_model(
            self.bus,
            names.agent_ctl(agent.agent_id),
            codec.encode(prepare),
            PrepareReply,
            timeout=PREPARE_TIMEOUT_S,
        )
        offset, rtt = await estimate_offset(self.bus, agent.agent_id)
        return _Prepared(eval_id, level, data, prepare, prep, offset, rtt)

    def _context(
        self,
        job: JobRequest,
        agent: AgentDescription,
        entry: Entry,
        p: _Prepared,
        progress: Progress,
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
            agent=agent,
            prepare=p.prepare,
            placement=job.placement,
        )

    def _summarizer(
        self,
        job: JobRequest,
        agent: AgentDescription,
        entry: Entry,
        p: _Prepared,
        outcome: scenario.Outcome,
        span: tuple[float, float],
    ) -> _Summarizer:
        """What turns each run of this job into a summary."""
        fw = next(x for x in agent.frameworks if x.name == job.framework)
        cost = (
            LoadgenCost(agent_host=agent.host, loadgens=job.scenario.loadgens)
            if job.placement == "server"
            else LoadgenCost(agent_host=agent.host, host=agent.host, cores=agent.cpu_cores)
        )
        prep = p.prep
        return _Summarizer(
            job=job,
            manifest=entry.manifest,
            framework=fw,
            agent=agent,
            level=p.level.name.lower(),
            cost=cost,
            offset_ns=p.offset,
            rtt_ns=p.rtt,
            cold_start=outcome.cold_start
            or {
                "load_ms": prep.load_ns / 1e6,
                "first_inference_ms": prep.first_inference_ns / 1e6,
                "cold": prep.cold,
            },
            started=span[0],
            finished=span[1],
        )

    @staticmethod
    def _parent_summary(
        summarize: _Summarizer,
        eval_id: str,
        outcome: scenario.Outcome,
        lost: str,
    ) -> EvaluationSummary:
        """The job's summary: its main run's, with what a sweep or search found."""
        # A sweep or search of one run is that run: it is stored once, as the parent.
        # Of several, each run is stored on its own and the parent holds only the
        # summary (its figures those of the best run, and no query rows). Either way
        # its scenario is the main run's (the batch size or rate its figures and rows
        # come from; the sweep's list stays in it), and the job's own spec is in the
        # stored specification.
        separate = len(outcome.points) > 1
        points = [
            r.point() if separate else {**r.point(), "evaluation_id": eval_id}
            for r in outcome.points
        ]
        return summarize(
            outcome.main,
            (*outcome.extra_reasons, *([lost] if lost else [])),
            peak_qps=outcome.peak_qps,
            optimal_batch_size=outcome.optimal_batch_size,
            points=tuple(points),
        ).model_copy(update={"evaluation_id": eval_id})

    async def _store_runs(
        self,
        summarize: _Summarizer,
        summary: EvaluationSummary,
        outcome: scenario.Outcome,
        spec_doc: dict[str, Any],
    ) -> None:
        """Each run of a sweep or search on its own, then the parent (with the query
        rows of a single run)."""
        separate = outcome.points if len(outcome.points) > 1 else []
        for run in separate:
            await anyio.to_thread.run_sync(
                self.store_evaluation, summarize(run), run.record, spec_doc
            )
        # The parent's t0 is its first run's: the runs' spans are stored under its id.
        main = outcome.main
        t0 = separate[0].record.t0_ns if separate else main.record.t0_ns
        await anyio.to_thread.run_sync(
            functools.partial(
                self.store_evaluation,
                summary,
                None if separate else main.record,
                spec_doc,
                t0_ns=t0,
            )
        )

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
        with anyio.move_on_after(timeout), contextlib.suppress(MLScopeError):
            reply: dict[str, Any] = await request(
                self.bus,
                names.agent_ctl(agent_id),
                codec.encode_model(ReleaseOp(evaluation_id=eval_id)),
                timeout=timeout,
            )
            return reply
        return {}

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
        """Delete what an earlier, unfinished attempt of ``eval_id`` stored (its job
        was redelivered after the server running it was lost): its query rows, spans,
        samples, outputs and logs, and the stored runs of its sweep or search
        (``<eval_id>-<k>``). A run stores rows by query index, so the indices the new
        attempt does not reach would otherwise keep the lost attempt's rows."""
        present = {
            str(r[0])
            for r in self.db.rows(  # some are made by their first row (MLPerf's logs)
                "SELECT name FROM system.tables WHERE database = currentDatabase() "
                "AND name IN {t:Array(String)}",
                {"t": list(ATTEMPT_TABLES)},
            )
        }
        for table in (t for t in ATTEMPT_TABLES if t in present):
            self.db.command(
                f"DELETE FROM {table} WHERE evaluation_id = {{e:String}} "
                "OR startsWith(evaluation_id, {p:String})",
                {"e": eval_id, "p": f"{eval_id}-"},
            )

    def store_evaluation(
        self,
        s: EvaluationSummary,
        rec: RunRecord | None,
        spec_doc: dict[str, Any],
        *,
        t0_ns: int | None = None,
    ) -> None:
        """The evaluation row, and its query rows when ``rec`` is given (a sweep's
        parent has none: its runs are stored on their own; ``t0_ns`` is then its
        first run's). A lost query's error names the lost agent when it was. The
        query rows go first: a stored evaluation row means its evaluation is whole."""
        if rec is not None and rec.n:
            outcomes = rec.outcomes()
            lost = next(
                (r for r in s.invalid_reasons if r.startswith("agent ") and " lost after " in r), ""
            )
            why = f"lost: {lost}" if lost else LOST
            err = [
                rec.errors.get(i) or (why if outcomes[i] == Outcome.LOST else "")
                for i in range(rec.n)
            ]
            cols: list[Any] = [
                [s.evaluation_id] * rec.n,
                np.arange(rec.n, dtype=np.uint32),
                [rec.batch_size] * rec.n,
                rec.scheduled,
                rec.issued,
                rec.completed,
                rec.agent_received,
                rec.predict_start,
                rec.predict_end,
                rec.agent_replied,
                rec.ok,
                err,
                rec.correct,
                rec.prediction,
                rec.outcomes(),
                (~rec.measured()).astype(np.uint8),
                rec.paced,
            ]
            self.db.insert("queries", [list(c) for c in cols], QUERY_COLUMNS)
        row = [
            s.evaluation_id,
            s.job_id,
            spec_doc["job"].get("rerun_of") or "",
            datetime.fromtimestamp(s.started_at, UTC),
            s.model["name"],
            s.model["version"],
            s.framework["name"],
            s.framework["version"],
            s.agent_id,
            s.host,
            s.device,
            str(s.scenario["name"]),
            s.trace_level,
            s.status,
            int(s.valid),
            t0_ns if t0_ns is not None else rec.t0_ns if rec else 0,
            s.clock_offset_ns,
            json.dumps(spec_doc, default=str),
            s.model_dump_json(by_alias=True),
        ]
        self.db.insert("evaluations", [[v] for v in row], EVALUATION_COLUMNS)


@dataclass(frozen=True)
class _Prepared:
    """An evaluation's agent, prepared: what its runs and summaries need of it."""

    eval_id: str
    level: TraceLevel
    data: tuple[np.ndarray, np.ndarray] | None
    """The model's data set (inputs, labels), None for synthetic inputs."""
    prepare: dict[str, Any]
    prep: PrepareReply
    """The agent's prepare reply."""
    offset: int
    rtt: int


@dataclass(frozen=True, kw_only=True)
class _Summarizer:
    """What every run of one evaluation shares in its summary (a sweep's runs and
    their parent alike)."""

    job: JobRequest
    manifest: Any
    framework: Any
    agent: AgentDescription
    level: str
    cost: LoadgenCost
    offset_ns: int
    rtt_ns: int
    cold_start: dict[str, Any]
    started: float
    finished: float

    def __call__(
        self, run: scenario.Run, reasons: tuple[str, ...] = (), **extra: Any
    ) -> EvaluationSummary:
        """The summary of ``run`` (``reasons``: more than its verdict's; ``extra``:
        fields a sweep's or search's parent adds)."""
        job, m, fw, agent = self.job, self.manifest, self.framework, self.agent
        cost = self.cost.served_by(run.record.sources)
        f, why = run.figures, (*run.verdict.reasons, *reasons)
        return EvaluationSummary(
            evaluation_id=run.evaluation_id,
            job_id=job.job_id,
            status="completed",
            valid=not why,
            invalid_reasons=why,
            model={"name": m.name, "version": m.version},
            framework={"name": fw.name, "version": fw.version},
            agent_id=agent.agent_id,
            host=agent.host,
            device=job.device,
            scenario=run.spec.model_dump(),
            trace_level=self.level,
            queries=f.queries,
            samples=f.samples,
            errors=f.errors,
            not_issued=f.not_issued,
            failed=f.outcomes["failed"],
            refused=f.outcomes["refused"],
            lost=f.outcomes["lost"],
            warmup_queries=f.warmup_queries,
            duration_s=f.duration_s,
            requested_qps=run.requested_qps,
            scheduled_qps=f.scheduled_qps,
            achieved_qps=f.achieved_qps,
            completed_qps=f.completed_qps,
            backlog_s=f.backlog_s,
            issue_lag_split_us=f.issue_lag_split_us,
            loadgen_cost={
                **cost.facts(f),
                **({"services": list(run.record.sources)} if run.record.sources else {}),
            },
            parallel=job.parallel,
            warnings=(
                *cost.warnings(f, parallel=job.parallel),
                *tracing_warnings(self.level),
                *stream_warnings(run.record),
            ),
            latency_ms=f.latency_ms,
            issue_lag_us=f.issue_lag_us,
            throughput_ips=f.throughput_ips,
            accuracy=({"top1": f.top1} if f.top1 is not None else None),
            clock_offset_ns=self.offset_ns,
            clock_rtt_ns=self.rtt_ns,
            cold_start=self.cold_start,
            latency_split_ms=run.split,
            loadgens=run.spec.loadgens,
            placement=job.placement,
            preprocess="ahead" if run.record.preprocessed else "timed",
            started_at=self.started,
            finished_at=self.finished,
            **extra,
        )


def check_query_size(
    data: tuple[np.ndarray, np.ndarray] | None, shape: tuple[int, ...], spec: Any, max_payload: int
) -> None:
    """Refuse a job whose query of its largest batch size is over the bus's max payload,
    naming the largest batch size that fits. A query whose raw inputs alone are over it
    is refused by arithmetic (a manifest's shape must not make the server build what it
    is about to refuse); one that may fit is measured on a real encoded query."""
    sizes = sorted({spec.batch_size, *(spec.batch_sizes or ())})
    limit = max_payload - PAYLOAD_HEADROOM
    row_bytes = (
        data[0][0].nbytes
        if data is not None and len(data[0])
        else math.prod(shape) * np.dtype(np.float32).itemsize
    )
    if sizes[-1] * row_bytes > limit:
        biggest, per_sample, at_least = sizes[-1] * row_bytes, row_bytes, "at least "
    else:

        def size(batch: int) -> int:
            inputs = samples.feeders(data, shape, batch, spec.seed)[0](0)
            query = Query(evaluation_id="ev-000000000000", index=0, inputs=inputs)
            return len(codec.encode_model(query))

        biggest, at_least = size(sizes[-1]), ""
        if biggest <= limit:
            return
        per_sample = size(1)
    fits = max(0, limit // max(1, per_sample))
    raise ConfigError(
        f"a query of batch size {sizes[-1]} is {at_least}{biggest} bytes, over the bus's max "
        f"payload of {max_payload} bytes; the largest batch size that fits is about {fits}",
        field="batch_size",
        batch_size=sizes[-1],
        bytes=biggest,
        max_payload=max_payload,
    )


def memory_figures(released: dict[str, Any], samples: int) -> dict[str, float | None]:
    """``peak_rss_mb`` and ``rss_growth_mb`` (MB = 10⁶ bytes), ``energy_j`` and
    ``energy_per_inference_j`` from the agent's release reply; None where the agent did
    not report them (no readable counter, an older agent, a lost one)."""
    start, peak, end = (released.get(f"rss_{k}_bytes") for k in ("start", "peak", "end"))
    energy = released.get("energy_j")
    return {
        "peak_rss_mb": peak / 1e6 if peak is not None else None,
        "rss_growth_mb": (end - start) / 1e6 if start is not None and end is not None else None,
        "energy_j": energy,
        "energy_per_inference_j": energy / samples if energy is not None and samples else None,
    }
