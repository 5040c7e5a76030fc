"""The agent service: one task group with heartbeat, query servers and span flusher.

Start-up order makes "advertised" mean "ready": models are verified and loadable,
subscriptions are live, and only then is the description put into the registry. The
description is fitted to one bus message (:func:`fit_description`); a put that still
fails is logged and retried by the heartbeat, never fatal: the models bucket is written
by others, and what it holds must not stop an agent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskStatus
from nats.aio.msg import Msg

import mlscope
from agent import profiling
from agent.energy import EnergyMeter
from agent.mlperf_ops import MLPerfOps, loadgen_installed
from agent.models import ModelHost
from agent.outbox import Outbox
from agent.pipeline import Executor, ExecutorConfig, Job
from agent.predictors import accelerators, probe
from agent.runs import LocalRuns, Prepared
from agent.samplelib import MemoryBudget
from agent.sysmon import RssWatch, Sampler, open_nvml
from agent.tracer import Tracer
from mlscope import bus as busmod
from mlscope import codec, names, provenance, sysinfo, wire
from mlscope.bus import Bus
from mlscope.catalog import Catalog, Entry
from mlscope.contracts import (
    CONTROL,
    LOCAL_RUN,
    MLPERF_LOADGEN,
    AgentDescription,
    ControlOp,
    ControlReply,
    DescribeOp,
    ErrorReply,
    MLPerfFetchOp,
    MLPerfRunOp,
    MLPerfStarted,
    ModelOffer,
    PingOp,
    PingReply,
    PrepareOp,
    PrepareReply,
    QueryReply,
    ReleaseOp,
    ReleaseReply,
    RunOp,
    SamplesLoadOp,
    SamplesQuery,
    SamplesUnloadOp,
    TraceLevel,
    new_id,
)
from mlscope.errors import (
    BusRefused,
    ConfigError,
    EvaluationError,
    FrameworkUnavailable,
    MLScopeError,
    OverloadedError,
)
from mlscope.model_registry import ManifestWatcher
from mlscope.presence import heartbeat
from mlscope.serving import Boundary
from mlscope.settings import Settings
from mlscope.tuning import ProcessTuning

__all__ = ["Agent", "AgentConfig", "fit_description"]

now = time.perf_counter_ns
log = logging.getLogger("mlscope.agent")
AGENT_SWITCH_INTERVAL_S = 0.0002


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    framework: str
    """Framework served by this agent (one agent per framework)."""
    agent_id: str | None = None
    device: str = "cpu"
    threads: int | None = None
    queue_capacity: int = 256
    """Queries waiting per loaded model before the agent answers 'overloaded'."""
    pre_workers: int = 2
    """Pre-processing threads per loaded model (they overlap with inference)."""
    batch_wait_us: int = 500
    """Dynamic batching: how long a partial batch waits for more queries."""
    heartbeat_s: float = busmod.HEARTBEAT_S
    sample_s: float = 0.1
    """System-sampler interval for evaluations traced at level ``system`` or more."""
    local_runs: bool = True
    """Run a scenario's load here when a job asks (``placement: agent``); advertised
    as the feature :data:`mlscope.contracts.LOCAL_RUN` (and, with MLPerf LoadGen
    installed, :data:`mlscope.contracts.MLPERF_LOADGEN`)."""
    sample_memory_bytes: int = 1 << 30
    """Memory the samples this agent holds for MLPerf runs may take, all together
    (a load beyond it is refused)."""


@dataclass
class Session:
    """An evaluation this agent was prepared for."""

    worker: Executor
    level: TraceLevel
    key: str = ""
    released: threading.Event = field(default_factory=threading.Event)
    """Set at release: the evaluation's queries still queued in the executor are
    answered with an error, never run (:attr:`agent.pipeline.Job.released`)."""


@dataclass
class Agent:
    settings: Settings
    config: AgentConfig
    catalog: Catalog
    agent_id: str = ""
    sessions: dict[str, Session] = field(default_factory=dict)
    capability_subs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rss = RssWatch()
        """Resident memory over each prepared evaluation (reported at release)."""
        self.energy = EnergyMeter(nvml=open_nvml() if self.config.device != "cpu" else None)
        """Energy counters of this agent's device, read at prepare and at release."""
        self.git_commit: str | None = None
        self._description: AgentDescription | None = None
        """What the last advertise stored in the registry (None: it was not stored)."""
        self.tuning = ProcessTuning()
        """This process's one owner of GC and switch interval during local runs."""
        host = str(sysinfo.host_facts()["host"])
        given = self.config.agent_id
        if given is not None and (not given or names.token(given) != given):
            raise ConfigError(
                f"agent id {given[:40]!r}: use letters, digits, '-' and '_', at most "
                f"{names.TOKEN_MAX_CHARS} characters (it names the agent's subjects)",
                field="agent_id",
            )
        self.agent_id = given or names.token(f"{host}-{self.config.framework}-{new_id('a')[2:8]}")
        self.models = ModelHost(
            settings=self.settings,
            framework=self.config.framework,
            who=f"agent {self.agent_id}",
            device=self.config.device,
            threads=self.config.threads,
            executor=ExecutorConfig(
                capacity=self.config.queue_capacity,
                pre_workers=self.config.pre_workers,
                max_wait_us=self.config.batch_wait_us,
            ),
            framework_manifest=self.catalog.framework(self.config.framework),
        )
        """What this agent offers, refuses and has loaded."""
        self.sample_memory = MemoryBudget(self.config.sample_memory_bytes)
        """What every sample library and every local run's held samples draw on."""
        self.mlperf = MLPerfOps(
            self.agent_id,
            self.settings.zoo_dir,
            self.sample_memory,
            runs_here=self.config.local_runs and loadgen_installed(),
        )
        """Sample libraries and LoadGen runs (``mlscope mlperf``)."""
        self.runs = LocalRuns(
            self.agent_id,
            self.config.local_runs,
            self.settings.zoo_dir,
            self.sample_memory,
            self.tuning,
        )
        """Each evaluation's local run (placement agent): releasing the evaluation (its
        job ended, or was cancelled) or preparing it again (its job restarted on another
        server) stops it."""

    # ------------------------------------------------------------------ lifecycle

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        info = probe(self.config.framework)
        if info is None:
            raise FrameworkUnavailable(
                f"framework {self.config.framework} does not load on this machine",
                framework=self.config.framework,
            )
        self.framework_info = info
        # Runtime options of the framework manifest (threads, providers...) for every
        # model this agent opens; an explicit --threads still wins (PredictorOptions).
        self.models.framework_manifest = self.catalog.framework(self.config.framework, info.version)
        self.models.runtime_version = info.version
        self._facts: dict[str, Any] = sysinfo.host_facts()
        self.git_commit = await anyio.to_thread.run_sync(provenance.git_commit)
        self.accelerators = accelerators(self.config.framework, info.devices)
        # Inference threads hand replies to the loop; a short GIL switch interval keeps
        # that hand-off from waiting out the default 5 ms.
        sys.setswitchinterval(AGENT_SWITCH_INTERVAL_S)
        async with busmod.connect(
            self.settings, name=f"agent {self.agent_id}", provision=True
        ) as bus:
            self.bus = bus
            self.boundary = Boundary(bus, service=f"agent {self.agent_id}", logger=log)
            self.loop = asyncio.get_running_loop()
            self.outbox = Outbox(
                self.loop,
                bus.nc.publish,
                lambda exc, subject: self.boundary.failed(exc, subject, what="reply to"),
                max_bytes=int(bus.nc.max_payload),
            )
            self.tracer = Tracer(bus, agent_id=self.agent_id, host=str(self._facts["host"]))
            self.sampler = Sampler(interval_s=self.config.sample_s)
            self.remote = ManifestWatcher(bus, on_change=self._models_changed)
            self._changing = anyio.Lock()
            subs: list[Any] = []
            try:
                async with anyio.create_task_group() as tg:
                    self.task_group = tg  # local runs (placement agent) run in it
                    keep = self.boundary.keep_running
                    await tg.start(keep, "models watch", self.remote.run)
                    await self._refresh_offers()
                    subs = await self._subscribe(bus)
                    tg.start_soon(keep, "span flusher", self.tracer.run)
                    await self._advertise(bus)
                    tg.start_soon(keep, "heartbeat", functools.partial(self._heartbeat, bus))
                    task_status.started()
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self.sampler.close)
                    await anyio.to_thread.run_sync(self.rss.close)
                    await self._withdraw(bus, [*subs, *self.capability_subs.values()])

    async def _subscribe(self, bus: Bus) -> list[Any]:
        subs = [
            await self.boundary.subscribe(names.agent_query(self.agent_id), bytes, self._on_query),
            await self.boundary.subscribe(names.agent_ctl(self.agent_id), CONTROL, self._on_ctl),
            await self.boundary.subscribe(
                names.agent_samples(self.agent_id), SamplesQuery, self._on_samples_query
            ),
        ]
        await self._sync_capabilities(bus)
        return subs

    async def _sync_capabilities(self, bus: Bus) -> None:
        """One queue-group subscription per served model, no more, no fewer."""
        offers = self.models.offers
        wanted = {names.capability(self.config.framework, e.manifest.name) for e, _ in offers}
        for subject in sorted(set(self.capability_subs) - wanted):
            await self.capability_subs.pop(subject).unsubscribe()
        for subject in sorted(wanted - set(self.capability_subs)):
            self.capability_subs[subject] = await self.boundary.subscribe(
                subject, bytes, self._on_query, queue=subject
            )
        await bus.nc.flush()

    async def _models_changed(self) -> None:
        """The models bucket changed: serve what is servable now and say so at once."""
        async with self._changing:
            if await self._refresh_offers():
                await self._sync_capabilities(self.bus)
                await self._advertise(self.bus)

    async def _refresh_offers(self) -> bool:
        """Fetch what is missing and decide again what is served; True if that changed."""
        catalog = self.remote.catalog(self.catalog)
        await self.models.fetch_missing(self.bus, catalog)
        served, refused = await anyio.to_thread.run_sync(self.models.servable, catalog)
        m = self.models
        if [(e.manifest.key, g) for e, g in served] == [
            (e.manifest.key, g) for e, g in m.offers
        ] and refused == m.refused:
            return False
        m.offers, m.refused = served, refused
        return True

    def describe(self) -> AgentDescription:
        f = self._facts
        info = self.framework_info
        offers = self.models.offers
        refused, refused_more = self.models.advertised_refusals()
        return AgentDescription(
            agent_id=self.agent_id,
            host=f["host"],
            arch=f["arch"],
            os=f["os"],
            cpu_model=f["cpu_model"],
            cpu_cores=f["cpu_cores"],
            memory_bytes=f["memory_bytes"],
            usable_cores=f.get("usable_cores"),
            memory_limit_bytes=f.get("memory_limit_bytes"),
            accelerators=self.accelerators,
            frameworks=(info,),
            models=tuple(
                ModelOffer(
                    name=e.manifest.name,
                    version=e.manifest.version,
                    framework=e.manifest.framework.name,
                    sha256=e.graph_sha256(self.settings.zoo_dir),
                )
                for e, _ in offers
            ),
            refused=refused,
            refused_more=refused_more,
            capabilities=tuple(
                sorted(
                    {names.capability(self.config.framework, e.manifest.name) for e, _ in offers}
                )
            ),
            pid=os.getpid(),
            mlscope_version=mlscope.__version__,
            started_at=time.time(),
            heartbeat_at=time.time(),
            heartbeat_s=self.config.heartbeat_s,
            features=tuple(
                f
                for f, on in (
                    (LOCAL_RUN, self.config.local_runs),
                    (MLPERF_LOADGEN, self.mlperf.runs_here),
                )
                if on
            ),
        )

    async def _advertise(self, bus: Bus) -> None:
        """Put this agent's description in the registry. A failure is logged, never
        raised: the agent goes on serving, and until an advertise is stored again each
        heartbeat describes the agent afresh (see :meth:`_heartbeat`)."""
        kv = await bus.kv(names.AGENTS_BUCKET)
        try:
            desc, payload = fit_description(self.describe(), bus.payload_budget())
            with busmod.bus_errors(f"cannot advertise agent {self.agent_id}"):
                await kv.put(self.agent_id, payload)
        except MLScopeError as exc:
            self._description = None
            log.error("agent %s: not advertised (the heartbeat retries): %s", self.agent_id, exc)
            return
        self._description = desc

    async def _heartbeat(self, bus: Bus) -> None:
        """Refresh the registry entry: the description last stored, with a new
        ``heartbeat_at``; a fresh one while the last advertise is not stored (a failed
        beat is logged by :func:`mlscope.presence.heartbeat` and tried again)."""
        kv = await bus.kv(names.AGENTS_BUCKET)
        budget = bus.payload_budget()

        def beat() -> bytes:
            if self._description is None:
                return fit_description(self.describe(), budget)[1]
            desc = self._description.model_copy(update={"heartbeat_at": time.time()})
            return codec.encode_model(desc)

        await heartbeat(
            kv,
            self.agent_id,
            beat,
            interval_s=self.config.heartbeat_s,
            who=f"agent {self.agent_id}",
        )

    async def _withdraw(self, bus: Bus, subs: list[Any]) -> None:
        """Leave the registry and stop the models. With the bus gone the entry expires
        by itself (its TTL), and the models are stopped all the same."""
        try:
            with anyio.move_on_after(3):
                kv = await bus.kv(names.AGENTS_BUCKET)
                await kv.delete(self.agent_id)
                for sub in subs:
                    await sub.unsubscribe()
        except Exception as exc:  # a lost or closed connection: the TTL removes the entry
            log.warning("agent %s: not withdrawn from the registry: %r", self.agent_id, exc)
        await self.models.stop_all()

    # ------------------------------------------------------------------ requests

    async def _on_ctl(self, req: ControlOp, msg: Msg) -> ControlReply:
        """Control requests (the serving boundary replies to failures)."""
        if isinstance(req, PingOp):
            return PingReply(t_agent=now())
        if isinstance(req, DescribeOp):
            return fit_description(self.describe(), self.bus.payload_budget())[0]
        if isinstance(req, PrepareOp):
            return await self._prepare(req)
        if isinstance(req, RunOp):
            session = self.sessions.get(req.evaluation_id)
            prepared = (
                None
                if session is None
                else Prepared(
                    session.worker,
                    session.level,
                    self.models.entry(session.key),
                    released=session.released,
                )
            )
            return await self.runs.start(
                req, msg.reply, prepared, bus=self.bus, tracer=self.tracer, tg=self.task_group
            )
        if isinstance(req, SamplesLoadOp):
            worker, entry = self._prepared(req.evaluation_id)
            return await self.mlperf.load(req, worker, entry)
        if isinstance(req, SamplesUnloadOp):
            return await self.mlperf.unload(req)
        if isinstance(req, MLPerfRunOp):
            return await self._start_mlperf(req)
        if isinstance(req, MLPerfFetchOp):
            return await anyio.to_thread.run_sync(self.mlperf.runner.fetch, req)
        return await self._release(req)

    async def _release(self, req: ReleaseOp) -> ReleaseReply:
        """An evaluation is over: its local run stopped (its final rows still shipped),
        its samples, LoadGen process and meters let go."""
        session = self.sessions.pop(req.evaluation_id, None)
        if session is not None:  # its queries still queued are not run
            session.released.set()
        await self._stop_runs(req.evaluation_id)
        await anyio.to_thread.run_sync(self.sampler.unwatch, req.evaluation_id)
        rss = await anyio.to_thread.run_sync(self.rss.stop, req.evaluation_id)
        energy_j = await anyio.to_thread.run_sync(self.energy.stop, req.evaluation_id)
        if session is not None and session.level >= TraceLevel.FRAMEWORK:
            await anyio.to_thread.run_sync(  # layer spans a profiler held back
                profiling.flush, session.worker.model.predictor
            )
        # Every span of the evaluation published before the answer: a restarted job's
        # server releases a lost attempt here, then deletes what that attempt stored.
        await self.tracer.flush()
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
        )

    async def _stop_runs(self, evaluation_id: str) -> None:
        """Stop the evaluation's local run, once its final rows are shipped (so none
        reaches a run started after this), and its MLPerf run and sample libraries."""
        await self.runs.stop(evaluation_id)
        await self.mlperf.release(evaluation_id)

    def _prepared(self, evaluation_id: str) -> tuple[Executor, Entry]:
        """The executor and model entry of a prepared evaluation (else a typed error)."""
        session = self.sessions.get(evaluation_id)
        if session is None:
            raise EvaluationError(
                f"agent {self.agent_id} was not prepared for evaluation {evaluation_id}",
                evaluation_id=evaluation_id,
            )
        return session.worker, self.models.entry(session.key)

    async def _start_mlperf(self, req: MLPerfRunOp) -> MLPerfStarted:
        """LoadGen next to the model (placement agent): answered once it started; its
        end follows on :func:`mlscope.names.agent_rows` (a run may outlast the reply
        window a responder has under credentials)."""
        self.mlperf.require()
        _, entry = self._prepared(req.evaluation_id)
        graph = await anyio.to_thread.run_sync(self.models.check, entry)
        return await self.mlperf.run(
            req,
            entry=entry,
            graph=graph,
            options=self.models.options(req.spec.batch_size),
            executor={
                "capacity": self.config.queue_capacity,
                "pre_workers": self.config.pre_workers,
                "max_wait_us": self.config.batch_wait_us,
            },
            allow_custom=self.settings.allow_custom_code,
            publish=functools.partial(
                self.bus.nc.publish, names.agent_rows(self.agent_id, req.evaluation_id)
            ),
            tg=self.task_group,
        )

    async def _on_samples_query(self, query: SamplesQuery, msg: Msg) -> ErrorReply | None:
        """A query naming held samples (MLPerf's SUT): run like any query; the reply
        comes from the predict thread."""
        received = now()
        worker, _ = self._prepared(query.evaluation_id)
        try:
            job = self.mlperf.job(query, received, self._replier(msg.reply))
        except MLScopeError as exc:  # the SUT completes the query's samples by its index
            wire = exc.to_wire()
            return ErrorReply(error={**wire, "fields": {**wire["fields"], "index": query.index}})
        if not worker.submit(job):
            busy = OverloadedError(f"agent {self.agent_id} is overloaded", index=query.index)
            return ErrorReply(error=busy.to_wire())
        return None

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
            self.sessions.pop(eval_id, None)
            await self._unload(key)
        cold = key not in models.workers
        load_ns = first_ns = 0
        if cold:
            load_ns, first_ns = await models.load(entry, graph, batch)
        worker = models.workers[key]
        worker.max_batch = req.max_batch or batch
        level = TraceLevel.parse(req.trace_level)
        self.sessions[eval_id] = Session(worker, level, key)
        if level >= TraceLevel.SYSTEM:  # system samples on the same timeline as the spans
            self.sampler.watch(eval_id, self.tracer.samples(eval_id).add)
        await anyio.to_thread.run_sync(self.rss.start, eval_id)
        await anyio.to_thread.run_sync(self.energy.start, eval_id, self.config.device)
        return PrepareReply(
            cold=cold,
            load_ns=load_ns,
            first_inference_ns=first_ns,
            sha256=entry.graph_sha256(self.settings.zoo_dir),
            t_agent=now(),
            settings={
                **models.loaded_settings.get(key, {}),
                "max_batch": worker.max_batch,
                "batch_wait_us": self.config.batch_wait_us,
                "queue_capacity": self.config.queue_capacity,
                "pre_workers": self.config.pre_workers,
            },
            mlscope_version=mlscope.__version__,
            git_commit=self.git_commit,
        )

    async def _unload(self, key: str) -> bool:
        """Close a loaded model no prepared evaluation uses; True if it was."""
        return await self.models.unload(key, in_use={s.key for s in self.sessions.values()})

    async def _on_query(self, data: bytes, msg: Msg) -> ErrorReply | None:
        """Admit one query (decoded here, after its arrival is stamped); the reply
        comes from the predict thread, or from this one when the executor runs the
        query inline (an idle pipeline and a fast model: no thread hop at all).
        Failures are the serving boundary's."""
        received = now()
        query = wire.decode_query(data)  # a structural check: no pydantic per query
        session = self.sessions.get(query.evaluation_id)
        if session is None:
            raise EvaluationError(  # its index: the load generator fails that query
                f"agent {self.agent_id} was not prepared for evaluation {query.evaluation_id}",
                evaluation_id=query.evaluation_id,
                index=query.index,
            )
        level = TraceLevel(min(query.trace_level, session.level))
        spans = self.tracer.buffer(query.evaluation_id) if level > TraceLevel.NONE else None
        job = Job(
            index=query.index,
            inputs=query.inputs,
            received_ns=received,
            level=level,
            spans=spans,
            reply=self._replier(msg.reply),
            raw=query.raw,
            labels=query.labels,
            more=query.more_inputs,
            released=session.released,
        )
        worker = session.worker
        if worker.try_inline(job):
            await self.outbox.flush()
            return None
        if not worker.submit(job):
            busy = OverloadedError(f"agent {self.agent_id} is overloaded", index=query.index)
            return ErrorReply(error=busy.to_wire())
        return None

    def _replier(self, subject: str) -> Any:
        put = self.outbox.put

        def send(reply: QueryReply) -> None:  # on the predict thread
            put(subject, wire.encode_reply(reply))

        return send


def fit_description(desc: AgentDescription, max_bytes: int) -> tuple[AgentDescription, bytes]:
    """``desc`` and its encoding, at most ``max_bytes`` long: refusals are dropped (the
    later half each time, counted in ``refused_more``) until it fits. BusRefused when
    it does not fit even without them: a put over the bus's max payload is refused, and
    an agent whose entry is never stored is invisible while it runs."""
    payload = codec.encode_model(desc)
    while len(payload) > max_bytes and desc.refused:
        keep = len(desc.refused) // 2
        desc = desc.model_copy(
            update={
                "refused": desc.refused[:keep],
                "refused_more": desc.refused_more + len(desc.refused) - keep,
            }
        )
        payload = codec.encode_model(desc)
    if len(payload) > max_bytes:
        raise BusRefused(
            f"agent {desc.agent_id}'s description of its {len(desc.models)} models is "
            f"{len(payload)} bytes, over the {max_bytes} a registry entry may take",
            agent_id=desc.agent_id,
            bytes=len(payload),
            max_bytes=max_bytes,
        )
    return desc, payload
