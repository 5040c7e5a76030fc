"""A hostile load-generator service in a distributed run (``run_on_services``), on a
real nats-server with the real work bucket: service ``good`` runs its slice honestly;
service ``evil`` answers its start with a LoadgenDone that names an object the server
did not give it (the good service's result, then someone else's object). The server
refuses the answer by name; it neither reads another slice's times as its own nor
deletes an object it did not make."""

from __future__ import annotations

import io
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import numpy as np
import pytest

from broker import lgwork, multihost
from broker.lgresults import save_result
from mlscope import bus as busmod
from mlscope import codec, loadgens, names
from mlscope.contracts import LoadgenDescription, LoadgenDone, LoadgenLoaded, ScenarioSpec
from mlscope.errors import EvaluationError, WireError
from mlscope.natsserver import NatsServer
from mlscope.provision import ensure_infrastructure
from mlscope.record import RunRecord
from mlscope.schedule import Schedule
from mlscope.settings import Settings

pytestmark = pytest.mark.timeout(120)

N = 8  # queries: 4 per slice
OTHER = "someone-else/slice-0"
Names = Callable[[dict[str, Any], Any], Awaitable[str]]
"""A service's answer to a start: the result object it names (given the op, the bucket)."""


def _run_on_good_and_evil(bus: busmod.Bus) -> tuple[Any, ScenarioSpec, Schedule]:
    """What a server hands run_on_services for a run dealt to services good and evil:
    its context (only the fields the run reads), spec and schedule of N queries."""
    ctx = SimpleNamespace(
        bus=bus,
        evaluation_id="ev-1",
        query_id="ev-1",
        subject="mlscope.agent.a.query",
        trace_level=0,
        offset_ns=0,
        on_progress=None,
    )
    spec = ScenarioSpec(name="batched", loadgen_hosts=("good", "evil"))
    return ctx, spec, Schedule(np.arange(N, dtype=np.int64) * 1000, 1, np.arange(N))


async def _service(
    bus: busmod.Bus,
    lg_id: str,
    result_for: Names,
    obs: Any,
    pong: Any = None,
    says: dict[str, Any] | None = None,
) -> None:
    """A load-generator service on the bus whose start answers name ``result_for``'s
    object and report a whole slice answered (``says``: other counts to report)."""
    kv = await loadgens.ensure_bucket(bus)
    now = time.time()
    desc = LoadgenDescription(
        loadgen_id=lg_id, host="h", pid=1, mlscope_version="0", started_at=now, heartbeat_at=now
    )
    await kv.put(names.token(lg_id), codec.encode_model(desc))

    async def ctl(msg: Any) -> None:
        op = codec.decode(msg.data)
        if op.get("op") == "ping":
            out: Any = {"kind": "pong", "t_agent": time.perf_counter_ns()} if pong is None else pong
        elif op.get("op") == "load":
            out = LoadgenLoaded(run_id=op["run_id"], queries=N // 2).dump()
        else:
            out = {"kind": "stopped"}
        await msg.respond(codec.encode(out))

    async def run(msg: Any) -> None:
        op = codec.decode(msg.data)
        name = await result_for(op, obs)
        counts = {"queries": N // 2, "completed": N // 2, "cpu_s": 0.0, **(says or {})}
        done = LoadgenDone(run_id=op["run_id"], result_object=name, **counts)
        await msg.respond(codec.encode_model(done))

    await bus.nc.subscribe(names.loadgen_ctl(lg_id), cb=ctl)
    await bus.nc.subscribe(names.loadgen_run(lg_id), cb=run)
    await bus.nc.flush()


def _result(latency_ns: int) -> bytes:
    rec = RunRecord(n=N // 2, batch_size=1)
    rec.scheduled[:] = np.arange(1, N // 2 + 1) * 1000
    rec.issued[:] = rec.scheduled
    rec.completed[:] = rec.scheduled + latency_ns
    rec.ok[:] = 1
    rec.done = N // 2
    buf = io.BytesIO()
    save_result(rec, buf)
    return buf.getvalue()


def _only(exc: BaseException) -> BaseException:
    """The one error a task group raised, out of its groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


SetUp = Callable[[busmod.Bus, Any], Awaitable[None]]
"""Starts the stand-in services (given their connection and the work bucket)."""


def dealt_run(
    tmp_path: Path, set_up: SetUp, on_progress: Any = None
) -> tuple[RunRecord | BaseException, bool]:
    """A run dealt to services ``good`` and ``evil``, which ``set_up`` starts, on a real
    nats-server and work bucket (``on_progress``: the run's progress callback): the
    merged record or the run's error, and whether someone else's object in the work
    bucket is still there afterwards."""
    got: list[tuple[RunRecord | BaseException, bool]] = []

    async def main() -> None:
        with NatsServer(store_dir=tmp_path / "nats") as ns:
            settings = Settings(nats_url=ns.url, data_dir=tmp_path / "data")
            async with (
                busmod.connect(settings, name="services") as sb,
                busmod.connect(settings, name="server") as bus,
            ):
                await ensure_infrastructure(bus)
                obs = await lgwork.work_bucket(bus)
                await obs.put(OTHER, b"another run's slice")
                await set_up(sb, obs)
                ctx, spec, sched = _run_on_good_and_evil(bus)
                ctx.on_progress = on_progress
                outcome: RunRecord | BaseException
                try:
                    outcome = await multihost.run_on_services(
                        ctx, spec, sched, lambda g: np.zeros((1, 4), np.float32), None
                    )
                except Exception as exc:  # the test judges it
                    outcome = _only(exc)
                kept = (await obs.get(OTHER)).data == b"another run's slice"
                got.append((outcome, kept))

    anyio.run(main)
    return got[0]


def run_with(
    tmp_path: Path, evil: Names, evil_pong: Any = None
) -> tuple[BaseException | None, bool]:
    """A run dealt to ``good`` and ``evil`` (which answers a ping with ``evil_pong``
    when given, and is handed the event of good's result stored rather than the
    bucket): its error (None if it ran) and whether someone else's object is kept."""
    good_done = anyio.Event()

    async def good(op: dict[str, Any], obs: Any) -> str:
        await obs.put(op["result_object"], _result(latency_ns=5_000_000))
        good_done.set()
        return str(op["result_object"])

    async def set_up(sb: busmod.Bus, obs: Any) -> None:
        await _service(sb, "good", good, obs)
        await _service(sb, "evil", evil, good_done, evil_pong)

    outcome, kept = dealt_run(tmp_path, set_up)
    return (None if isinstance(outcome, RunRecord) else outcome), kept


def test_a_service_that_names_another_slice_s_result_is_refused(tmp_path: Path) -> None:
    """Its own slice never ran; it names the good service's result, which the server
    would read as its slice too (8 of 8 answered, slice 1 holding slice 0's times)."""

    async def evil(op: dict[str, Any], good_done: Any) -> str:
        await good_done.wait()
        return f"{op['run_id']}/result-0"

    error, kept = run_with(tmp_path, evil)
    assert isinstance(error, EvaluationError), error
    assert "load-generator service evil answered for run" in error.message
    assert error.fields["loadgen_id"] == "evil" and kept


def test_a_service_cannot_make_the_server_delete_another_object(tmp_path: Path) -> None:
    async def evil(op: dict[str, Any], good_done: Any) -> str:
        return OTHER

    error, kept = run_with(tmp_path, evil)
    assert isinstance(error, EvaluationError) and OTHER in error.message
    assert kept, "the server deleted an object a load generator named"


@pytest.mark.parametrize(
    "pong",
    [
        {},
        [1, 2],
        {"kind": "pong", "t_agent": "soon"},
        {"kind": "pong", "t_agent": None},
        {"kind": "pong", "t_agent": -1},
        {"kind": "pong", "t_agent": 1e300},
        {"kind": "pong", "t_agent": 2**63 - 1},  # within the contract, past any uptime
    ],
)
def test_a_service_whose_ping_reply_is_malformed_fails_the_run_naming_it(
    tmp_path: Path, pong: Any
) -> None:
    """The clock estimate reads a service's answer as a PingReply: anything else is a
    WireError naming the service's subject, not a KeyError or TypeError of the server."""

    async def evil(op: dict[str, Any], good_done: Any) -> str:
        raise AssertionError("a service whose clock is unknown is never started")

    error, kept = run_with(tmp_path, evil, evil_pong=pong)
    assert isinstance(error, WireError), repr(error)
    assert names.loadgen_ctl("evil") in error.message and kept


def test_a_service_cannot_move_its_queries_scheduled_times(tmp_path: Path) -> None:
    """Latency counts from the schedule the server dealt: a result that claims each
    query was scheduled 49 ms later (turning 50 ms into 1 ms) is refused."""

    async def moved(op: dict[str, Any], obs: Any) -> str:
        j = int(str(op["result_object"]).rsplit("-", 1)[1])
        rec = RunRecord(n=N // 2, batch_size=1)
        rec.scheduled[:] = rec.issued[:] = np.arange(j, N, 2) * 1000
        rec.completed[:] = rec.scheduled + 50_000_000
        rec.scheduled[:] += 49_000_000
        rec.ok[:] = 1
        buf = io.BytesIO()
        save_result(rec, buf)
        await obs.put(op["result_object"], buf.getvalue())
        return str(op["result_object"])

    async def set_up(sb: busmod.Bus, obs: Any) -> None:
        await _service(sb, "good", moved, obs)
        await _service(sb, "evil", moved, obs)

    error, _ = dealt_run(tmp_path, set_up)
    assert isinstance(error, EvaluationError), repr(error)
    assert "scheduled times" in error.message and error.fields["slice"] == 0


def _slice_result(j: int, *, answered: int, cpu_s: float) -> bytes:
    """Slice ``j``'s result (of 2): its own scheduled times, the first ``answered`` of
    its queries answered 5 ms later, ``cpu_s`` of CPU time."""
    rec = RunRecord(n=N // 2, batch_size=1)
    rec.scheduled[:] = rec.issued[:] = np.arange(j, N, 2) * 1000
    rec.completed[:answered] = rec.scheduled[:answered] + 5_000_000
    rec.ok[:answered] = 1
    rec.cpu_s = cpu_s
    buf = io.BytesIO()
    save_result(rec, buf)
    return buf.getvalue()


def run_reporting(tmp_path: Path, says: dict[str, Any]) -> RunRecord | BaseException:
    """A run over two services whose results hold 3 of 4 answered and 0.25 s of CPU
    each; service ``evil`` reports ``says`` in its LoadgenDone. The merged record, or
    the run's error."""

    async def honest(op: dict[str, Any], obs: Any) -> str:
        j = int(str(op["result_object"]).rsplit("-", 1)[1])
        await obs.put(op["result_object"], _slice_result(j, answered=3, cpu_s=0.25))
        return str(op["result_object"])

    async def set_up(sb: busmod.Bus, obs: Any) -> None:
        held = {"queries": N // 2, "completed": 3, "cpu_s": 0.25}
        await _service(sb, "good", honest, obs, says=held)
        await _service(sb, "evil", honest, obs, says={**held, **says})

    return dealt_run(tmp_path, set_up)[0]


def test_a_service_whose_counts_are_its_results_runs_and_shows_them(tmp_path: Path) -> None:
    rec = run_reporting(tmp_path, {})
    assert isinstance(rec, RunRecord), repr(rec)
    assert rec.cpu_s == 0.5 and int(np.count_nonzero(rec.completed)) == 6
    assert [(s["queries"], s["completed"], s["cpu_s"]) for s in rec.sources] == [(4, 3, 0.25)] * 2


@pytest.mark.parametrize(
    "says",
    [
        {"completed": N // 2},
        {"completed": 0},
        {"queries": N // 2 - 1},
        {"cpu_s": 0.0},
        {"cpu_s": 7.5},
    ],
)
def test_a_service_whose_counts_are_not_its_results_is_refused(
    tmp_path: Path, says: dict[str, Any]
) -> None:
    """The LoadgenDone a service answers with is shown (``loadgen_cost.services``) beside
    the arrays its result holds: a service that says 4 of 4 answered, or no CPU time,
    where its arrays hold 3 and 0.25 s, is refused naming it."""
    error = run_reporting(tmp_path, says)
    assert isinstance(error, WireError), repr(error)
    assert "load-generator service evil reported" in error.message, error.message
    assert error.fields["loadgen_id"] == "evil"


def test_a_progress_note_past_any_run_is_not_shown(tmp_path: Path) -> None:
    """While its slice runs, service ``evil`` reports 2**64 - 1 queries done on its
    progress subject: the server's progress (what the submitter is shown) never counts
    more queries than the run has; the run ends as its results say."""
    shown: list[int] = []
    ticks = anyio.Event()

    async def on_progress(rec: RunRecord, _elapsed_s: float) -> None:
        shown.append(rec.done)
        if len(shown) >= 3:
            ticks.set()

    async def set_up(sb: busmod.Bus, obs: Any) -> None:
        async def honest(op: dict[str, Any], obs: Any) -> str:
            j = int(str(op["result_object"]).rsplit("-", 1)[1])
            await obs.put(op["result_object"], _slice_result(j, answered=N // 2, cpu_s=0.0))
            return str(op["result_object"])

        async def boasting(op: dict[str, Any], obs: Any) -> str:
            note = {"kind": "loadgen-progress", "run_id": op["run_id"]}
            note |= {"result_object": op["result_object"], "done": 2**64 - 1}
            await sb.nc.publish(names.loadgen_progress("evil"), codec.encode(note))
            await sb.nc.flush()
            shown.clear()
            await ticks.wait()  # reports made after the note was heard
            return await honest(op, obs)

        await _service(sb, "good", honest, obs)
        await _service(sb, "evil", boasting, obs)

    rec, _ = dealt_run(tmp_path, set_up, on_progress)
    assert isinstance(rec, RunRecord), repr(rec)
    assert len(shown) >= 3 and max(shown) <= N, shown
