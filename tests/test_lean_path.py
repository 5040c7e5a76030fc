"""The served query path's short cuts keep every number honest.

An idle executor answers a fast model's query on the caller's thread, replies go back
to the loop in bursts, and the load generator's pacer writes each query to its link
the moment it is due: never early, same answers.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest

from agent.job import Job
from agent.outbox import Outbox
from agent.pipeline import Executor, ExecutorConfig
from agent.worker import LoadedModel
from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import names, wire
from mlscope.contracts import QueryReply, TraceLevel
from mlscope.errors import ReplyTooLarge
from tests.loadgen_fixtures import noop_prepared, open_loop

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def samples(samples: np.ndarray) -> np.ndarray:
    """The first 8 of the shared held-out samples."""
    return samples[:8]


class Answers:
    """Replies with the thread each came from."""

    def __init__(self) -> None:
        self.got: list[tuple[QueryReply, int]] = []
        self.done = threading.Event()

    def __call__(self, r: QueryReply) -> None:
        self.got.append((r, threading.get_ident()))
        self.done.set()

    def wait(self) -> tuple[QueryReply, int]:
        assert self.done.wait(30)
        self.done.clear()
        return self.got[-1]


def _job(i: int, x: np.ndarray, answers: Answers, level: TraceLevel = TraceLevel.NONE) -> Job:
    return Job(
        index=i,
        inputs=x,
        received_ns=time.perf_counter_ns(),
        level=level,
        spans=None,
        reply=answers,
    )


def test_an_idle_executor_answers_a_fast_query_on_the_callers_thread(
    model: LoadedModel, samples: np.ndarray
) -> None:
    ex = Executor(model, ExecutorConfig(inline_max_us=10_000_000))
    answers = Answers()
    try:
        x = samples[:1]
        want = model.post(model.predictor.predict([model.pre[0](x)])[0])
        # Nothing measured yet: the first query goes to the predict thread.
        assert not ex.try_inline(_job(0, x, answers))
        assert ex.submit(_job(0, x, answers))
        first, tid = answers.wait()
        assert tid != threading.get_ident()
        # Now known to be fast and idle: answered here, before try_inline returns.
        assert ex.try_inline(_job(1, x, answers))
        second, tid = answers.got[-1]
        assert tid == threading.get_ident() and ex.inflight == 0
        for r in (first, second):
            assert r.ok and r.outputs is not None and np.array_equal(r.outputs, want)
            assert r.t_received <= r.t_predict_start <= r.t_predict_end <= r.t_replied
        # Framework level belongs to the predict thread (its profiler).
        assert not ex.try_inline(_job(2, x, answers, TraceLevel.FRAMEWORK))
    finally:
        ex.stop()


def test_no_inline_answer_while_a_query_is_in_flight_or_for_a_slow_model(
    model: LoadedModel, samples: np.ndarray
) -> None:
    gate = threading.Event()
    inner = model.predictor

    class Gated:
        framework, device = inner.framework, inner.device

        def predict(self, xs: list[np.ndarray]) -> list[np.ndarray]:
            gate.wait(30)
            out: list[np.ndarray] = inner.predict(xs)
            return out

        def close(self) -> None:
            inner.close()

    model.predictor = Gated()
    ex = Executor(model, ExecutorConfig(inline_max_us=10_000_000))
    answers = Answers()
    try:
        gate.set()
        assert ex.submit(_job(0, samples[:1], answers))
        answers.wait()
        gate.clear()
        assert ex.submit(_job(1, samples[:1], answers))  # held in predict
        assert not ex.try_inline(_job(2, samples[:1], answers))  # replies stay in order
        gate.set()
        answers.wait()
    finally:
        gate.set()
        ex.stop()
    slow = Executor(model, ExecutorConfig(inline_max_us=0))
    try:
        for i in range(2):
            assert slow.submit(_job(i, samples[:1], answers))
            answers.wait()
        assert not slow.try_inline(_job(3, samples[:1], answers))  # 0: never inline
    finally:
        slow.stop(close=False)


def test_the_outbox_sends_a_burst_in_order_after_one_wake_up() -> None:
    sent: list[tuple[str, bytes]] = []
    errors: list[tuple[BaseException, str]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()

        async def publish(subject: str, data: bytes) -> None:
            if data == b"bad":
                raise OSError("connection closed")
            sent.append((subject, data))

        box = Outbox(
            loop, publish, lambda exc, subject: errors.append((exc, subject)), max_bytes=1 << 20
        )
        drains = 0
        real = box._drain

        def counted() -> None:
            nonlocal drains
            drains += 1
            real()

        box._drain = counted  # type: ignore[method-assign]

        def producer() -> None:  # a predict thread, while the loop is busy elsewhere
            for i in range(100):
                box.put(f"r.{i % 3}", b"%d" % i)
            box.put("r.x", b"bad")

        t = threading.Thread(target=producer)
        t.start()
        t.join()  # the loop never ran meanwhile: everything is queued
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert drains == 1
        box.put("r.y", b"from the loop")
        await box.flush()  # an inline answer leaves at once
        assert sent[-1] == ("r.y", b"from the loop")
        await asyncio.sleep(0.01)  # the drain scheduled by that put finds nothing

    anyio.run(main, backend="asyncio")
    assert [d for _, d in sent[:100]] == [b"%d" % i for i in range(100)]
    assert sent[100:] == [("r.y", b"from the loop")]
    assert len(errors) == 1 and errors[0][1] == "r.x" and "connection closed" in str(errors[0][0])


def test_an_answer_too_large_for_the_bus_is_an_error_reply_naming_its_query() -> None:
    """The requester hears why at once, for that query, instead of timing out."""
    sent: list[tuple[str, bytes]] = []
    errors: list[tuple[BaseException, str]] = []

    async def main() -> None:
        async def publish(subject: str, data: bytes) -> None:
            sent.append((subject, data))

        box = Outbox(
            asyncio.get_running_loop(),
            publish,
            lambda exc, subject: errors.append((exc, subject)),
            max_bytes=10_000,
        )
        big = QueryReply(index=7, ok=True, outputs=np.zeros(5000, np.float32))
        small = QueryReply(index=8, ok=True, outputs=np.zeros(10, np.float32))
        box.put("r.big", wire.encode_reply(big))
        box.put("r.small", wire.encode_reply(small))
        await box.flush()

    anyio.run(main, backend="asyncio")
    assert [s for s, _ in sent] == ["r.big", "r.small"]
    refused, answered = (wire.read_reply(d) for _, d in sent)
    assert (refused.index, refused.ok) == (7, False) and "max payload" in refused.error
    assert (answered.index, answered.ok) == (8, True)
    assert len(sent[0][1]) < 10_000 and isinstance(errors[0][0], ReplyTooLarge)


def test_a_served_run_issues_from_the_pacers_thread_never_early(noop_stack: Stack) -> None:
    async def go() -> Any:
        async with busmod.connect(noop_stack.settings, name="test lead") as bus:
            async with noop_prepared(bus, "ev-lead") as agent_id:
                subject = names.agent_query(agent_id)
                driver = open_loop(bus, "ev-lead", subject, qps=500, duration_s=1.5, seed=3)
                rec = await driver.run()
            return rec

    rec = anyio.run(go, backend="asyncio")
    assert rec.ok.all() and rec.not_issued == 0
    assert (rec.issued >= rec.scheduled).all()  # never early
    assert (rec.paced == rec.issued).all()  # sent as stamped: no hop between
    assert (rec.completed > rec.issued).all()
    assert (rec.agent_received > rec.issued).all()  # clock offset within the same host
    assert rec.cpu_s > 0
