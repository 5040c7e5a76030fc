"""An agent's local run (placement agent) on the real executor and digits_cnn ONNX
model: open and closed loops, how their inputs are built or gathered, the outstanding
and byte bounds, rows shipped past queries held back, a bus that takes none of them,
and a released evaluation's queued queries."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from typing import ClassVar

import numpy as np
import pytest

from agent.pipeline import Executor, ExecutorConfig
from agent.worker import LoadedModel
from tests.pipeline_fixtures import Slow, expected, local_run, ran_locally

pytestmark = pytest.mark.timeout(120)


def test_a_closed_loop_query_taken_late_still_ends_the_run_answered(
    model: LoadedModel, samples: np.ndarray
) -> None:
    """Closed-loop streams take query indices on several threads (the run's own, and
    the predict thread as each answer chains the next). A query whose index was taken
    but which reaches the executor after every other query was answered still counts:
    the run ends with it answered, not 'lost in transit'."""
    from mlscope.contracts import ScenarioSpec
    from mlscope.samples import QueryRows, SampleOrder

    main = threading.current_thread()
    pre: np.ndarray = model.pre[0](samples[:4])

    class Late(QueryRows):
        def __call__(self, i: int) -> np.ndarray:
            if i == 1 and threading.current_thread() is main:
                time.sleep(0.3)  # descheduled between taking the index and submitting it
            return pre

    inputs = Late(pre, SampleOrder(4, 0), threading.Lock(), 4)
    spec = ScenarioSpec(
        name="concurrency",
        batch_size=4,
        concurrency=3,
        max_queries=8,
        duration_s=30,
        min_duration_s=0,
        min_queries=1,
    )
    ex = Executor(model, ExecutorConfig(pre_workers=0))
    run = local_run(ex, spec, inputs)
    try:
        run.prepare()
        run.run()
        rec = run.rec  # as the run left it when it returned (the agent ships it then)
        completed, ok, errors = rec.completed.copy(), rec.ok.copy(), dict(rec.errors)
    finally:
        ex.stop()
    assert rec.n == 8 and run.issued == 8
    assert errors == {}
    assert (ok == 1).all() and (completed > 0).all(), completed
    assert completed[1] > completed[[0, 2, 3, 4, 5, 6, 7]].max()  # answered last


@pytest.mark.parametrize(("inline_us", "where"), [(1_000_000, "mlscope-pacer"), (0, "infer-")])
def test_an_open_loop_in_the_agent_answers_fast_queries_on_the_pacer_thread(
    model: LoadedModel, samples: np.ndarray, inline_us: int, where: str
) -> None:
    """A fast model's queries are answered where the pacer issues them (no wake-up of
    the predict thread and back), as the agent's edge answers one off the bus; a model
    over the executor's inline limit is handed to the predict thread."""
    from mlscope import samples as samplesmod
    from mlscope.contracts import ScenarioSpec

    seen: list[str] = []

    class Where(Slow):
        def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
            seen.append(threading.current_thread().name)
            return super().predict(inputs)

    model.predictor = Where(model.predictor)
    inputs, _ = samplesmod.feed(model.pre[0](samples), None, 1, 0)
    spec = ScenarioSpec(
        name="constant", qps=200, duration_s=0.3, batch_size=1, min_duration_s=0, min_queries=1
    )
    ex = Executor(model, ExecutorConfig(pre_workers=0, inline_max_us=inline_us))
    run = local_run(ex, spec, inputs)
    try:
        run.prepare()  # two probe queries, through the predict thread
        probes = len(seen)
        run.run()
    finally:
        ex.stop()
    n = len(run.rec.ok)
    assert n == 60 and (run.rec.ok == 1).all() and run.rec.done == n
    assert len(seen) == probes + n
    assert all(name.startswith(where) for name in seen[probes:]), set(seen[probes:])


@pytest.mark.parametrize("prebuilt", [True, False])
def test_an_overloaded_open_loop_in_the_agent_holds_no_more_inputs_than_its_bound(
    model: LoadedModel, samples: np.ndarray, monkeypatch: pytest.MonkeyPatch, prebuilt: bool
) -> None:
    """While the model answers nothing, the queries of a run in the agent past the
    executor's byte bound are refused as overloaded (recorded, the run goes on) instead
    of piling up to ``capacity``; a run too large to build its inputs ahead gathers
    none for a query the executor would refuse."""
    from agent import localrun
    from mlscope import samples as samplesmod
    from mlscope.contracts import ScenarioSpec

    class Counted(samplesmod.QueryRows):
        gathered = 0

        def __call__(self, i: int) -> np.ndarray:
            Counted.gathered += 1
            return super().__call__(i)

    if not prebuilt:
        monkeypatch.setattr(localrun, "PREBUILD_BYTES", 0)
    slow = Slow(model.predictor)
    model.predictor = slow
    held, _ = samplesmod.feed(model.pre[0](samples), None, 4, 0)
    inputs = Counted(held.a, held.order, held.lock, held.batch)
    spec = ScenarioSpec(
        name="constant", qps=200, duration_s=0.3, batch_size=4, min_duration_s=0, min_queries=1
    )
    bound = 3 * inputs(0).nbytes
    ex = Executor(model, ExecutorConfig(pre_workers=0, inline_max_us=0, inflight_bytes=bound))
    run = local_run(ex, spec, inputs)
    try:
        run.prepare()
        before = Counted.gathered
        slow.gate.clear()  # nothing is answered until the schedule is over
        opener = threading.Timer(spec.duration_s + 0.3, slow.gate.set)
        opener.start()
        run.run()
        opener.join()
    finally:
        ex.stop()
    rec = run.rec
    n = len(rec.ok)
    assert n == 60 and int(rec.ok.sum()) == 3, (n, int(rec.ok.sum()))
    assert int(rec.refused.sum()) == n - 3 and (rec.issued > 0).all()
    assert set(rec.errors.values()) == {"overloaded"}
    assert Counted.gathered - before == (0 if prebuilt else 3)
    _, _, shipped = run.take(final=True)
    assert len(shipped) == n - 3 and rec.errors == {}  # a shipped row's error leaves it


@pytest.mark.parametrize("pre_workers", [0, 2])
def test_an_open_loop_too_large_to_build_ahead_gathers_each_query_in_the_executor(
    model: LoadedModel, samples: np.ndarray, monkeypatch: pytest.MonkeyPatch, pre_workers: int
) -> None:
    """A run in the agent whose inputs are not built ahead has the executor gather each
    query's batch, as the query's pre-processing: the pacer's thread copies nothing, so
    a large batch's copy (here a gather slowed to 20 ms) is the query's own time, not
    the issue lag of the queries due after it. Each answer is its own samples'."""
    from agent import localrun
    from mlscope import samples as samplesmod
    from mlscope.contracts import ScenarioSpec

    class Gathered(samplesmod.QueryRows):
        on: ClassVar[list[int]] = []

        def __call__(self, i: int) -> np.ndarray:
            Gathered.on.append(threading.get_native_id())
            time.sleep(0.02)
            return super().__call__(i)

    monkeypatch.setattr(localrun, "PREBUILD_BYTES", 0)
    held, _ = samplesmod.feed(model.pre[0](samples), None, 4, 0)
    inputs = Gathered(held.a, held.order, held.lock, held.batch)
    spec = ScenarioSpec(
        name="constant", qps=20, duration_s=0.5, batch_size=4, min_duration_s=0, min_queries=1
    )
    wants = [samplesmod.top1(expected(model, samples[held.order.rows(i, 4)])) for i in range(10)]
    ex = Executor(model, ExecutorConfig(pre_workers=pre_workers, inline_max_us=0))
    run = local_run(ex, spec, inputs)
    try:
        run.prepare()
        before = len(Gathered.on)
        run.run()
        executor_threads = set(ex.thread_ids())
    finally:
        ex.stop()
    rec = run.rec
    n = len(rec.ok)
    assert n == 10 and (rec.ok == 1).all() and rec.done == n
    assert len(Gathered.on) - before == n
    assert set(Gathered.on[before:]) <= executor_threads
    assert float(np.median(rec.issued - rec.paced)) < 10e6  # the 20 ms gather is not in it
    assert ((rec.predict_start - rec.agent_received) >= 20e6).all()  # it is the query's
    for i, want in enumerate(wants):
        assert want is not None
        assert run.top1[i, : len(want)].tolist() == want.tolist(), i


def test_an_open_loop_ships_its_rows_past_those_the_outstanding_bound_held_back(
    model: LoadedModel, samples: np.ndarray
) -> None:
    """Queries the outstanding bound held back are never answered: rows ship past them
    while the run goes on (every row up to the last issued one), not all at its end. An
    overloaded fast run held every later row, then shipped hundreds of MB at once, more
    than the server's subscription holds, and its final rows were dropped."""
    from mlscope import samples as samplesmod
    from mlscope.contracts import ScenarioSpec

    model.predictor = Slow(model.predictor, sleep_s=0.02)
    inputs, _ = samplesmod.feed(model.pre[0](samples), None, 1, 0)
    spec = ScenarioSpec(
        name="constant",
        qps=200,
        duration_s=0.3,
        max_outstanding=1,
        min_duration_s=0,
        min_queries=1,
    )
    run = ran_locally(model, spec, inputs)
    rec = run.rec
    issued = np.flatnonzero(rec.issued)
    assert 2 <= len(issued) < 30 and (rec.issued[: issued[-1]] == 0).any()  # some held back
    first, cols, _ = run.take()
    assert first == 0 and len(cols["ok"]) == issued[-1] + 1  # past every one held back
    assert (cols["completed"][issued] > 0).all()


def test_rows_the_bus_takes_none_of_are_given_up_with_the_reason_logged(
    model: LoadedModel,
    samples: np.ndarray,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A shipment of rows the bus takes nothing of within the ship timeout is given up:
    the run still ends (its rows not sent), and the agent logs how many messages it
    did not send and why, besides the gap the server sees."""
    import contextlib

    import anyio

    from agent import runrows
    from mlscope import samples as samplesmod
    from mlscope.contracts import RunOp, ScenarioSpec

    monkeypatch.setattr(runrows, "SHIP_TIMEOUT_S", 0.2)
    inputs, _ = samplesmod.feed(model.pre[0](samples), None, 1, 0)
    spec = ScenarioSpec(name="constant", qps=100, duration_s=0.4, min_duration_s=0, min_queries=1)
    req = RunOp(evaluation_id="ev-000000000001", scenario=spec, trace_level="none")
    ex = Executor(model, ExecutorConfig(pre_workers=0))
    run = local_run(ex, spec, inputs)

    async def stuck(data: bytes, wait: bool) -> None:  # a bus that takes nothing
        await anyio.sleep(3600)

    async def main() -> None:
        run.prepare()
        with anyio.fail_after(20):
            await runrows.serve_run(
                run, req, stuck, "agent a", held=contextlib.ExitStack(), max_bytes=1 << 20
            )

    try:
        with caplog.at_level("ERROR", logger="mlscope.agent"):
            anyio.run(main)
    finally:
        ex.stop()
    given_up = [r.message for r in caplog.records if "rows messages not sent" in r.message]
    assert given_up and all("within 0.2 s" in m for m in given_up), given_up
    assert run.rec.done == len(run.rec.ok)  # the run itself ended


def test_a_local_runs_queued_queries_are_not_run_once_its_evaluation_is_released(
    model: LoadedModel, samples: np.ndarray
) -> None:
    """An overloaded open loop in the agent (200 QPS on a 20 ms model) holds a queue;
    when its evaluation is released (its job cancelled), what is queued is answered
    with an error, not predicted under the next evaluation."""
    from mlscope import samples as samplesmod
    from mlscope.contracts import ScenarioSpec

    slow = Slow(model.predictor, sleep_s=0.02)
    model.predictor = slow
    inputs, _ = samplesmod.feed(model.pre[0](samples), None, 1, 0)
    spec = ScenarioSpec(
        name="constant", qps=200, duration_s=0.6, batch_size=1, min_duration_s=0, min_queries=1
    )
    released = threading.Event()
    ex = Executor(model, ExecutorConfig(pre_workers=0, inline_max_us=0, max_batch=1))
    run = local_run(ex, spec, inputs, released)
    try:
        run.prepare()
        runner = threading.Thread(target=run.run)
        runner.start()
        time.sleep(0.8)  # the schedule is over; dozens of queries wait in the queue
        released.set()
        at_release = len(slow.batches)
        runner.join(30)
        after = len(slow.batches)
    finally:
        ex.stop()
    dropped = [m for m in run.rec.errors.values() if "released" in m]
    assert after - at_release <= 1, (at_release, after)
    assert len(dropped) >= 20, run.rec.errors
    assert len(dropped) + int(run.rec.ok.sum()) == run.issued


def test_the_final_take_reads_an_open_loop_record_that_its_threads_are_completing() -> None:
    """An open loop's threads complete queries without the record's lock (its record
    never grows). The final take of an overloaded run (millions of rows, answers
    still landing) must ship them, not fail because a count changed under it: the
    agent then shipped nothing, and the server waited out its limit for the rows."""
    from agent.localrecord import LocalRecord
    from mlscope.contracts import ScenarioSpec
    from mlscope.schedule import constant

    n = 2_000_000

    class Overloaded(LocalRecord):
        def __init__(self) -> None:
            self.spec = ScenarioSpec(
                name="constant", qps=1e6, duration_s=n / 1e6, min_duration_s=0, min_queries=1
            )
            self.closed = False
            self.schedule = constant(1e6, duration_s=n / 1e6)
            super().__init__(len(self.schedule))

    record = Overloaded()
    completed = record.rec.completed
    stop = threading.Event()

    def answering() -> None:  # as executor threads complete queries, lock-free
        k = 0
        while not stop.is_set():
            completed[(k * 7919) % n] = k + 1
            k += 1

    writer = threading.Thread(target=answering)
    writer.start()
    try:
        takes = [record.take(final=True) for _ in range(20)]
    finally:
        stop.set()
        writer.join()
    assert [len(cols["completed"]) for _, cols, _ in takes] == [n] + [0] * 19


@pytest.mark.parametrize(
    ("scenario", "pre_workers", "inline_us", "timed"),
    [
        ("constant", 1, 0, False),
        ("constant", 1, 0, True),
        ("constant", 0, 1_000_000, False),
        ("concurrency", 1, 0, False),
        ("batched", 0, 0, False),
    ],
)
def test_an_executor_keeps_nothing_of_a_run_that_has_ended(
    model: LoadedModel,
    samples: np.ndarray,
    scenario: str,
    pre_workers: int,
    inline_us: int,
    timed: bool,
) -> None:
    """An agent keeps a model's executor for the evaluations that follow. Once a run
    has ended, nothing of it may stay reachable from the executor's threads (predict,
    pre-processing): its last query's reply is the run's own method, which holds its
    schedule, its record and its samples (gigabytes for images), memory the agent's
    sample budget has already given back and the next evaluation's memory figures
    would count. ``timed``: samples pre-processed in each query, by the pool."""
    from mlscope import samples as samplesmod
    from mlscope.contracts import ScenarioSpec

    inputs, _ = samplesmod.feed(samples if timed else model.pre[0](samples), None, 1, 5)
    if timed:  # a busy predict thread: the pool pre-processes the queries behind it
        model.predictor = Slow(model.predictor, sleep_s=0.004)
    spec = ScenarioSpec(
        name=scenario,
        qps=400,
        concurrency=2,
        max_queries=120,
        duration_s=0.3,
        min_duration_s=0,
        min_queries=1,
    )
    ex = Executor(model, ExecutorConfig(pre_workers=pre_workers, inline_max_us=inline_us))
    try:
        run = local_run(ex, spec, inputs, preprocessed=not timed)
        run.prepare()
        run.run()
        assert run.rec.done > 0 and (run.rec.ok == 1).all()
        gone = weakref.ref(run)
        gc.disable()  # freed as soon as it is dropped, not by the next full GC
        del run, inputs
        time.sleep(0.2)  # the executor's threads back to waiting for the next query
        assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]
    finally:
        gc.enable()
        ex.stop()
