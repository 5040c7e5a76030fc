"""A load-generator service (``mlscope loadgen``): load from any host that joins the bus.

One task group: the control responder (``ping`` for the clock estimate, ``load`` to
fetch a dealt slice), the run responder (``start``: runs one slice, answers when it is
over; one run at a time, as nats-py serves one subscription's messages in order) and
the heartbeat. The service advertises itself in ``mlscope_loadgens`` only after both
subscriptions are in place, so "registered" means "ready", and withdraws on exit.

The server deals the schedule (:mod:`broker.multihost`); a slice arrives with its
queries already encoded, so the service needs no model, data set or catalog: only the
bus. It runs the slice with the same pacer and :class:`broker.loadgen.Driver` as the
server's own load generator, so figures from either are the same measurement.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import socket
import time
from dataclasses import dataclass, field

import anyio
import numpy as np
from anyio.abc import TaskStatus
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

import mlscope
from broker.lgcontrol import STOP_SAVE_S
from broker.lgresults import save_result
from broker.lgwork import unpack_slice, work_bucket
from broker.loadgen import Driver
from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.agentauth import bound_id
from mlscope.bus import Bus, bus_errors
from mlscope.contracts import (
    LOADGEN_CONTROL,
    LoadgenDescription,
    LoadgenDone,
    LoadgenLoaded,
    LoadgenLoadOp,
    LoadgenProgress,
    LoadgenStartOp,
    LoadgenStopOp,
    LoadgenStopped,
    PingOp,
    PingReply,
    TraceLevel,
)
from mlscope.errors import ConfigError, EvaluationError, MLScopeError
from mlscope.loadgens import ensure_bucket
from mlscope.presence import heartbeat
from mlscope.record import RunRecord
from mlscope.schedule import Schedule
from mlscope.serving import Boundary
from mlscope.settings import Settings
from mlscope.tuning import ProcessTuning

__all__ = ["LoadgenService", "default_id"]

log = logging.getLogger("mlscope.loadgen")
MAX_LOADED = 4
"""Slices held loaded and not yet started (a server that died between the two)."""
MAX_START_AHEAD_S = 60.0
"""How far from now a run may be asked to start (a server asks for well under a second
ahead, on this service's clock): later would hold the service, which serves one start
at a time; earlier would issue every query at once, each late by that much."""


def default_id(settings: Settings) -> str:
    """The id of the service's own credentials (``mlscope auth add-loadgen NAME``), or
    ``<host>-<pid>``: unique per process, readable in listings."""
    creds = settings.nats_creds
    own = bound_id(creds, "loadgen") if creds is not None else None
    return own or _host_pid()


def _host_pid() -> str:
    return names.token(f"{socket.gethostname()}-{os.getpid()}")


@dataclass
class _Loaded:
    op: LoadgenLoadOp
    schedule: Schedule
    payloads: list[bytes]
    labels: np.ndarray | None


@dataclass
class _Running:
    """A run in progress: stopped through ``scope``; ``saved`` is set once it ended,
    ``kept`` when a stopped run put what it had issued at ``result_object``."""

    evaluation_id: str
    result_object: str
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    saved: anyio.Event = field(default_factory=anyio.Event)
    kept: bool = False


@dataclass
class LoadgenService:
    settings: Settings
    loadgen_id: str = field(default_factory=_host_pid)
    heartbeat_s: float = busmod.HEARTBEAT_S
    tuning: ProcessTuning = field(default_factory=ProcessTuning)
    """This process's GC / switch-interval / priority owner, shared by the slices it runs."""
    _loaded: dict[str, _Loaded] = field(default_factory=dict)
    _running: dict[str, _Running] = field(default_factory=dict)
    """Each running run, by run id."""
    _connected: Bus | None = None

    def __post_init__(self) -> None:
        given = self.loadgen_id
        if not given or names.token(given) != given:
            raise ConfigError(
                f"load generator id {given[:40]!r}: use letters, digits, '-' and '_', at "
                f"most {names.TOKEN_MAX_CHARS} characters (it names the service's subjects "
                "and registry key)",
                field="loadgen_id",
            )
        creds = self.settings.nats_creds
        if creds is not None and (own := bound_id(creds, "loadgen")) not in (None, given):
            raise ConfigError(
                f"{creds} are load generator {own!r}'s own credentials (`mlscope auth "
                f"add-loadgen {own}`): run it as `mlscope loadgen --id {own}`, not {given!r}",
                field="loadgen_id",
            )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with busmod.connect(self.settings, name=f"loadgen {self.loadgen_id}") as bus:
            self._connected = bus
            kv = await ensure_bucket(bus, replicas=self.settings.js_replicas)
            await work_bucket(bus, replicas=self.settings.js_replicas)
            boundary = Boundary(bus, service=f"loadgen {self.loadgen_id}", logger=log)
            subs = [
                await boundary.subscribe(
                    names.loadgen_ctl(self.loadgen_id), LOADGEN_CONTROL, self._control
                ),
                await boundary.subscribe(
                    names.loadgen_run(self.loadgen_id), LoadgenStartOp, self._start
                ),
            ]
            desc = LoadgenDescription(
                loadgen_id=self.loadgen_id,
                host=socket.gethostname(),
                pid=os.getpid(),
                mlscope_version=mlscope.__version__,
                started_at=time.time(),
                heartbeat_at=time.time(),
            )
            await kv.put(self.loadgen_id, codec.encode_model(desc))
            log.info("load generator %s ready", self.loadgen_id)
            task_status.started()
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(
                        boundary.keep_running,
                        "heartbeat",
                        functools.partial(self._heartbeat, kv, desc),
                    )
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(3):
                    await kv.delete(self.loadgen_id)
                    for sub in subs:
                        await sub.unsubscribe()

    async def _heartbeat(self, kv: KeyValue, desc: LoadgenDescription) -> None:
        def beat() -> bytes:
            return codec.encode_model(desc.model_copy(update={"heartbeat_at": time.time()}))

        await heartbeat(
            kv,
            self.loadgen_id,
            beat,
            interval_s=self.heartbeat_s,
            who=f"load generator {self.loadgen_id}",
        )

    async def _control(
        self, op: PingOp | LoadgenLoadOp | LoadgenStopOp, msg: Msg
    ) -> PingReply | LoadgenLoaded | LoadgenStopped:
        if isinstance(op, PingOp):
            return PingReply(t_agent=time.perf_counter_ns())
        if isinstance(op, LoadgenStopOp):
            return await self._stop(op)
        if len(self._loaded) >= MAX_LOADED:
            self._loaded.pop(next(iter(self._loaded)))  # the oldest was never started
        obs = await work_bucket(self._bus())
        with bus_errors(f"cannot read slice {op.slice_object[:128]!r}"):
            got = await obs.get(op.slice_object)
        sched, payloads, labels = await anyio.to_thread.run_sync(unpack_slice, got.data or b"")
        self._loaded[op.run_id] = _Loaded(op, sched, payloads, labels)
        log.info("run %s: a slice of %d queries loaded", op.run_id, len(sched))
        return LoadgenLoaded(run_id=op.run_id, queries=len(sched))

    async def _stop(self, op: LoadgenStopOp) -> LoadgenStopped:
        """Let go of the run ``op`` names, or of every run of its evaluation; answered
        once a stopped run put what it had issued into the work bucket (at most
        :data:`STOP_SAVE_S`), naming the results so kept."""

        def named(run_id: str, evaluation_id: str) -> bool:
            return run_id == op.run_id or evaluation_id == op.evaluation_id

        loaded = [r for r, got in self._loaded.items() if named(r, got.op.evaluation_id)]
        for r in loaded:
            del self._loaded[r]
        running = {r: got for r, got in self._running.items() if named(r, got.evaluation_id)}
        for r, got in running.items():
            got.scope.cancel()
            log.info("run %s: stopped by its server", r)
        with anyio.move_on_after(STOP_SAVE_S):
            for got in running.values():
                await got.saved.wait()
        return LoadgenStopped(
            run_ids=loaded + list(running),
            running=bool(running),
            kept=[got.result_object for got in running.values() if got.kept],
        )

    async def _start(self, op: LoadgenStartOp, msg: Msg) -> LoadgenDone:
        loaded = self._loaded.pop(op.run_id, None)
        if loaded is None:
            raise EvaluationError(f"run {op.run_id} was not loaded on {self.loadgen_id}")
        ahead_s = (op.start_ns - time.perf_counter_ns()) / 1e9
        if abs(ahead_s) > MAX_START_AHEAD_S:
            raise EvaluationError(
                f"run {op.run_id} would start {ahead_s:+.3g} s from now; a server starts "
                f"a loaded run within {MAX_START_AHEAD_S:.0f} s"
            )
        bus = self._bus()
        driver = self._driver(bus, op, loaded)
        run = self._running[op.run_id] = _Running(loaded.op.evaluation_id, op.result_object)
        try:
            with run.scope:
                rec = await driver.run()
            if run.scope.cancelled_caught:  # what it had issued: a cancelled run's rows
                if driver.record is not None:
                    run.kept = await self._keep(bus, op.result_object, driver.record)
                raise EvaluationError(f"run {op.run_id} was stopped by its server")
        finally:
            self._running.pop(op.run_id, None)
            run.saved.set()
        await _put_result(bus, op.result_object, rec)
        completed = int(np.count_nonzero(rec.completed))
        log.info("run %s: %d of %d queries completed", op.run_id, completed, rec.n)
        return LoadgenDone(
            run_id=op.run_id,
            result_object=op.result_object,
            queries=rec.n,
            completed=completed,
            cpu_s=rec.cpu_s,
        )

    def _driver(self, bus: Bus, op: LoadgenStartOp, loaded: _Loaded) -> Driver:
        """The Driver of a loaded slice, started by ``op``: its queries prebuilt, its
        labels by global index, its progress published where ``op`` says."""
        sched, lab = loaded.schedule, loaded.labels
        first = int(sched.index[0]) if len(sched) else 0
        stride = int(sched.index[1] - sched.index[0]) if len(sched) > 1 else 1

        def labels(g: int) -> np.ndarray:  # only called when the slice has labels
            row: np.ndarray = lab[(g - first) // stride]  # type: ignore[index]
            return row

        def no_inputs(g: int) -> np.ndarray:
            raise EvaluationError("payloads are prebuilt by the server")

        async def progress(rec: RunRecord, _elapsed_s: float) -> None:
            if op.progress_subject:
                note = LoadgenProgress(
                    run_id=op.run_id, result_object=op.result_object, done=rec.done
                )
                await bus.nc.publish(op.progress_subject, codec.encode_model(note))

        return Driver(
            bus,
            evaluation_id=loaded.op.evaluation_id,
            subject=loaded.op.subject,
            spec=loaded.op.spec,
            inputs=no_inputs,
            labels=labels if lab is not None else None,
            trace_level=TraceLevel(loaded.op.trace_level),
            offset_ns=loaded.op.offset_ns,
            schedule=sched,
            start_ns=op.start_ns,
            payloads=loaded.payloads,
            on_progress=progress,
            tuning=self.tuning,
        )

    async def _keep(self, bus: Bus, result_object: str, rec: RunRecord) -> bool:
        """Put a stopped run's record; whether it is there (shielded: the run was
        stopped, not this)."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(STOP_SAVE_S):
            try:
                await _put_result(bus, result_object, rec)
            except MLScopeError as exc:
                log.warning("%s: what the stopped run issued not kept: %s", result_object, exc)
                return False
            return True
        return False

    def _bus(self) -> Bus:
        if self._connected is None:
            raise EvaluationError(f"load generator {self.loadgen_id} is not connected")
        return self._connected


async def _put_result(bus: Bus, result_object: str, rec: RunRecord) -> None:
    """A run's raw arrays into the work bucket, where its server reads them."""
    out = io.BytesIO()
    save_result(rec, out)
    with bus_errors(f"cannot put {result_object}"):
        await (await work_bucket(bus)).put(result_object, out.getvalue())
