"""The evaluations an agent is prepared for, and the control requests about them.

A server prepares an evaluation (its model loaded or reused, its meters started), may
ask for a run of its load here (placement agent), for MLPerf sample libraries and a
LoadGen run next to the model, and releases it when its job ends or is cancelled: its
queries still queued are then answered with an error, never run, its local run stops
and its samples, LoadGen process and meters are let go. A job restarted after its
server was lost prepares its evaluation again: what the lost server started for it
ends first. Failures are the serving boundary's (:class:`mlscope.serving.Boundary`).

An evaluation of several runs (a sweep's points, a search's trials: ``PrepareOp.runs``)
has its runs traced apart: a query (or a local run, ``RunOp.run_id``) names
``<evaluation_id>-<k>`` for ``k`` below ``runs``, its spans are kept under that id,
and the system samples follow the id the evaluation's latest query named (the
evaluation's own before its first run). Any other id is refused as an evaluation this
agent was not prepared for: an agent traces only what it was given.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup
from nats.aio.msg import Msg

import mlscope
from agent import profiling
from agent.energy import EnergyMeter
from agent.hostload import HostLoad
from agent.mlperf_ops import MLPerfOps
from agent.models import ModelHost
from agent.pipeline import Executor
from agent.runs import LocalRuns, Prepared
from agent.sysmon import RssWatch, Sampler
from agent.tracer import Tracer
from mlscope import names
from mlscope.bus import Bus
from mlscope.catalog import Entry
from mlscope.contracts import (
    ControlReply,
    MLPerfFetchOp,
    MLPerfRunOp,
    MLPerfStarted,
    PrepareOp,
    PrepareReply,
    ReleaseOp,
    ReleaseReply,
    RunOp,
    SamplesLoadOp,
    SamplesUnloadOp,
    TraceLevel,
    run_evaluation_id,
)
from mlscope.errors import EvaluationError
from mlscope.settings import Settings

__all__ = ["EvaluationOp", "Evaluations", "Session"]

now = time.perf_counter_ns

EvaluationOp = (
    PrepareOp | ReleaseOp | RunOp | SamplesLoadOp | SamplesUnloadOp | MLPerfRunOp | MLPerfFetchOp
)
"""The control requests about an evaluation (every one but ping and describe)."""


@dataclass
class Session:
    """An evaluation this agent was prepared for."""

    worker: Executor
    level: TraceLevel
    key: str = ""
    released: threading.Event = field(default_factory=threading.Event)
    """Set at release: the evaluation's queries still queued in the executor are
    answered with an error, never run (:attr:`agent.job.Job.released`)."""
    evaluation_id: str = ""
    ids: tuple[str, ...] = ()
    """Every id its queries may name: the evaluation's own, then its runs'
    (``<evaluation_id>-<k>``, ``k`` below ``PrepareOp.runs``, when more than one)."""
    sampled_as: str = ""
    """The id its system samples are kept under now (:meth:`Evaluations.follow`)."""


@dataclass(kw_only=True)
class Evaluations:
    """One agent's prepared evaluations, and its answers to the control requests about
    them. Made once the agent is on the bus: its runs go in the agent's task group."""

    agent_id: str
    settings: Settings
    models: ModelHost
    """The agent's models; their executors' settings are reported at prepare."""
    runs: LocalRuns
    mlperf: MLPerfOps
    rss: RssWatch
    energy: EnergyMeter
    host: HostLoad
    sampler: Sampler
    tracer: Tracer
    bus: Bus
    task_group: TaskGroup
    """Where local runs (placement agent) and LoadGen runs run."""
    git_commit: str | None
    sessions: dict[str, Session] = field(default_factory=dict)
    """The evaluations prepared here and not yet released, by evaluation id."""
    by_id: dict[str, Session] = field(default_factory=dict)
    """The same sessions by every id a query may name (:attr:`Session.ids`): one
    lookup per query, whether it names its evaluation or one of its runs."""

    async def handle(self, req: EvaluationOp, msg: Msg) -> ControlReply:
        """A control request about an evaluation (the serving boundary replies to
        failures)."""
        if isinstance(req, PrepareOp):
            return await self._prepare(req)
        if isinstance(req, RunOp):
            return await self._start_run(req, msg.reply)
        if isinstance(req, SamplesLoadOp):
            worker, entry = self.prepared(req.evaluation_id)
            return await self.mlperf.load(req, worker, entry)
        if isinstance(req, SamplesUnloadOp):
            return await self.mlperf.unload(req)
        if isinstance(req, MLPerfRunOp):
            return await self._start_mlperf(req)
        if isinstance(req, MLPerfFetchOp):
            return await anyio.to_thread.run_sync(self.mlperf.runner.fetch, req)
        return await self._release(req)

    async def _start_run(self, req: RunOp, reply: str) -> ControlReply:
        """A local run (placement agent) of a prepared evaluation, traced under its run
        id when it names one of the evaluation's runs (any other is refused)."""
        session = self.sessions.get(req.evaluation_id)
        trace_id = req.run_id or req.evaluation_id
        if session is not None and self.by_id.get(trace_id) is not session:
            raise EvaluationError(
                f"agent {self.agent_id}: {trace_id} is not a run of evaluation "
                f"{req.evaluation_id} (its runs: {_runs_text(session)})",
                evaluation_id=req.evaluation_id,
            )
        prepared = (
            None
            if session is None
            else Prepared(
                session.worker,
                session.level,
                self.models.entry(session.key),
                released=session.released,
                trace_id=trace_id,
            )
        )
        started = await self.runs.start(
            req, reply, prepared, bus=self.bus, tracer=self.tracer, tg=self.task_group
        )
        if session is not None:
            self.follow(session, trace_id)
        return started

    def follow(self, session: Session, trace_id: str) -> None:
        """Keep ``session``'s system samples under ``trace_id`` from now on (one of its
        :attr:`Session.ids`, which its latest query named): each run of a sweep has
        the samples taken while it ran. On the event loop, once per run."""
        session.sampled_as = trace_id
        if (
            session.level >= TraceLevel.SYSTEM
            and self.sessions.get(session.evaluation_id) is session
        ):
            self.sampler.watch(session.evaluation_id, self.tracer.samples(trace_id).add)

    def _open(self, eval_id: str, session: Session, runs: int) -> None:
        """Hold ``session`` for ``eval_id`` and its runs' ids (those of an earlier
        session of it let go); their span buffers are kept until its release."""
        self._close(eval_id)
        more = [run_evaluation_id(eval_id, k) for k in range(runs)] if runs > 1 else []
        session.evaluation_id, session.ids = eval_id, (eval_id, *more)
        session.sampled_as = eval_id
        self.sessions[eval_id] = session
        self.by_id.update(dict.fromkeys(session.ids, session))
        self.tracer.hold(eval_id)

    def _close(self, eval_id: str) -> Session | None:
        """Let go of ``eval_id``'s session and its runs' ids (None: there was none)."""
        session = self.sessions.pop(eval_id, None)
        if session is not None:
            for i in session.ids:
                if self.by_id.get(i) is session:
                    del self.by_id[i]
        return session

    def prepared(self, evaluation_id: str) -> tuple[Executor, Entry]:
        """The executor and model entry of a prepared evaluation (else a typed error)."""
        session = self.sessions.get(evaluation_id)
        if session is None:
            raise EvaluationError(
                f"agent {self.agent_id} was not prepared for evaluation {evaluation_id}",
                evaluation_id=evaluation_id,
            )
        return session.worker, self.models.entry(session.key)

    async def _release(self, req: ReleaseOp) -> ReleaseReply:
        """An evaluation is over: its local run stopped (its final rows still shipped),
        its samples, LoadGen process and meters let go."""
        session = self._close(req.evaluation_id)
        if session is not None:  # its queries still queued are not run
            session.released.set()
        await self._stop_runs(req.evaluation_id)
        await anyio.to_thread.run_sync(self.sampler.unwatch, req.evaluation_id)
        rss = await anyio.to_thread.run_sync(self.rss.stop, req.evaluation_id)
        energy_j = await anyio.to_thread.run_sync(self.energy.stop, req.evaluation_id)
        host = await anyio.to_thread.run_sync(self.host.stop, req.evaluation_id)
        if session is not None and session.level >= TraceLevel.FRAMEWORK:
            await anyio.to_thread.run_sync(  # layer spans a profiler held back
                profiling.flush, session.worker.model.predictor
            )
        # Every span of the evaluation (and of its runs) published before the answer:
        # a restarted job's server releases a lost attempt here, then deletes what
        # that attempt stored.
        await self.tracer.flush()
        self.tracer.let_go(req.evaluation_id)
        unloaded = False
        if session is not None and req.unload:
            unloaded = await self._unload(session.key)
        start, peak, end = rss or (None, None, None)
        return ReleaseReply(
            unloaded=unloaded,
            rss_start_bytes=start,
            rss_peak_bytes=peak,
            rss_end_bytes=end,
            energy_j=energy_j,
            span_batches_refused=self.tracer.refused.pop(req.evaluation_id, 0),
            host_other_cpu_s=None if host is None else host.other_cpu_s,
            host_steal_s=None if host is None else host.steal_s,
            host_window_s=None if host is None else host.window_s,
        )

    async def _stop_runs(self, evaluation_id: str) -> None:
        """Stop the evaluation's local run, once its final rows are shipped (so none
        reaches a run started after this), and its MLPerf run and sample libraries."""
        await self.runs.stop(evaluation_id)
        await self.mlperf.release(evaluation_id)

    async def _start_mlperf(self, req: MLPerfRunOp) -> MLPerfStarted:
        """LoadGen next to the model (placement agent): answered once it started; its
        end follows on :func:`mlscope.names.agent_rows` (a run may outlast the reply
        window a responder has under credentials)."""
        self.mlperf.require()
        _, entry = self.prepared(req.evaluation_id)
        graph = await anyio.to_thread.run_sync(self.models.check, entry)
        executor = self.models.executor
        return await self.mlperf.run(
            req,
            entry=entry,
            graph=graph,
            options=self.models.options(req.spec.batch_size),
            executor={
                "capacity": executor.capacity,
                "inflight_bytes": executor.inflight_bytes,
                "pre_workers": executor.pre_workers,
                "max_wait_us": executor.max_wait_us,
            },
            allow_custom=self.settings.allow_custom_code,
            publish=functools.partial(
                self.bus.nc.publish, names.agent_rows(self.agent_id, req.evaluation_id)
            ),
            tg=self.task_group,
        )

    async def _prepare(self, req: PrepareOp) -> PrepareReply:
        """Load (or reuse) the model for an evaluation; report load and first-run times."""
        eval_id = req.evaluation_id
        # A job restarted after its server was lost prepares its evaluation again here:
        # what the lost server started for it ends first.
        await self._stop_runs(eval_id)
        models = self.models
        entry = models.offer(req.model, req.model_version)
        # Verified again (a stat when unchanged): a file changed since it was advertised
        # is refused with both hashes and the command that rebuilds it.
        graph = await anyio.to_thread.run_sync(models.check, entry)
        key = entry.manifest.key
        batch = req.batch_size
        if req.reload:  # cold start: load again unless another evaluation uses it
            self._close(eval_id)
            await self._unload(key)
        cold = key not in models.workers
        load_ns = first_ns = 0
        if cold:
            load_ns, first_ns = await models.load(entry, graph, batch)
        worker = models.workers[key]
        worker.max_batch = req.max_batch or batch
        level = TraceLevel.parse(req.trace_level)
        self._open(eval_id, Session(worker, level, key), req.runs)
        if level >= TraceLevel.SYSTEM:  # system samples on the same timeline as the spans
            self.sampler.watch(eval_id, self.tracer.samples(eval_id).add)
        await anyio.to_thread.run_sync(self.rss.start, eval_id)
        await anyio.to_thread.run_sync(self.energy.start, eval_id, models.device)
        await anyio.to_thread.run_sync(self.host.start, eval_id)
        return PrepareReply(
            cold=cold,
            load_ns=load_ns,
            first_inference_ns=first_ns,
            sha256=entry.graph_sha256(self.settings.zoo_dir),
            t_agent=now(),
            settings={
                **models.loaded_settings.get(key, {}),
                "max_batch": worker.max_batch,
                "batch_wait_us": models.executor.max_wait_us,
                "queue_capacity": models.executor.capacity,
                "inflight_bytes": models.executor.inflight_bytes,
                "pre_workers": models.executor.pre_workers,
            },
            mlscope_version=mlscope.__version__,
            git_commit=self.git_commit,
        )

    async def _unload(self, key: str) -> bool:
        """Close a loaded model no prepared evaluation uses; True if it was."""
        return await self.models.unload(key, in_use={s.key for s in self.sessions.values()})


def _runs_text(session: Session) -> str:
    """The run ids a session takes, for an error (``<id>-0 .. <id>-N``, or none)."""
    runs = session.ids[1:]
    return f"{runs[0]} .. {runs[-1]}" if runs else "none: it makes one run"
