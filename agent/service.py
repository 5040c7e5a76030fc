"""The agent service: one task group with heartbeat, query servers and span flusher.

Start-up order makes "advertised" mean "ready": models are verified and loadable,
subscriptions are live, and only then is the description put into the registry
(:mod:`agent.registration`: a put that fails is retried by the heartbeat, never fatal).
Control requests about the agent itself are answered here, those about an evaluation
by :mod:`agent.evaluations`; queries by :mod:`agent.queries`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus
from nats.aio.msg import Msg

import mlscope
from agent.energy import EnergyMeter
from agent.evaluations import Evaluations
from agent.hostload import HostLoad
from agent.mlperf_ops import MLPerfOps, loadgen_installed
from agent.models import ModelHost
from agent.outbox import Outbox
from agent.pipeline import ExecutorConfig
from agent.predictors import accelerators, probe, unusable_device
from agent.queries import Queries
from agent.registration import Registration, fit_description
from agent.runs import LocalRuns
from agent.samplelib import MemoryBudget
from agent.sysmon import RssWatch, Sampler, open_nvml
from agent.tracer import Tracer
from mlscope import bus as busmod
from mlscope import names, provenance, scratch, sysinfo
from mlscope.agentauth import bound_id
from mlscope.bus import Bus
from mlscope.catalog import Catalog
from mlscope.contracts import (
    CONTROL,
    LOCAL_RUN,
    MLPERF_LOADGEN,
    AgentDescription,
    ControlOp,
    ControlReply,
    DescribeOp,
    ModelOffer,
    PingOp,
    PingReply,
    SamplesQuery,
    new_id,
)
from mlscope.errors import ConfigError, FrameworkUnavailable
from mlscope.model_registry import ManifestWatcher
from mlscope.provision import provisioned
from mlscope.serving import Boundary
from mlscope.settings import Settings
from mlscope.tuning import ProcessTuning

__all__ = ["Agent", "AgentConfig"]

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
    inflight_memory_bytes: int = 1 << 30
    """Bytes of inputs the queries waiting per loaded model may hold before the agent
    answers 'overloaded' (:attr:`agent.pipeline.ExecutorConfig.inflight_bytes`)."""
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
class Agent:
    settings: Settings
    config: AgentConfig
    catalog: Catalog
    agent_id: str = ""
    capability_subs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rss = RssWatch()
        """Resident memory over each prepared evaluation (reported at release)."""
        self.energy = EnergyMeter(nvml=open_nvml() if self.config.device != "cpu" else None)
        """Energy counters of this agent's device, read at prepare and at release."""
        self.git_commit: str | None = None
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
        creds = self.settings.nats_creds
        own = bound_id(creds, "agent") if creds is not None else None
        if own is not None and given not in (None, own):
            raise ConfigError(
                f"{creds} are agent {own!r}'s own credentials (`mlscope auth add-agent "
                f"{own}`): run it as `--agent-id {own}`, not {given!r}",
                field="agent_id",
            )
        self.agent_id = (
            given or own or names.token(f"{host}-{self.config.framework}-{new_id('a')[2:8]}")
        )
        self.registration = Registration(
            self.agent_id, self.describe, heartbeat_s=self.config.heartbeat_s
        )
        """This agent's entry in the registry."""
        self.models = ModelHost(
            settings=self.settings,
            framework=self.config.framework,
            who=f"agent {self.agent_id}",
            device=self.config.device,
            threads=self.config.threads,
            executor=ExecutorConfig(
                capacity=self.config.queue_capacity,
                inflight_bytes=self.config.inflight_memory_bytes,
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
        if (problem := unusable_device(self.config.device, info)) is not None:
            raise FrameworkUnavailable(problem, framework=self.config.framework)
        self.framework_info = info
        # Runtime options of the framework manifest (threads, providers...) for every
        # model this agent opens; an explicit --threads still wins (PredictorOptions).
        self.models.framework_manifest = self.catalog.framework(self.config.framework, info.version)
        self.models.runtime_version = info.version
        self._facts: dict[str, Any] = sysinfo.host_facts()
        self.git_commit = await anyio.to_thread.run_sync(provenance.git_commit)
        await anyio.to_thread.run_sync(scratch.sweep)  # what killed processes left
        self.accelerators = accelerators(self.config.framework, info.devices)
        # Inference threads hand replies to the loop; a short GIL switch interval keeps
        # that hand-off from waiting out the default 5 ms.
        sys.setswitchinterval(AGENT_SWITCH_INTERVAL_S)
        async with provisioned(self.settings, name=f"agent {self.agent_id}") as bus:
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
                    self._make_handlers(bus, tg)
                    keep = self.boundary.keep_running
                    await tg.start(keep, "models watch", self.remote.run)
                    await self._refresh_offers()
                    subs = await self._subscribe(bus)
                    tg.start_soon(keep, "span flusher", self.tracer.run)
                    await self.registration.advertise(bus)
                    tg.start_soon(
                        keep, "heartbeat", functools.partial(self.registration.heartbeat, bus)
                    )
                    log.info(
                        "agent %s ready: %s %s on %s, %d model(s) served, %d refused",
                        self.agent_id,
                        self.config.framework,
                        self.framework_info.version,
                        self.config.device,
                        len(self.models.offers),
                        len(self.models.refused),
                    )
                    task_status.started()
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self.sampler.close)
                    await anyio.to_thread.run_sync(self.rss.close)
                    await self._withdraw(bus, [*subs, *self.capability_subs.values()])

    def _make_handlers(self, bus: Bus, tg: TaskGroup) -> None:
        """What answers control requests about evaluations, and queries: made before
        anything is subscribed; local runs (placement agent) and LoadGen runs run in
        ``tg``."""
        self.evaluations = Evaluations(
            agent_id=self.agent_id,
            settings=self.settings,
            models=self.models,
            runs=self.runs,
            mlperf=self.mlperf,
            rss=self.rss,
            energy=self.energy,
            host=HostLoad(),
            sampler=self.sampler,
            tracer=self.tracer,
            bus=bus,
            task_group=tg,
            git_commit=self.git_commit,
        )
        self.queries = Queries(self.evaluations, self.outbox)

    async def _subscribe(self, bus: Bus) -> list[Any]:
        subs = [
            await self.boundary.subscribe(
                names.agent_query(self.agent_id), bytes, self.queries.on_query
            ),
            await self.boundary.subscribe(names.agent_ctl(self.agent_id), CONTROL, self._on_ctl),
            await self.boundary.subscribe(
                names.agent_samples(self.agent_id), SamplesQuery, self.queries.on_samples_query
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
                subject, bytes, self.queries.on_query, queue=subject
            )
        await bus.nc.flush()

    async def _models_changed(self) -> None:
        """The models bucket changed: serve what is servable now and say so at once."""
        async with self._changing:
            if await self._refresh_offers():
                await self._sync_capabilities(self.bus)
                await self.registration.advertise(self.bus)

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
        """Control requests (the serving boundary replies to failures): about the agent
        itself here, about an evaluation in :class:`agent.evaluations.Evaluations`."""
        if isinstance(req, PingOp):
            return PingReply(t_agent=now())
        if isinstance(req, DescribeOp):
            return fit_description(self.describe(), self.bus.payload_budget())[0]
        return await self.evaluations.handle(req, msg)
