"""Distributed load over load-generator services on any host (``loadgen_hosts``).

The server side of ``mlscope-submit --loadgen-hosts a,b``: one seeded global schedule
dealt round-robin (query ``i`` to service ``i % K``, :func:`mlscope.schedule.deal`) to
registered load-generator services (``mlscope loadgen``, :mod:`broker.lgservice`),
which may run on other machines::

    server                                    load generator j (any host)
      │ registry: every named service live?
      │ ping ×9 on its ctl subject ─────────► PingReply (its monotonic clock)
      │   → offset_j = its clock − ours (min RTT, error ≤ RTT/2)
      │ slice j (offsets, global indices, encoded queries, labels)
      │   ─► object store mlscope_loadgen_work ──► fetched on "load"
      │ ctl load ───────────────────────────► LoadgenLoaded
      │ run start (start_ns + offset_j) ────► pacer + Driver, queries to the agent
      │ ◄──────── LoadgenProgress (every 0.5 s: queries completed, summed into events)
      │ ◄─────────────── LoadgenDone (result .npz in the work bucket)
      └ merge by global index (:func:`broker.distributed.merge_results`) → one record

Clocks: processes on one host share CLOCK_MONOTONIC; across hosts they do not, so
each service's clock is tied to the server's by the NTP-style ping estimate (the same
one that ties the agent's), and the shared start is sent in each service's own
clock. The merged record is on the server's clock (t0 = the start), agent times on
each service's (its offset to the agent is the agent's offset minus its own).
Payloads are built by the server from the one sample order (:mod:`mlscope.samples`),
so a service needs no model, data set or catalog.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
from nats.aio.msg import Msg
from nats.js.object_store import ObjectStore

from broker.distributed import (
    PROGRESS_S,
    START_LEAD_S,
    load_result,
    merge_results,
    until_first_stop,
)
from broker.loadgen import encode_query, estimate_offset
from mlscope import codec, names, schedule
from mlscope.bus import Bus, bus_errors, request
from mlscope.contracts import (
    MAX_BATCH,
    MAX_DURATION_S,
    MAX_SCHEDULED_QUERIES,
    LoadgenDescription,
    LoadgenDone,
    LoadgenLoadOp,
    LoadgenProgress,
    LoadgenStartOp,
    LoadgenStopOp,
    LoadgenStopped,
    ScenarioSpec,
    new_id,
)
from mlscope.errors import (
    BusError,
    ConfigError,
    EvaluationError,
    MLScopeError,
    ResolutionError,
    WireError,
)
from mlscope.loadgens import list_loadgens
from mlscope.provision import object_store
from mlscope.record import RunRecord
from mlscope.schedule import Schedule

if TYPE_CHECKING:
    from broker.context import Context

__all__ = [
    "SLICE_KEYS",
    "STOP_SAVE_S",
    "pack_slice",
    "result_name",
    "run_on_services",
    "stop_runs",
    "unpack_slice",
    "work_bucket",
]

log = logging.getLogger("mlscope.multihost")

LOAD_TIMEOUT_S = 120.0
WATCH_S = 2.0
"""How often a running distributed run checks that its services are alive (their
registry entries expire :data:`mlscope.provision.AGENT_TTL_S` after their last heartbeat)."""
WORK_TTL_S = 3600.0
"""Slices and results left behind by a run that died expire after this long."""
STOP_SAVE_S = 5.0
"""How long a service's stop waits for a stopped run to put what it had issued into
the work bucket (the rows of its cancelled evaluation) before it answers."""
STOP_ANSWER_S = STOP_SAVE_S + 3.0
"""How long a server waits for a service's answer to a stop."""
STOP_WAIT_S = STOP_ANSWER_S + 5.0
"""The most a stopped run's server spends on it: the stop, reading what its services
kept, deleting the run's objects."""


async def work_bucket(bus: Bus, *, replicas: int = 1) -> ObjectStore:
    """The object store that carries slices and results, created when missing with
    ``replicas`` (``MLSCOPE_JS_REPLICAS``: the server makes it at start, a
    load-generator service if it comes first)."""
    return await object_store(
        bus,
        names.LOADGEN_WORK_BUCKET,
        description="dealt schedule slices and their results (distributed load)",
        replicas=replicas,
        ttl_s=WORK_TTL_S,
    )


def pack_slice(part: Schedule, payloads: list[bytes], labels: np.ndarray | None) -> bytes:
    """One dealt slice: offsets, global indices, each query's bytes, labels (or None)."""
    return codec.encode(
        {
            "offsets": part.offsets_ns,
            "index": part.index,
            "samples_per_query": part.samples_per_query,
            "payloads": payloads,
            "labels": labels,
        }
    )


SLICE_KEYS = frozenset({"offsets", "index", "samples_per_query", "payloads", "labels"})
"""The members of a packed slice (:func:`pack_slice`)."""


def unpack_slice(data: bytes) -> tuple[Schedule, list[bytes], np.ndarray | None]:
    """A dealt slice as the server packed it, refused unless a run could have it.

    Anyone who may write the work bucket can put a slice there: one not shaped as
    :func:`pack_slice` makes it (members, integer offsets and indices, a payload of
    bytes and a label row per query) is a WireError; one with more than a run's queries,
    or spread over more than a run's duration (its last query years away would hold its
    service for good), is a ConfigError."""
    doc = codec.decode(data)
    if not isinstance(doc, dict) or set(doc) != SLICE_KEYS:
        raise WireError(f"a slice is a map of {', '.join(sorted(SLICE_KEYS))}")
    spq, payloads = doc["samples_per_query"], doc["payloads"]
    if type(spq) is not int:
        raise WireError("a slice's samples_per_query is not an integer")
    if not isinstance(payloads, list) or not all(isinstance(p, bytes) for p in payloads):
        raise WireError("a slice's payloads are not a list of bytes")
    sched = Schedule(_integers(doc, "offsets"), spq, _integers(doc, "index"))
    if len(sched) > MAX_SCHEDULED_QUERIES or sched.duration_s > MAX_DURATION_S:
        raise ConfigError(
            f"a slice of {len(sched):,} queries over {sched.duration_s:.3g} s: over what one "
            f"run may have ({MAX_SCHEDULED_QUERIES:,} queries, {MAX_DURATION_S:.0f} s)"
        )
    if sched.samples_per_query > MAX_BATCH:
        raise ConfigError(f"a slice's samples_per_query is over {MAX_BATCH:,}")
    if len(payloads) != len(sched):
        raise ConfigError(f"a slice of {len(payloads)} payloads for {len(sched)} queries")
    labels = doc["labels"]
    if labels is None:
        return sched, payloads, None
    if not (
        isinstance(labels, np.ndarray)
        and labels.ndim >= 1
        and labels.shape[0] == len(sched)
        and labels.dtype.kind in "iufb"
    ):
        raise WireError(
            f"a slice's labels are not a numeric row for each of its {len(sched)} queries"
        )
    return sched, payloads, labels


def _integers(doc: dict[str, Any], name: str) -> np.ndarray:
    """``doc[name]`` as a one-dimensional array of integers (a WireError otherwise)."""
    value = doc[name]
    arr = value if isinstance(value, np.ndarray) else None
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise WireError(f"a slice's {name} are not a one-dimensional array of integers")
    return arr


async def _watch(
    bus: Bus, services: list[LoadgenDescription], done: list[Any], run_id: str
) -> None:
    """End the run (an EvaluationError naming them) when services whose slice is not
    done are lost: a killed service would otherwise be waited on until its request's
    timeout, minutes away."""
    while True:
        await anyio.sleep(WATCH_S)
        lost = await _lost_services(bus, services, done)
        if lost:
            raise EvaluationError(
                f"load-generator service {', '.join(lost)} was lost during run {run_id} "
                "(its registry entry expired, or it restarted)",
                loadgen_ids=lost,
            )


async def _lost_services(
    bus: Bus, services: list[LoadgenDescription], done: list[Any]
) -> list[str]:
    """The services whose slice is not done and whose registry entry is gone, stale
    or another process's (restarted); none when the registry cannot be read now."""
    try:
        live = {d.loadgen_id: d for d in await list_loadgens(bus)}
    except BusError:
        return []
    return [
        s.loadgen_id
        for s, d in zip(services, done, strict=True)
        if d is None
        and (
            (now := live.get(s.loadgen_id)) is None
            or (now.pid, now.started_at) != (s.pid, s.started_at)
        )
    ]


def _first(group: BaseExceptionGroup[Any]) -> BaseException:
    """The first exception of ``group`` that is not a group, however deep."""
    first: BaseException = group
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first


async def _services(bus: Bus, wanted: tuple[str, ...]) -> list[LoadgenDescription]:
    live = {d.loadgen_id: d for d in await list_loadgens(bus)}
    missing = [h for h in wanted if h not in live]
    if missing:
        raise ResolutionError(
            f"no live load generator {', '.join(missing)} (start one with "
            f"`mlscope loadgen --id NAME`); live load generators: {', '.join(live) or 'none'}",
            loadgen_hosts=list(wanted),
            missing=missing,
        )
    return [live[h] for h in wanted]


async def run_on_services(
    ctx: Context,
    spec: ScenarioSpec,
    sched: Schedule,
    inputs: Callable[[int], np.ndarray],
    labels: Callable[[int], np.ndarray] | None,
) -> RunRecord:
    """Run ``sched`` dealt to the services ``spec.loadgen_hosts``; the merged record,
    with ``record.sources`` saying which service ran which slice."""
    if not spec.loadgen_hosts:
        raise ConfigError("a run over load-generator services needs loadgen_hosts")
    bus = ctx.bus
    services = await _services(bus, spec.loadgen_hosts)
    parts = schedule.deal(sched, len(services))
    run_id = new_id("lr")
    obs = await work_bucket(bus)
    offsets = [
        (await estimate_offset(bus, s.loadgen_id, subject=names.loadgen_ctl(s.loadgen_id)))[0]
        for s in services
    ]
    objects: list[str] = []
    finished = cancelled = False
    start: int | None = None
    try:
        for j, (svc, part) in enumerate(zip(services, parts, strict=True)):
            slice_ = _Slice(run_id, j, part, ctx.offset_ns - offsets[j])
            objects.append(await _load(ctx, spec, obs, svc, slice_, inputs, labels))
        start = time.perf_counter_ns() + int(START_LEAD_S * 1e9)
        done = await _start_all(ctx, spec, services, offsets, run_id, start)
        objects += [d.result_object for d in done]
        read = [
            _as_reported(await _read_result(obs, d.result_object, len(p)), d, svc)
            for d, p, svc in zip(done, parts, services, strict=True)
        ]
        finished = True
    except anyio.get_cancelled_exc_class():
        cancelled = True
        raise
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(STOP_WAIT_S):
            if not finished:  # cancelled or failed: no service goes on sending queries
                stopped = await stop_runs(bus, services, LoadgenStopOp(run_id=run_id))
                results = [result_name(run_id, j) for j in range(len(parts))]
                if cancelled and start is not None:
                    where = _Where(services, offsets, start)
                    await _keep_stopped(ctx, spec, obs, parts, stopped, results, where)
                objects += results
            for name in objects:  # one left behind expires with the bucket's TTL
                with contextlib.suppress(BusError), bus_errors(f"cannot delete {name}"):
                    await obs.delete(name)
    rec = merge_results(parts, read)
    rec.t0_ns = start  # the shared start, on this server's clock
    rec.sources = _Where(services, offsets, start).sources(read)
    return rec


@dataclass(frozen=True)
class _Where:
    """Where a run's slices ran: the services, their clocks, the shared start."""

    services: list[LoadgenDescription]
    offsets: list[int]
    """Each service's clock minus this server's."""
    start: int
    """The shared start, on this server's clock."""

    def sources(self, read: list[tuple[RunRecord, dict[int, str]]]) -> tuple[dict[str, Any], ...]:
        """``RunRecord.sources``: which service ran which slice, with the counts and
        the CPU time its result holds."""
        return tuple(
            {
                "loadgen_id": svc.loadgen_id,
                "host": svc.host,
                "pid": svc.pid,
                "slice": j,
                "queries": rec.n,
                "completed": int(np.count_nonzero(rec.completed)),
                "cpu_s": rec.cpu_s,
                "clock_offset_ns": self.offsets[j],
            }
            for j, (svc, (rec, _)) in enumerate(zip(self.services, read, strict=True))
        )


def _as_reported(
    got: tuple[RunRecord, dict[int, str]], d: LoadgenDone, svc: LoadgenDescription
) -> tuple[RunRecord, dict[int, str]]:
    """A slice's result once the service's :class:`LoadgenDone` tells the same story:
    its queries, the queries completed and the CPU time are the result's own. A service
    whose answer and arrays disagree is a WireError naming it (which of the two is
    false cannot be told, and the summary would show the other)."""
    rec = got[0]
    held = (rec.n, int(np.count_nonzero(rec.completed)), rec.cpu_s)
    if (d.queries, d.completed, d.cpu_s) != held:
        raise WireError(
            f"load-generator service {svc.loadgen_id} reported {d.queries} queries, "
            f"{d.completed} completed, {d.cpu_s:.6g} s CPU; its result "
            f"{d.result_object} holds {held[0]}, {held[1]}, {held[2]:.6g} s",
            loadgen_id=svc.loadgen_id,
        )
    return got


@dataclass(frozen=True)
class _Slice:
    run_id: str
    j: int
    part: Schedule
    agent_offset_ns: int
    """The agent's clock minus the service's."""


async def _load(
    ctx: Context,
    spec: ScenarioSpec,
    obs: ObjectStore,
    svc: LoadgenDescription,
    sl: _Slice,
    inputs: Callable[[int], np.ndarray],
    labels: Callable[[int], np.ndarray] | None,
) -> str:
    """Build one slice's queries, put them in the work bucket and have ``svc`` load
    them; the object's name."""
    glob = sl.part.index.tolist()
    payloads = [encode_query(ctx.query_id, g, inputs(g), ctx.trace_level) for g in glob]
    lab = np.stack([labels(g) for g in glob]) if labels is not None and glob else None
    name = f"{sl.run_id}/slice-{sl.j}"
    with bus_errors(f"cannot put {name}"):
        await obs.put(name, pack_slice(sl.part, payloads, lab))
    load = LoadgenLoadOp(
        run_id=sl.run_id,
        evaluation_id=ctx.evaluation_id,
        subject=ctx.subject,
        spec=spec,
        offset_ns=sl.agent_offset_ns,
        trace_level=int(ctx.trace_level),
        has_labels=lab is not None,
        slice_object=name,
    )
    await request(
        ctx.bus, names.loadgen_ctl(svc.loadgen_id), codec.encode_model(load), timeout=LOAD_TIMEOUT_S
    )
    return name


async def stop_runs(
    bus: Bus, services: list[LoadgenDescription], stop: LoadgenStopOp
) -> list[LoadgenStopped | None]:
    """Send ``stop`` (a run, or every run of an evaluation) to every service at once,
    loaded or running; each one's answer, in order. A service that does not answer (or
    answers with no :class:`LoadgenStopped`) is logged, its answer None: its slice ends
    with its schedule."""
    what = f"run {stop.run_id}" if stop.run_id else f"evaluation {stop.evaluation_id}"
    data = codec.encode_model(stop)
    answers: list[LoadgenStopped | None] = [None] * len(services)

    async def one(j: int, svc: LoadgenDescription) -> None:
        try:
            with bus_errors(f"cannot stop {what}"):
                reply = await request(
                    bus, names.loadgen_ctl(svc.loadgen_id), data, timeout=STOP_ANSWER_S
                )
            answers[j] = codec.validate(LoadgenStopped, reply)
        except MLScopeError as exc:
            log.warning("%s not stopped on %s: %s", what, svc.loadgen_id, exc)

    async with anyio.create_task_group() as tg:
        for j, svc in enumerate(services):
            tg.start_soon(one, j, svc)
    return answers


def result_name(run_id: str, j: int) -> str:
    """The work-bucket object in which slice ``j`` of run ``run_id`` puts its arrays."""
    return f"{run_id}/result-{j}"


async def _keep_stopped(
    ctx: Context,
    spec: ScenarioSpec,
    obs: ObjectStore,
    parts: list[Schedule],
    stopped: list[LoadgenStopped | None],
    results: list[str],
    where: _Where,
) -> None:
    """A cancelled run's merged record of what its services had issued, reported as its
    progress: the rows its evaluation stores (:func:`broker.cancel.issued_part`), with
    the CPU time each service's load used up to its stop (its result's ``cpu_s``) and
    ``sources`` as a finished run has them. Only when every service kept its slice's;
    else the run keeps none (no rows, no CPU time), as before a service kept any."""
    kept = {name for s in stopped if s is not None for name in s.kept}
    if ctx.on_progress is None or not set(results) <= kept:
        return
    try:
        got = [
            await _read_result(obs, name, len(part))
            for name, part in zip(results, parts, strict=True)
        ]
    except MLScopeError as exc:
        log.warning("%s: the stopped slices' rows not read: %s", ctx.evaluation_id, exc)
        return
    rec = until_first_stop(merge_results(parts, got), parts)
    rec.t0_ns = where.start
    rec.sources = where.sources(got)
    rec.warmup = min(spec.warmup_queries, rec.n)
    await ctx.on_progress(rec, (time.perf_counter_ns() - where.start) / 1e9)


async def _read_result(
    obs: ObjectStore, name: str, queries: int
) -> tuple[RunRecord, dict[int, str]]:
    """A slice's result as its service put it (shapes checked before anything is read)."""
    with bus_errors(f"cannot read {name}"):
        got = await obs.get(name)
    return await anyio.to_thread.run_sync(load_result, io.BytesIO(got.data or b""), queries)


def _own_result(d: LoadgenDone, run_id: str, result: str, svc: LoadgenDescription) -> LoadgenDone:
    """``d`` once it answers for this run's slice: a service that names another run or
    another slice's result (which the server would then read as this slice's, and
    delete) is an EvaluationError naming it."""
    if d.run_id != run_id or d.result_object != result:
        raise EvaluationError(
            f"load-generator service {svc.loadgen_id} answered for run {d.run_id[:64]!r}, "
            f"result {d.result_object[:128]!r}; it was given run {run_id}, result {result}",
            loadgen_id=svc.loadgen_id,
        )
    return d


async def _start_all(
    ctx: Context,
    spec: ScenarioSpec,
    services: list[LoadgenDescription],
    offsets: list[int],
    run_id: str,
    start: int,
) -> list[LoadgenDone]:
    """Start every loaded slice at once; each answers when its run is over."""
    timeout = spec.duration_s * 3 + 120
    done: list[Any] = [None] * len(services)
    results = [result_name(run_id, j) for j in range(len(services))]
    counts: dict[str, int] = {}
    """Queries done by each slice (keyed by its result's name), as its service reports."""

    async def one(j: int, svc: LoadgenDescription) -> None:
        op = LoadgenStartOp(
            run_id=run_id,
            start_ns=start + offsets[j],
            result_object=results[j],
            progress_subject=names.loadgen_progress(svc.loadgen_id),
        )
        reply = await request(
            ctx.bus, names.loadgen_run(svc.loadgen_id), codec.encode_model(op), timeout=timeout
        )
        done[j] = _own_result(codec.validate(LoadgenDone, reply), run_id, results[j], svc)

    async def heard(msg: Msg) -> None:  # a malformed note is ignored: it is only display
        with contextlib.suppress(WireError):
            note = codec.decode_model(LoadgenProgress, msg.data)
            if note.run_id == run_id and note.result_object in results:  # ours only
                counts[note.result_object] = max(0, note.done)

    async def report() -> None:
        t0 = time.monotonic()
        while ctx.on_progress is not None:
            await anyio.sleep(PROGRESS_S)
            rec = RunRecord(n=0, batch_size=spec.batch_size)
            rec.done = sum(counts.values())
            await ctx.on_progress(rec, time.monotonic() - t0)

    # Each service reports on its own subject (a load generator's user may publish
    # there and to nobody's inbox); a note of another run is ignored.
    subs = [
        await ctx.bus.nc.subscribe(names.loadgen_progress(svc.loadgen_id), cb=heard)
        for svc in services
    ]
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(report)
            tg.start_soon(_watch, ctx.bus, services, done, run_id)
            async with anyio.create_task_group() as runs:
                for j, svc in enumerate(services):
                    runs.start_soon(one, j, svc)
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # the first failure, as it was raised
        raise _first(group) from group
    finally:
        with anyio.CancelScope(shield=True):
            for sub in subs:
                await sub.unsubscribe()
    if any(d is None for d in done):
        raise EvaluationError(f"a load generator of run {run_id} did not report")
    return list(done)
