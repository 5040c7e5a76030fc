"""Runs served over the load generator's query link, on a real nats-server: a served
run survives hostile replies in its inbox and takes answers that are no class index,
records what a bus outage kept it from sending; a closed loop sends each query on an
answer and ends when answers stop."""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgpack
import nats
import numpy as np
import pytest

from broker import loadgen
from broker.loadgen import Driver
from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import codec, names, wire
from mlscope.contracts import QueryReply, ScenarioSpec, TraceLevel
from mlscope.errors import EvaluationError
from mlscope.natsserver import NatsServer, free_port
from mlscope.settings import Settings
from mlscope.tuning import ProcessTuning
from tests.loadgen_fixtures import noop_prepared, one_sample, open_loop

pytestmark = pytest.mark.timeout(120)

SUBJECT = "test.served"


def _noop_driver(
    bus: busmod.Bus,
    agent_id: str,
    evaluation_id: str,
    n_s: float,
    inputs: Callable[[int], np.ndarray] = one_sample,
) -> Driver:
    subject = names.agent_query(agent_id)
    return open_loop(bus, evaluation_id, subject, qps=300, duration_s=n_s, seed=5, inputs=inputs)


def test_a_served_run_survives_hostile_replies_in_its_inbox(noop_stack: Stack) -> None:
    """Wrong types, out-of-range and foreign indices, deep nesting, a huge reply and
    plain garbage land in the run's inbox beside the agent's answers: each is skipped
    or ignored, and every real query is answered once, with its own times."""
    deep: Any = 1
    for _ in range(200):
        deep = [deep]
    hostile = [
        b"\xc1garbage",
        codec.encode({"kind": "reply", "index": "seven", "ok": True}),
        codec.encode({"kind": "reply", "index": 2**64 - 1, "ok": True}),
        codec.encode({"kind": "reply", "index": -3, "ok": True}),
        codec.encode({"kind": "error", "error": {"fields": {"index": "x"}}}),
        codec.encode({"kind": "error", "error": "not a mapping"}),
        codec.encode({"kind": "reply", "index": 0, "ok": True, "t_received": "late"}),
        msgpack.packb(deep),
        codec.encode({"kind": "reply", "index": 1, "ok": True, "pad": b"x" * (900 << 10)}),
        codec.encode([1, 2, 3]),
    ]

    async def go() -> Any:
        async with busmod.connect(noop_stack.settings, name="test hostile") as bus:
            async with noop_prepared(bus, "ev-hostile") as agent_id:
                driver = _noop_driver(bus, agent_id, "ev-hostile", 1.5)
                async with anyio.create_task_group() as tg:

                    async def attack() -> None:
                        await anyio.sleep(0.3)
                        for _ in range(5):
                            for data in hostile:
                                await bus.nc.publish(driver.inbox, data)
                            await anyio.sleep(0.1)

                    tg.start_soon(attack)
                    rec = await driver.run()
            return rec

    rec = anyio.run(go, backend="asyncio")
    assert rec.ok.all() and not rec.errors and rec.done == rec.n
    assert (rec.completed > rec.issued).all() and (rec.issued >= rec.scheduled).all()
    assert (rec.predict_end >= rec.predict_start).all()


def test_a_served_run_takes_answers_whose_outputs_are_no_class_index(noop_stack: Stack) -> None:
    """The noop model answers with its inputs: a first output value that is no class
    index (too large for one, not a number, infinite) is no prediction, and the query
    is answered like any other (it used to stay marked answered but never completed,
    its latency then counted from a completion time of 0)."""
    firsts = np.array([1e10, np.nan, np.inf, -1e10, 2.0**31, 7.0], np.float32)

    def inputs(g: int) -> np.ndarray:
        x = np.zeros((1, 4), np.float32)
        x[0, 0] = firsts[g % len(firsts)]
        return x

    async def go() -> Any:
        async with busmod.connect(noop_stack.settings, name="test outputs") as bus:
            async with noop_prepared(bus, "ev-outputs") as agent_id:
                driver = _noop_driver(bus, agent_id, "ev-outputs", 0.5, inputs)
                rec = await driver.run()
            return rec

    rec = anyio.run(go, backend="asyncio")
    assert rec.n > len(firsts) and rec.done == rec.n and rec.ok.all(), rec.errors
    assert (rec.completed > rec.issued).all()
    want = np.where(np.arange(rec.n) % len(firsts) == len(firsts) - 1, 7, -1)
    assert rec.prediction.tolist() == want.tolist()


def test_an_agent_answers_no_query_whose_reply_subject_is_no_inbox(noop_stack: Stack) -> None:
    """A query whose reply subject is a subject of the stack (a job's events) or a
    registry key is refused before it runs: nothing lands on either (the agent may
    write registry keys), and the same query with an inbox is answered."""
    spy = "mlscope.job.deputy.events"

    async def go() -> tuple[list[bytes], bool, Any]:
        async with busmod.connect(noop_stack.settings, name="test deputy") as bus:
            async with noop_prepared(bus, "ev-deputy") as agent_id:
                landed: list[bytes] = []

                async def heard(m: Any) -> None:
                    landed.append(m.data)

                await bus.nc.subscribe(spy, cb=heard)
                subject = names.agent_query(agent_id)
                query = wire.encode_query("ev-deputy", 0, one_sample(0), 0)
                for reply in (spy, f"$KV.{names.AGENTS_BUCKET}.deputy"):
                    await bus.nc.publish(subject, query, reply=reply)
                await bus.nc.flush()
                answered = await bus.nc.request(subject, query, timeout=10)
                await anyio.sleep(1.0)  # anything misdirected has landed by now
                registry = await bus.js.key_value(names.AGENTS_BUCKET)
                written = await busmod.if_found(registry.get("deputy")) is not None
            return landed, written, wire.read_reply(answered.data)

    landed, written, answered = anyio.run(go, backend="asyncio")
    assert landed == [] and not written
    assert answered.ok and answered.index == 0


def test_a_runs_queries_are_encoded_off_the_event_loop(noop_stack: Stack) -> None:
    """Every query's bytes are built before the clock starts; millions of them take
    the better part of a minute, during which the event loop must go on (a job's
    lease, pings, a cancel): they are built on worker threads, and each query is
    answered as usual."""
    loop_threads: set[int] = set()
    built_on: set[int] = set()

    def inputs(g: int) -> np.ndarray:
        built_on.add(threading.get_ident())
        return one_sample(g)

    async def go() -> Any:
        loop_threads.add(threading.get_ident())
        async with busmod.connect(noop_stack.settings, name="test frames") as bus:
            async with noop_prepared(bus, "ev-frames") as agent_id:
                driver = _noop_driver(bus, agent_id, "ev-frames", 0.5, inputs)
                rec = await driver.run()
            return rec

    rec = anyio.run(go, backend="asyncio")
    assert rec.n > 100 and rec.done == rec.n and rec.ok.all(), rec.errors
    assert built_on and not built_on & loop_threads


def test_a_run_whose_progress_report_fails_goes_on_and_says_so(
    noop_stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    """A progress figure that raises (of any type) every time it is computed is
    logged once as an error, and the run is measured to its end, reported on."""
    calls: list[int] = []

    async def failing(rec: Any, _elapsed_s: float) -> None:
        calls.append(rec.done)
        raise IndexError("a figure computed from a half-grown record")

    async def go() -> Any:
        async with busmod.connect(noop_stack.settings, name="test progress") as bus:
            async with noop_prepared(bus, "ev-progress") as agent_id:
                subject = names.agent_query(agent_id)
                driver = open_loop(
                    bus, "ev-progress", subject, qps=300, duration_s=1.6, on_progress=failing
                )
                rec = await driver.run()
            return rec

    with caplog.at_level(logging.DEBUG, logger="mlscope.loadgen"):
        rec = anyio.run(go, backend="asyncio")
    assert rec.n > 300 and rec.done == rec.n and rec.ok.all(), rec.errors
    assert len(calls) >= 3  # reported on after the first failure
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "progress report failed" in errors[0].getMessage()
    assert errors[0].exc_info is not None and errors[0].exc_info[0] is IndexError


@pytest.mark.integration  # a 5 s run through a nats-server killed and restarted
def test_a_run_through_a_bus_outage_records_what_it_could_not_send_and_goes_on(
    tmp_path: Path,
) -> None:
    srv = NatsServer(store_dir=tmp_path / "nats", port=free_port()).start()
    settings = Settings(nats_url=srv.url, data_dir=tmp_path / "data")

    down: list[int] = []  # when the server went down and came back (perf_counter_ns)

    def outage() -> None:
        down.append(time.perf_counter_ns())
        srv.kill()
        time.sleep(0.6)
        srv.start()
        down.append(time.perf_counter_ns())

    async def go() -> Any:
        async with (
            answering(srv.url, SUBJECT, first=10**6),
            busmod.connect(settings, name="test outage") as bus,
        ):
            driver = open_loop(bus, "ev-outage", SUBJECT, qps=200, duration_s=5, seed=2)
            threading.Timer(0.8, outage).start()
            return await driver.run()

    try:
        rec = anyio.run(go, backend="asyncio")
    finally:
        srv.stop()
    # Seconds of the schedule; the outage as it happened on the same clock.
    second = rec.scheduled / 1e9
    kill, back = ((t - rec.t0_ns) / 1e9 for t in down)
    assert back < 3.0, "the outage came too late in the run to test what follows it"
    assert rec.ok[second < kill - 0.05].all()  # before the outage
    unsent = [i for i, e in rec.errors.items() if e.startswith("not sent:")]
    assert unsent and all("unreachable" in rec.errors[i] for i in unsent)
    assert all(kill - 0.05 <= second[i] <= back + 1.0 for i in unsent)  # while it was down
    assert all(rec.completed[i] == 0 and rec.issued[i] > 0 for i in unsent)  # lost
    assert rec.ok[second > back + 1.5].all()  # the link and the agent came back
    assert rec.not_issued == 0


# ---------------------------------------------------------------- a closed loop


@asynccontextmanager
async def answering(
    url: str, subject: str, first: int, claims: dict[int, int] | None = None
) -> AsyncIterator[list[int]]:
    """An agent on the bus that answers the first ``first`` queries, then goes quiet;
    ``claims``: query index -> the span (ns) its answer claims, received that long
    before it replied (none otherwise)."""
    nc = await nats.connect(url, reconnect_time_wait=0.1, max_reconnect_attempts=-1)
    seen: list[int] = []

    async def on_query(msg: Any) -> None:
        query = wire.decode_query(msg.data)
        seen.append(query.index)
        if len(seen) <= first:
            t = time.perf_counter_ns()
            reply = QueryReply(
                index=query.index,
                ok=True,
                outputs=np.zeros((1, 2), np.float32),
                t_received=t - (claims or {}).get(query.index, 0),
                t_predict_start=t,
                t_predict_end=t,
                t_replied=t,
            )
            await msg.respond(wire.encode_reply(reply))

    await nc.subscribe(subject, cb=on_query)
    await nc.flush()
    try:
        yield seen
    finally:
        await nc.close()


def _closed_driver(
    bus: busmod.Bus,
    inputs: Any,
    *,
    evaluation_id: str = "ev-closed",
    subject: str = SUBJECT,
    duration_s: float = 30,
) -> Driver:
    return Driver(
        bus,
        evaluation_id=evaluation_id,
        subject=subject,
        spec=ScenarioSpec(name="concurrency", concurrency=3, duration_s=duration_s),
        inputs=inputs,
        labels=None,
        trace_level=TraceLevel.NONE,
        tuning=ProcessTuning(),
    )


def test_a_closed_loop_sends_each_query_on_an_answer_and_ends_when_answers_stop(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loadgen, "DRAIN_TIMEOUT_S", 0.5)
    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "data")

    async def go() -> tuple[Any, list[int]]:
        async with (
            answering(nats_server.url, SUBJECT, first=12) as seen,
            busmod.connect(settings, name="test closed loop") as bus,
        ):
            rec = await _closed_driver(bus, lambda g: np.zeros((1, 4), np.float32)).run()
            return rec, seen

    started = time.monotonic()
    rec, seen = anyio.run(go, backend="asyncio")
    assert time.monotonic() - started < 10  # ended by the stall, not by its 30 s
    assert seen == list(range(15)) and rec.n == 15  # 3 in flight + one per answer
    assert rec.ok[:12].all() and not rec.ok[12:].any() and (rec.completed[12:] == 0).all()
    # Three in flight at most: query i + 3 left only once query i was answered.
    assert (rec.issued[3:] >= rec.completed[:12]).all()
    assert (rec.completed[:12] > rec.issued[:12]).all()
    assert (rec.scheduled == rec.issued).all()


def test_an_answer_whose_agent_span_outlasts_its_round_trip_is_a_failed_query(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent that claims a 5 s compute for a query answered within ms: its times would
    make queueing, compute and the time the bus adds wrong, even negative. The query
    fails with the reason, keeps none of the agent's times, and the others count."""
    monkeypatch.setattr(loadgen, "DRAIN_TIMEOUT_S", 0.5)
    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "data")

    async def go() -> Any:
        async with (
            answering(nats_server.url, SUBJECT, first=12, claims={4: 5 * 10**9, 6: 10**9}),
            busmod.connect(settings, name="test closed loop") as bus,
        ):
            return await _closed_driver(bus, lambda g: np.zeros((1, 4), np.float32)).run()

    rec = anyio.run(go, backend="asyncio")
    for i in (4, 6):
        assert rec.ok[i] == 0 and rec.errors[i] == wire.AGENT_SPAN_TOO_LONG
        assert rec.completed[i] > 0 and rec.agent_received[i] == rec.agent_replied[i] == 0
    honest = [i for i in range(12) if i not in (4, 6)]
    assert rec.ok[honest].all() and not set(honest) & set(rec.errors)


def test_a_closed_loop_whose_inputs_fail_fails_with_their_error(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "data")

    def inputs(g: int) -> np.ndarray:
        if g == 7:  # sent from the reader thread, on the answer to query 4
            raise EvaluationError("sample 7 cannot be read")
        return np.zeros((1, 4), np.float32)

    async def go() -> None:
        async with (
            answering(nats_server.url, SUBJECT, first=100),
            busmod.connect(settings, name="test closed loop") as bus,
        ):
            await _closed_driver(bus, inputs).run()

    started = time.monotonic()
    with pytest.raises(BaseException) as caught:  # in the Driver's task group
        anyio.run(go, backend="asyncio")
    assert time.monotonic() - started < loadgen.DRAIN_TIMEOUT_S
    exc = caught.value
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    assert isinstance(exc, EvaluationError) and "sample 7" in str(exc), exc


@pytest.mark.parametrize("concurrency", [1024, 3000])
def test_a_closed_loop_that_outgrows_its_record_keeps_every_answer(
    nats_server: NatsServer, tmp_path: Path, concurrency: int
) -> None:
    """Many streams answered at once by an agent on another thread: the record grows
    while answers are written into it (the first queries go out from the event loop
    while the link's reader thread already writes answers and sends the next ones, so
    either thread may grow it), and no answer is lost to a growth: every query the run
    sent is answered in the record. (A write racing a growth is rare: this guards the
    rule rather than catching each break of it.)"""
    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "data")
    spec = ScenarioSpec(name="concurrency", concurrency=concurrency, duration_s=1.5)
    ready, done = threading.Event(), threading.Event()

    async def agent() -> None:  # another thread's loop: it answers during the first sends
        async with answering(nats_server.url, SUBJECT, first=10**9):
            ready.set()
            await anyio.to_thread.run_sync(done.wait)

    helper = threading.Thread(target=anyio.run, args=(agent,))
    helper.start()

    async def go() -> Any:
        async with busmod.connect(settings, name="test closed loop") as bus:
            driver = Driver(
                bus,
                evaluation_id="ev-grown",
                subject=SUBJECT,
                spec=spec,
                inputs=lambda g: np.zeros((1, 4), np.float32),
                labels=None,
                trace_level=TraceLevel.NONE,
                tuning=ProcessTuning(),
            )
            return await driver.run()

    try:
        assert ready.wait(10)
        rec = anyio.run(go, backend="asyncio")
    finally:
        done.set()
        helper.join(10)
    assert rec.n > concurrency  # it grew
    unanswered = np.flatnonzero(rec.completed[: rec.n] == 0)
    assert unanswered.size == 0, (unanswered[:10], rec.n)
    assert rec.ok[: rec.n].all() and rec.done == rec.n


def _noop_loop(
    bus: busmod.Bus, agent_id: str, evaluation_id: str, loop: str, duration_s: float
) -> Driver:
    """An open loop at 300 QPS or a closed loop of three queries in flight, to the
    stack's noop agent, for ``duration_s``."""
    subject = names.agent_query(agent_id)
    if loop == "open":
        return open_loop(bus, evaluation_id, subject, qps=300, duration_s=duration_s)
    return _closed_driver(
        bus, one_sample, evaluation_id=evaluation_id, subject=subject, duration_s=duration_s
    )


class _ThreadCpu:
    """Each thread's CPU time by name, read from ``/proc/self/task/*/schedstat`` every
    10 ms (a thread's last reading stands for its total): an independent measure of
    what the load generator's threads used."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[str, int]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="test-thread-cpu")

    def _run(self) -> None:
        while not self.stop.wait(0.01):
            names = {t.native_id: t.name for t in threading.enumerate()}
            for tid in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{tid}/schedstat") as fh:
                        ns = int(fh.read().split()[0])
                except (OSError, ValueError):
                    continue
                name = names.get(int(tid)) or self.last.get(int(tid), ("other", 0))[0]
                self.last[int(tid)] = (name, ns)

    def named(self, prefix: str) -> float:
        return sum(ns for name, ns in self.last.values() if name.startswith(prefix)) / 1e9


@pytest.mark.parametrize("loop", ["open", "closed"])
def test_a_runs_load_generator_cpu_is_its_own_threads_not_its_process(
    noop_stack: Stack, loop: str
) -> None:
    """The load generator's CPU time per query is reported as its cost, and warned
    about on the agent's host. Its process may be the server's, with an embedded
    database merging parts and other runs: that work is not the load generator's.
    Here another thread of the process hashes (without the GIL) through the run; the
    run's figure is what its own threads used, measured here from the kernel's
    per-thread accounting."""
    stop = threading.Event()
    burned: list[float] = []

    def burn() -> None:
        block, cpu0 = b"x" * (8 << 20), time.thread_time()
        while not stop.is_set():
            hashlib.sha256(block).digest()
        burned.append(time.thread_time() - cpu0)

    async def go() -> Any:
        async with (
            busmod.connect(noop_stack.settings, name="test loadgen cpu") as bus,
            noop_prepared(bus, "ev-cpu") as agent_id,
        ):
            return await _noop_loop(bus, agent_id, "ev-cpu", loop, 1.5).run()

    threads = _ThreadCpu()
    burner = threading.Thread(target=burn, name="test-burner")
    threads.thread.start()
    burner.start()
    try:
        rec = anyio.run(go, backend="asyncio")
    finally:
        stop.set()
        burner.join()
        threads.stop.set()
        threads.thread.join()
    assert rec.done > 100 and rec.ok[: rec.done].all(), rec.errors
    own = threads.named("mlscope-")  # the pacer and the query link's reader
    assert burned[0] > 0.5  # the process was busy besides the load generator
    assert own * 0.8 <= rec.cpu_s <= own + 0.1, (rec.cpu_s, own, burned)


@pytest.mark.parametrize("loop", ["open", "closed"])
def test_a_runs_record_is_freed_when_its_caller_drops_it(noop_stack: Stack, loop: str) -> None:
    """A run of a million queries records ~160 MB. Once the job has stored it and let
    go of it, it must be freed at once: the run's cancelled progress task leaves its
    load generator in a reference cycle (a traceback holds its frame), which only a
    full GC frees, and the server disables GC during every measurement. The record
    must not hang on to the load generator."""
    freed: list[bool] = []

    async def go() -> None:
        async with (
            busmod.connect(noop_stack.settings, name="test record freed") as bus,
            noop_prepared(bus, "ev-freed") as agent_id,
        ):
            driver = _noop_loop(bus, agent_id, "ev-freed", loop, 0.5)
            rec = await driver.run()
            assert rec.done > 10 and rec.ok[: rec.done].all(), rec.errors
            gone = weakref.ref(rec)
            gc.disable()
            try:
                del rec, driver
                await anyio.sleep(0.2)  # worker threads let go of their last call's arguments
                freed.append(gone() is None)
            finally:
                gc.enable()

    anyio.run(go, backend="asyncio")
    assert freed == [True]
