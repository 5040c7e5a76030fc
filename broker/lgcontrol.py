"""The server's requests to the load-generator services of a distributed run.

Which named services are live (:func:`live_services`), the start of every loaded slice
at once with the progress each reports and a watch for a service lost while its slice
runs (:func:`start_all`), and the stop of a run, or of every run of an evaluation, on
every service (:func:`stop_runs`). The run itself, from dealing its schedule to the
merged record, is :mod:`broker.multihost`'s.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

import anyio
from nats.aio.msg import Msg

from broker.distributed import PROGRESS_S
from broker.lgwork import result_name
from mlscope import codec, names
from mlscope.bus import Bus, bus_errors, request
from mlscope.contracts import (
    LoadgenDescription,
    LoadgenDone,
    LoadgenProgress,
    LoadgenStartOp,
    LoadgenStopOp,
    LoadgenStopped,
    ScenarioSpec,
)
from mlscope.errors import BusError, EvaluationError, MLScopeError, ResolutionError, WireError
from mlscope.loadgens import list_loadgens
from mlscope.record import RunRecord

if TYPE_CHECKING:
    from broker.context import Context

__all__ = ["STOP_ANSWER_S", "STOP_SAVE_S", "live_services", "start_all", "stop_runs"]

log = logging.getLogger("mlscope.multihost")

WATCH_S = 2.0
"""How often a running distributed run checks that its services are alive (their
registry entries expire :data:`mlscope.provision.AGENT_TTL_S` after their last heartbeat)."""
STOP_SAVE_S = 5.0
"""How long a service's stop waits for a stopped run to put what it had issued into
the work bucket (the rows of its cancelled evaluation) before it answers."""
STOP_ANSWER_S = STOP_SAVE_S + 3.0
"""How long a server waits for a service's answer to a stop."""


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


async def live_services(bus: Bus, wanted: tuple[str, ...]) -> list[LoadgenDescription]:
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


async def start_all(
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
