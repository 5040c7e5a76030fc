"""A local run's rows (placement agent) as the server takes them from an agent that
lies: rows that are not columns of numbers, rows that would make the server hold more
queries than any run may, times no clock produces, and an agent that keeps talking
without ever ending its run. Each is a typed error, a failed query or a given-up run;
the server never grows without bound nor waits forever."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import numpy as np
import pytest
from nats.aio.msg import Msg
from pydantic import ValidationError

from agent.runrows import rows_messages
from broker import agentrun
from broker.agentrows import OUTSIDE_RUN, RowCollector
from broker.agentrun import Absence, _collect, drive, gone
from broker.lgclock import estimate_offset
from mlscope import bus as busmod
from mlscope import codec, names, provision, scenario_traits, wire
from mlscope.contracts import (
    MAX_CLOCK_OFFSET_NS,
    MAX_SCHEDULED_QUERIES,
    PingOp,
    PingReply,
    PrepareReply,
    RunRows,
    RunStarted,
    ScenarioSpec,
    TraceLevel,
)
from mlscope.errors import EvaluationError, MLScopeError, WireError
from mlscope.natsserver import NatsServer
from mlscope.record import ARRAYS, RunRecord
from mlscope.schedule import build_schedule
from mlscope.settings import Settings
from tests.conftest import LOOSE, agent_description


def good_columns(n: int, start_ns: int = 1000) -> dict[str, np.ndarray]:
    """``n`` answered rows with times in the order they happen."""
    base = start_ns + np.arange(n, dtype=np.int64) * 100
    cols = {name: np.zeros(n, np.int64) for name in ARRAYS}
    for k, name in enumerate(
        ("scheduled", "paced", "issued", "agent_received", "predict_start", "predict_end")
    ):
        cols[name] = base + k
    cols["agent_replied"] = base + 7
    cols["completed"] = base + 8
    cols["ok"] = np.ones(n, np.uint8)
    cols["refused"] = np.zeros(n, np.uint8)
    cols["top1"] = np.zeros((n, 1), np.int32)
    return cols


MAX_BYTES = 64 * 1024
"""The largest rows message the tests' runs let an agent send."""


def collector() -> RowCollector:
    return RowCollector(
        RunRecord(n=4, batch_size=1), None, agent_description("rogue"), max_bytes=MAX_BYTES
    )


def rows(cols: dict[str, np.ndarray], start: int = 0, **extra: object) -> RunRows:
    fields: dict[str, object] = {"seq": 0, **extra}
    return RunRows(evaluation_id="ev-x", start=start, columns=cols, **fields)  # type: ignore[arg-type]


def test_honest_rows_are_taken_whole() -> None:
    got = collector()
    got.add(rows(good_columns(6)))
    assert got.rec.n >= 6 and got.answered() == 6 and got.rec.errors == {}


def test_the_final_rows_cpu_times_are_kept_in_the_record() -> None:
    """The load generator's CPU time is the record's ``cpu_s`` (what the summary's
    ``loadgen_cost`` reads in any placement), the agent process's beside it."""
    got = collector()
    got.add(
        last := rows(good_columns(3), final=True, queries=3, loadgen_cpu_s=0.25, process_cpu_s=2.5)
    )
    assert got.finish(last) == ()
    assert (got.rec.cpu_s, got.rec.process_cpu_s) == (0.25, 2.5)
    closed = collector()  # a closed loop's load generator is not told apart
    closed.add(last := rows(good_columns(2), final=True, queries=2, process_cpu_s=1.0))
    closed.finish(last)
    assert (closed.rec.cpu_s, closed.rec.process_cpu_s) == (0.0, 1.0)


def test_the_final_rows_moment_the_time_was_up_is_kept_in_the_record() -> None:
    """A closed loop's window lasts until it found its time up
    (:func:`broker.scenario.closed_window`): the agent's moment reaches the record."""
    got = collector()
    got.rec.t0_ns = time.perf_counter_ns() - 10_000_000_000  # the run began 10 s ago
    got.add(last := rows(good_columns(2), final=True, queries=2, time_up=10_000_123))
    got.finish(last)
    assert got.rec.time_up_ns == 10_000_123
    late = collector()  # a moment after its rows arrived (past the start timeout's leeway)
    late.rec.t0_ns = got.rec.t0_ns
    late.add(last := rows(good_columns(2), final=True, queries=2, time_up=3_600 * 10**9))
    late.finish(last)
    assert late.rec.time_up_ns == 0


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda c: {**c, "evil": np.zeros(3, np.int64)}, "unknown columns 'evil'"),
        (lambda c: {**c, "predict_end": c["predict_end"].astype(float)}, "'predict_end'"),
        (lambda c: {**c, "ok": np.ones((3, 2), np.uint8)}, "'ok' is not integers"),
        (lambda c: {**c, "issued": c["issued"][:2]}, "'issued' has 2 rows"),
        (lambda c: {**c, "top1": np.zeros(3, np.int32)}, "'top1' is not integers"),
        (lambda c: {**c, "scheduled": np.array(["a", "b", "c"])}, "'scheduled'"),
    ],
)
def test_rows_that_are_not_columns_of_numbers_are_a_typed_error(change, problem) -> None:  # type: ignore[no-untyped-def]
    got = collector()
    with pytest.raises(
        EvaluationError, match=f"agent rogue sent malformed local-run rows.*{problem}"
    ):
        got.add(rows(change(good_columns(3))))
    assert got.answered() == 0 and got.messages == 0


def test_a_top1_that_is_no_class_index_is_no_prediction() -> None:
    """An agent's top-1 column of int64 past int32 is no class (-1), not the value
    wrapped into int32 (2**40 read as class 0)."""
    got = collector()
    cols = good_columns(3)
    cols["top1"] = np.array([[2**40], [7], [-(2**40)]], np.int64)
    got.add(rows(cols))
    assert got.rec.prediction[:3].tolist() == [-1, 7, -1]


def test_rows_past_the_most_queries_a_run_holds_are_refused_before_any_memory() -> None:
    """A start near the bound with a few rows would make the record grow to it (GBs)."""
    got = collector()
    with pytest.raises(EvaluationError, match=f"rows past {MAX_SCHEDULED_QUERIES} queries"):
        got.add(rows(good_columns(3), start=MAX_SCHEDULED_QUERIES - 1))
    assert got.rec.n == 4
    with pytest.raises(ValidationError):
        rows(good_columns(3), start=10**12)


def test_rows_past_the_run_s_own_queries_fail_the_run_before_any_memory(tmp_path: Path) -> None:
    """An open loop's rows end with the schedule its agent announced (4 queries here):
    a row past it would make the record grow toward it (one row at query 49,999,999
    of a run of 4 took 2.6 GB), so the run fails naming the agent."""

    async def main() -> BaseException | None:
        async with server_and_agent(tmp_path) as (bus, agent_bus):
            sent = (
                rows(good_columns(2)),
                rows(good_columns(1), start=1000, seq=1),
                rows({}, seq=2, final=True, queries=4),
            )
            start = rogue_run(agent_bus, queries=4, sent=sent)
            spec = ScenarioSpec(name="online", qps=4, duration_s=1)
            return await drive_rogue(bus, agent_bus, start, spec)

    error = anyio.run(main)
    assert isinstance(error, EvaluationError), repr(error)
    assert "agent rogue sent malformed local-run rows: rows past 4 queries" in error.message


def test_rows_lost_on_the_bus_leave_a_gap_the_record_keeps() -> None:
    """A run's rows as an agent splits them (several messages a ship), one message lost
    on the bus: the others are taken where they belong, and the loss is the run's
    reason, not an error."""
    cols = good_columns(3000)
    sent = rows_messages(
        "ev-x", 0, cols, {}, seq=0, max_bytes=MAX_BYTES, issued=3000, final=True, queries=3000
    )
    assert len(sent) >= 3
    got = collector()
    for data in sent[:1] + sent[2:]:  # the second is lost
        got.add(codec.decode_model(RunRows, data))
    last = codec.decode_model(RunRows, sent[-1])
    assert got.finish(last) == (
        f"1 of {len(sent)} row messages of the local run were lost on the bus",
    )
    second = codec.decode_model(RunRows, sent[1])
    lost = slice(second.start, second.start + len(second.columns["ok"]))
    assert got.rec.n == 3000 and got.rec.ok.sum() == 3000 - (lost.stop - lost.start)
    assert not got.rec.ok[lost].any()


@pytest.mark.parametrize(
    ("hostile", "problem"),
    [
        # the next message far past the rows received, no message lost
        ({"start": 49_999_990, "seq": 1}, "rows from 49999990 after 4, past what 0 lost"),
        # a seq that claims a million lost messages, in the run's first moment
        ({"start": 40_000_000, "seq": 10**6}, "39999996 rows skipped in"),
        # a gap past what the one lost message could carry
        ({"start": 4 + 10**6, "seq": 2}, "rows from 1000004 after 4, past what 1 lost"),
    ],
)
def test_rows_past_a_gap_no_lost_message_leaves_are_refused_before_any_memory(
    hostile: dict[str, int], problem: str
) -> None:
    """An agent's rows grow the record to hold them: a start past the rows received
    that no lost message explains would make it hold millions of rows (GBs) from one
    message, so the run fails naming the agent, the record as it was."""
    got = collector()
    got.add(rows(good_columns(4)))
    with pytest.raises(
        EvaluationError, match=f"agent rogue sent malformed local-run rows: {problem}"
    ):
        got.add(rows(good_columns(1), **hostile))
    assert got.rec.n == 4 and got.answered() == 4


def test_a_closed_loop_s_rows_far_past_those_sent_fail_the_run(tmp_path: Path) -> None:
    """A closed loop without max_queries may hold MAX_SCHEDULED_QUERIES rows: an agent
    whose first rows message starts at query 49,999,990 fails the run, naming it,
    before the record grows to hold it (7.5 GB)."""

    async def main() -> BaseException | None:
        async with server_and_agent(tmp_path) as (bus, agent_bus):
            sent = (
                rows(good_columns(1), start=MAX_SCHEDULED_QUERIES - 10),
                rows({}, start=MAX_SCHEDULED_QUERIES - 9, seq=1, final=True, queries=1),
            )
            start = rogue_run(agent_bus, queries=0, sent=sent)

            spec = ScenarioSpec(name="concurrency", concurrency=1, duration_s=1)
            return await drive_rogue(bus, agent_bus, start, spec)

    error = anyio.run(main)
    assert isinstance(error, EvaluationError), repr(error)
    assert error.message.startswith("agent rogue sent malformed local-run rows: rows from")


@pytest.mark.parametrize(
    "fields",
    [
        {"issued": -1},
        {"queries": 10**12},
        {"not_issued": -5},
        {"time_up": -1},
        {"time_up": 2**63 - 1},
        {"process_cpu_s": float("nan")},
        {"process_cpu_s": -1.0},
        {"loadgen_cpu_s": float("inf")},
        {"loadgen_cpu_s": -1.0},
        {"errors": {-1: "x"}},
        {"errors": {10**12: "x"}},
        {"seq": -1},
    ],
)
def test_run_rows_refuse_counts_no_run_has(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        rows(good_columns(1), 0, **fields)


@pytest.mark.parametrize("fields", [{"queries": 10**12}, {"queries": -1}, {"t0_agent": -1}])
def test_a_run_start_refuses_a_schedule_no_run_has(fields: dict[str, int]) -> None:
    """The server sizes its record by ``queries``: 10**12 would be terabytes."""
    with pytest.raises(ValidationError):
        RunStarted(**{"t0_agent": 5, **fields})  # type: ignore[arg-type]


def test_answered_rows_with_impossible_times_count_as_failed() -> None:
    """The rule a served answer's times keep (``wire.agent_times_ordered``), row by row."""
    cols = good_columns(5)
    cols["predict_end"][1] = cols["predict_start"][1] - 10**9  # a negative compute
    cols["agent_received"][2] = cols["predict_start"][2] + 50  # a negative queueing
    cols["ok"][3] = 0  # a failed row's zeros are no lie
    cols["predict_start"][3] = cols["predict_end"][3] = 0
    cols["agent_received"][4] = -1  # in order, but before any monotonic clock's zero
    got = collector()
    got.add(rows(cols, errors={3: "boom"}))
    assert got.rec.ok[:5].tolist() == [1, 0, 0, 0, 0]
    assert got.rec.errors == {
        1: wire.DISORDERED_TIMES,
        2: wire.DISORDERED_TIMES,
        3: "boom",
        4: wire.DISORDERED_TIMES,
    }


def test_answered_rows_outside_their_run_count_as_failed() -> None:
    """Rows whose agent times are in order, but complete before they were due (a
    negative latency), before the agent replied, or years after the run began, are
    failed queries with the reason, not latencies; the honest row is kept."""
    got = collector()
    got.rec.t0_ns = time.perf_counter_ns()  # the run began now on the server's clock
    cols = good_columns(4)
    cols["completed"][1] = cols["scheduled"][1] - 1
    cols["completed"][2] = cols["agent_replied"][2] - 1
    cols["completed"][3] = 365 * 24 * 3600 * 10**9
    got.add(rows(cols))
    assert got.rec.ok.tolist() == [1, 0, 0, 0]
    assert got.rec.errors == dict.fromkeys((1, 2, 3), OUTSIDE_RUN)


def test_a_ramp_longer_than_its_duration_setting_is_awaited_to_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A piecewise (or replay) run lasts its segments' (or arrivals') own window, not
    ``duration_s``: the server awaits its agent that long, plus the drain and the
    slack. Judged by ``duration_s``, a 5-minute ramp in the agent was given up after
    70 s as an agent that 'did not finish its local run'."""
    monkeypatch.setattr(agentrun, "DRAIN_S", 0.2)
    monkeypatch.setattr(agentrun, "END_SLACK_S", 0.0)
    spec = ScenarioSpec(name="piecewise", duration_s=0.1, segments=((2.0, 2.0, 1.5),), **LOOSE)
    n = len(build_schedule(spec)[0])

    async def main() -> tuple[MLScopeError | None, list[str]]:
        async with server_and_agent(tmp_path) as (bus, agent_bus):

            async def start(msg: Msg) -> None:  # the ramp's rows come as it ends
                if codec.decode(msg.data).get("op") == "probe":
                    await msg.respond(b"\xc0")
                    return
                t0 = time.perf_counter_ns() + 50_000_000
                await msg.respond(codec.encode_model(RunStarted(t0_agent=t0, queries=n)))
                await anyio.sleep(1.2)
                last = rows(good_columns(n), final=True, queries=n)
                subject = names.agent_rows("rogue", "ev-x")
                await agent_bus.nc.publish(subject, codec.encode_model(last))

            reasons: list[str] = []
            error = await drive_rogue(bus, agent_bus, start, spec, reasons=reasons)
            return error, reasons

    error, reasons = anyio.run(main)
    assert error is None and not any("did not finish" in r for r in reasons), (error, reasons)


def test_an_agent_that_talks_but_never_ends_its_run_is_given_up(tmp_path: Path) -> None:
    """Rows every 50 ms, never a final one: the run's deadline still ends the wait."""

    async def main() -> tuple[str, ...]:
        with NatsServer(store_dir=tmp_path / "nats") as ns:
            settings = Settings(nats_url=ns.url, data_dir=tmp_path / "data")
            async with busmod.connect(settings, name="server") as bus:
                subject = names.agent_rows("rogue", "ev-x")
                sub = await bus.nc.subscribe(subject)
                payload = codec.encode_model(rows(good_columns(1)))

                async def chatter() -> None:
                    while True:
                        await bus.nc.publish(subject, payload)
                        await anyio.sleep(0.05)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(chatter)
                    with anyio.fail_after(20):  # the old wait never ended
                        reasons = await _collect(collector(), bus, sub, 1.0, None)
                    tg.cancel_scope.cancel()
                return reasons

    reasons = anyio.run(main)
    assert len(reasons) == 1 and "did not finish its local run within 1 s" in reasons[0]


@pytest.mark.parametrize(
    "reply",
    [
        {"kind": "prepared", "cold": "no", "t_agent": 0},  # no load times
        {"kind": "prepared", "cold": True, "load_ns": -1, "first_inference_ns": 0, "t_agent": 0},
        {"kind": "prepared", "cold": [1], "load_ns": 1, "first_inference_ns": 1, "t_agent": 0},
        [1, 2, 3],
    ],
)
def test_a_prepare_reply_that_is_not_one_is_a_typed_error_at_once(
    tmp_path: Path, reply: object
) -> None:
    """The server reads an agent's prepare reply where it arrives (before any load runs),
    not where a field of it is first used after the run."""

    async def main() -> None:
        with NatsServer(store_dir=tmp_path / "nats") as ns:
            settings = Settings(nats_url=ns.url, data_dir=tmp_path / "data")
            async with busmod.connect(settings, name="server") as bus:

                async def answer(msg: object) -> None:
                    await msg.respond(codec.encode(reply))  # type: ignore[attr-defined]

                await bus.nc.subscribe("prep.test", cb=answer)
                with pytest.raises(WireError, match="invalid PrepareReply"):
                    await busmod.request_model(bus, "prep.test", b"", PrepareReply, timeout=5)

    anyio.run(main)


def test_an_agent_is_gone_when_silent_or_another_process_answers_under_its_id(
    tmp_path: Path,
) -> None:
    """A run's agent is the process that was given it: an agent restarted under its id
    answers pings, yet knows nothing of the run (it would be awaited to the deadline)."""

    async def main() -> list[Absence]:
        async with server_and_agent(tmp_path) as (bus, agent_bus):
            await provision.ensure_infrastructure(bus)
            kv = await bus.kv(names.AGENTS_BUCKET)
            ran = agent_description("phoenix", pid=4242, started_at=5.0, heartbeat_at=time.time())
            seen = [await gone(bus, ran)]  # nobody answers under its id

            async def pong(msg: object) -> None:
                await msg.respond(codec.encode(PingReply(t_agent=1).dump()))  # type: ignore[attr-defined]

            await agent_bus.nc.subscribe(names.agent_ctl("phoenix"), cb=pong)
            await agent_bus.nc.flush()
            with anyio.fail_after(20):  # its interest reaches the server's connection
                while True:
                    try:
                        await busmod.request(
                            bus,
                            names.agent_ctl("phoenix"),
                            codec.encode_model(PingOp()),
                            timeout=2,
                        )
                        break
                    except MLScopeError:
                        await anyio.sleep(0.1)
            seen.append(await gone(bus, ran))  # answers; no registry entry to tell
            for entry in (
                ran,
                ran.model_copy(update={"pid": 4243}),
                ran.model_copy(update={"started_at": 6.0}),
            ):
                await kv.put("phoenix", codec.encode_model(entry))
                seen.append(await gone(bus, ran))
            return seen

    assert anyio.run(main) == ["silent", "", "", "restarted", "restarted"]


@asynccontextmanager
async def server_and_agent(tmp_path: Path) -> AsyncIterator[tuple[busmod.Bus, busmod.Bus]]:
    """A nats-server of the test's own, and a server's and an agent's connection to it."""
    with NatsServer(store_dir=tmp_path / "nats") as ns:
        settings = Settings(nats_url=ns.url, data_dir=tmp_path / "data")
        async with (
            busmod.connect(settings, name="server") as bus,
            busmod.connect(settings, name="agent") as agent_bus,
        ):
            yield bus, agent_bus


def rogue_run(
    agent_bus: busmod.Bus, *, queries: int, sent: tuple[RunRows, ...]
) -> Callable[[Msg], Awaitable[None]]:
    """The agent ``rogue``'s answer to its control requests (for :func:`drive_rogue`):
    a probe answered, a run started as one of ``queries`` (0: a closed loop), then
    ``sent`` published as its rows."""

    async def start(msg: Msg) -> None:
        if codec.decode(msg.data).get("op") == "probe":
            await msg.respond(b"\xc0")
            return
        t0 = time.perf_counter_ns() + 50_000_000
        await msg.respond(codec.encode_model(RunStarted(t0_agent=t0, queries=queries)))
        for one in sent:
            await agent_bus.nc.publish(names.agent_rows("rogue", "ev-x"), codec.encode_model(one))

    return start


async def drive_rogue(
    bus: busmod.Bus,
    agent_bus: busmod.Bus,
    start: Callable[[Msg], Awaitable[None]],
    spec: ScenarioSpec,
    *,
    reasons: list[str] | None = None,
) -> MLScopeError | None:
    """``drive`` a run of ``spec`` in the agent ``rogue``, whose control requests
    ``start`` answers (a probe among them): the typed error the run ended with, or None
    (its INVALID reasons then added to ``reasons``). The load lasts the scenario's own
    window, as the server computes it."""
    await agent_bus.nc.subscribe(names.agent_ctl("rogue"), cb=start)
    await agent_bus.nc.flush()
    await heard(bus, names.agent_ctl("rogue"), codec.encode({"op": "probe"}))
    try:
        traits = scenario_traits.get(spec.name)
        _, why = await drive(
            bus,
            agent=agent_description("rogue"),
            evaluation_id="ev-x",
            spec=spec,
            load_s=spec.duration_s if traits.closed_loop else build_schedule(spec)[1],
            trace_level=TraceLevel.NONE,
            offset_ns=0,
            labels=None,
        )
    except MLScopeError as exc:
        return exc
    if reasons is not None:
        reasons += why
    return None


async def heard(bus: busmod.Bus, subject: str, payload: bytes) -> None:
    """Once a request on ``subject`` is answered: a responder's interest reaches the
    server's connection a moment after its own flush."""
    with anyio.fail_after(20):
        while True:
            try:
                await busmod.request(bus, subject, payload, timeout=2)
                return
            except MLScopeError:
                await anyio.sleep(0.1)


def test_an_agent_whose_clock_no_host_could_show_fails_the_estimate_naming_it(
    tmp_path: Path,
) -> None:
    """A ping answered with a clock near Int64's end is within the PingReply contract,
    yet its offset would move the run's times past the Int64 columns: the estimate is
    a WireError naming the agent's subject. A host booted a year before ours is fine."""

    async def main() -> tuple[int, BaseException | None]:
        async with server_and_agent(tmp_path) as (bus, agent_bus):
            ahead = {"honest": 365 * 24 * 3600 * 10**9, "rogue": 2**63 - 1}

            def pong(agent_id: str) -> Callable[[Msg], Awaitable[None]]:
                async def answer(msg: Msg) -> None:
                    t = ahead[agent_id] + (0 if agent_id == "rogue" else time.perf_counter_ns())
                    await msg.respond(codec.encode(PingReply(t_agent=t).dump()))

                return answer

            for agent_id in ahead:
                await agent_bus.nc.subscribe(names.agent_ctl(agent_id), cb=pong(agent_id))
                await heard(bus, names.agent_ctl(agent_id), codec.encode_model(PingOp()))
            offset, _ = await estimate_offset(bus, "honest", rounds=3)
            try:
                await estimate_offset(bus, "rogue", rounds=3)
            except MLScopeError as exc:
                return offset, exc
            return offset, None

    offset, error = anyio.run(main)
    assert abs(offset - 365 * 24 * 3600 * 10**9) < 10**9
    assert isinstance(error, WireError), repr(error)
    assert (
        names.agent_ctl("rogue") in error.message
        and error.fields["offset_ns"] > MAX_CLOCK_OFFSET_NS
    )


@pytest.mark.parametrize("t0_agent", [2**63 - 1, 5, 10**18])
def test_a_run_start_at_a_time_no_clock_showed_fails_the_run_naming_the_agent(
    tmp_path: Path, t0_agent: int
) -> None:
    """The agent's answer to a run request sets the run's offset 0 on the server's clock
    (its t0 less the measured offset): a t0 far from when it answered (past Int64 once
    moved, or years away) fails the run at once, before any row is awaited."""

    async def main() -> BaseException | None:
        async with server_and_agent(tmp_path) as (bus, agent_bus):

            async def start(msg: Msg) -> None:  # answers a run request (and a probe)
                op = codec.decode(msg.data).get("op")
                if op == "run":
                    await msg.respond(codec.encode_model(RunStarted(t0_agent=t0_agent)))
                elif op == "probe":
                    await msg.respond(b"\xc0")

            spec = ScenarioSpec(name="batched", duration_s=1)
            return await drive_rogue(bus, agent_bus, start, spec)

    error = anyio.run(main)
    assert isinstance(error, WireError), repr(error)
    assert "agent rogue started its run" in error.message and error.fields["agent_id"] == "rogue"
