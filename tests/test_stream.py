"""A stream: an agent's batched run on held samples, run by the model's predict thread
itself (agent/stream.py) on the real digits_cnn ONNX model: order, outputs, errors per
query and per block, its own faults, spans, bounds, and the answering thread of a slow
model."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.pipeline import Executor, ExecutorConfig
from agent.tracer import SpanBuffer
from agent.worker import LoadedModel
from mlscope.contracts import ScenarioSpec, TraceLevel
from mlscope.errors import InferenceError
from mlscope.predictor import PredictorOptions
from tests.pipeline_fixtures import (
    POISON,
    Replies,
    Slow,
    digits_entry,
    expected,
    job,
    local_run,
    ran_locally,
)

pytestmark = pytest.mark.timeout(120)


class Stream:
    """A stream over a list of pre-processed queries (None in the list: raise there)."""

    def __init__(self, xs: list[np.ndarray | None], level: TraceLevel = TraceLevel.NONE) -> None:
        self.xs, self.level, self.k = xs, level, 0
        self.spans: SpanBuffer | None = SpanBuffer() if level >= TraceLevel.MODEL else None
        self.blocks: list[Any] = []
        self.threads: set[str] = set()
        self.answered_on: set[str] = set()
        self.answered_by: list[str] = []  # each block's answering thread
        self.fail_at = -1

    def next_query(self) -> tuple[int, np.ndarray] | None:
        self.threads.add(threading.current_thread().name)
        if self.k >= len(self.xs):
            return None
        x = self.xs[self.k]
        if x is None:
            raise RuntimeError("the stream's own fault")
        self.k += 1
        return self.k - 1, x

    def answered(self, block: Any) -> None:
        self.answered_on.add(threading.current_thread().name)
        self.answered_by.append(threading.current_thread().name)
        if len(self.blocks) == self.fail_at:
            raise RuntimeError("the stream's own fault in answering")
        self.blocks.append(block)


def streamed(model: LoadedModel, xs: list[np.ndarray | None]) -> Stream:
    """A stream over ``xs``, run to its end on a new executor of ``model``."""
    s = Stream(xs)
    ex = Executor(model)
    try:
        ex.stream(s, timeout=60)
    finally:
        ex.stop()
    return s


def test_a_stream_answers_every_query_in_order_on_the_predict_thread(
    model: LoadedModel, samples: np.ndarray
) -> None:
    """Batches back to back on the predict thread, answers post-processed in blocks:
    each query's output is what its own predict and post-processing give, its times in
    order; a query whose predict fails gets its typed error and the stream goes on."""
    slow = Slow(model.predictor)
    model.predictor = slow
    poisoned = samples[8:12].copy()
    poisoned[0, 0, 0] = POISON
    raws = [samples[4 * q : 4 * q + 4] for q in range(10)]
    raws[3] = poisoned
    xs: list[np.ndarray | None] = [model.pre[0](r) for r in raws]
    s = Stream(xs, TraceLevel.MODEL)
    want = np.concatenate([expected(model, raws[q]) for q in range(10) if q != 3])
    ex = Executor(model, ExecutorConfig(max_batch=8))
    try:
        ex.stream(s, timeout=60)
        after = Replies()
        ex.submit(job(99, samples[:1], after))  # the executor serves queries after it
        (r,) = after.take(1)
    finally:
        ex.stop()
    assert r.ok and r.index == 99
    assert s.threads == {f"infer-{model.name}"}
    assert slow.batches[:10] == [4] * 10  # one predict per query: never merged
    index = np.concatenate([b.index for b in s.blocks])
    assert (index == np.arange(10)).all()
    ok = np.concatenate([b.ok for b in s.blocks])
    assert ok.tolist() == [k != 3 for k in range(10)]
    errors = {int(b.index[k]): e for b in s.blocks for k, e in b.errors.items()}
    assert set(errors) == {3} and isinstance(errors[3], InferenceError)
    assert "poisoned" in str(errors[3])
    outputs = np.concatenate([b.outputs for b in s.blocks if b.outputs is not None])
    np.testing.assert_array_equal(outputs, want)
    for b in s.blocks:
        assert (b.received <= b.predict_start).all() and (b.predict_start <= b.predict_end).all()
        assert b.post_end >= b.predict_end.max()
    spans = s.spans.columns if s.spans is not None else {}
    assert len(spans["name"]) == 4 * 9  # query, preprocess, predict, postprocess: each ok one
    assert sorted(set(spans["query_index"])) == [q for q in range(10) if q != 3]


def test_a_stream_post_processes_in_blocks_and_isolates_a_failing_query(
    model: LoadedModel, samples: np.ndarray
) -> None:
    """A post-processing step that fails on one query's output fails the block's joined
    call; the block is then post-processed query by query, and only that query fails."""
    post = model.post
    bad = np.float32(1e30)

    class Marking(Slow):
        def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
            out = super().predict(inputs)
            if np.any(inputs[0][:, 0, 0, 0] == np.float32(7 / 16)):
                out = [np.full_like(out[0], bad)]
            return out

    def picky(x: np.ndarray) -> np.ndarray:
        if np.any(x == bad):
            raise ValueError("cannot rank these scores")
        got: np.ndarray = post(x)
        return got

    raws = [samples[2 * q : 2 * q + 2].copy() for q in range(6)]
    raws[4][1, 0, 0] = 7
    want = np.concatenate([expected(model, raws[q]) for q in range(6) if q != 4])
    model.predictor = Marking(model.predictor)
    model.post = picky
    s = streamed(model, [model.pre[0](r) for r in raws])
    assert any(len(b.index) > 1 for b in s.blocks)  # a small model's answers wait together
    ok = np.concatenate([b.ok for b in s.blocks])
    assert ok.tolist() == [q != 4 for q in range(6)]
    (err,) = [e for b in s.blocks for e in b.errors.values()]
    assert isinstance(err, InferenceError) and "cannot rank" in str(err)
    outputs = np.concatenate([b.outputs for b in s.blocks if b.outputs is not None])
    np.testing.assert_array_equal(outputs, want)


def test_a_streams_own_fault_is_raised_to_its_caller_and_the_executor_goes_on(
    model: LoadedModel, samples: np.ndarray
) -> None:
    x = model.pre[0](samples[:2])
    ex = Executor(model)
    replies = Replies()
    try:
        with pytest.raises(RuntimeError, match="own fault"):
            ex.stream(Stream([x, x, None, x]), timeout=60)
        with pytest.raises(InferenceError, match="below trace level framework"):
            ex.stream(Stream([x], TraceLevel.FRAMEWORK), timeout=60)
        ex.submit(job(0, samples[:2], replies))
        (r,) = replies.take(1)
    finally:
        ex.stop()
    assert r.ok


def test_queries_admitted_during_a_stream_are_answered_after_it(
    model: LoadedModel, samples: np.ndarray
) -> None:
    slow = Slow(model.predictor, sleep_s=0.01)
    model.predictor = slow
    x = model.pre[0](samples[:2])
    s = Stream([x] * 20)
    ex = Executor(model)
    replies = Replies()
    try:
        runner = threading.Thread(target=ex.stream, args=(s,), kwargs={"timeout": 60})
        runner.start()
        while not s.k:
            time.sleep(0.001)
        ex.submit(job(0, samples[:2], replies))  # while the stream runs
        (r,) = replies.take(1)
        runner.join(30)
    finally:
        ex.stop()
    assert r.ok and s.k == 20
    assert r.t_predict_start >= max(int(b.post_end) for b in s.blocks)


def batched_run(model: LoadedModel, inputs: Any, batch: int, queries: int) -> tuple[Executor, Any]:
    """An agent's local batched run of ``queries`` on held samples, not started."""
    spec = ScenarioSpec(
        name="batched",
        batch_size=batch,
        max_queries=queries,
        duration_s=30,
        min_duration_s=0,
        min_queries=1,
    )
    ex = Executor(model, ExecutorConfig(pre_workers=0))
    return ex, local_run(ex, spec, inputs)


@pytest.mark.parametrize("batch", [4, 1])
def test_a_batched_run_on_held_samples_is_one_stream_recorded_in_full(
    model: LoadedModel, samples: np.ndarray, batch: int
) -> None:
    """The agent's batched run on samples held pre-processed: every query recorded,
    issued when the predict thread took it, its top-1 that of the model on its rows."""
    from mlscope import samples as samplesmod

    held = model.pre[0](samples)
    inputs, _ = samplesmod.feed(held, None, batch, 3)
    ex, run = batched_run(model, inputs, batch, 50)
    scores = model.predictor.predict([inputs.block(0, 50)])[0]
    try:
        assert run.streamed
        t0 = run.prepare()
        run.run()
        first, cols, errors = run.take(final=True)
    finally:
        ex.stop()
    assert (first, run.issued, len(cols["ok"]), errors) == (0, 50, 50, {})
    assert (cols["ok"] == 1).all()
    assert (cols["scheduled"] == cols["issued"]).all()
    steps = ["issued", "agent_received", "predict_start", "predict_end", "agent_replied"]
    times = np.stack([cols[k] for k in [*steps, "completed"]], axis=1)
    assert (times > 0).all() and (np.diff(times, axis=1) >= 0).all()
    assert (np.diff(cols["issued"]) > 0).all()  # one after another
    assert (cols["issued"][1:] >= cols["predict_end"][:-1]).all()
    assert t0 > 0
    np.testing.assert_array_equal(cols["top1"].reshape(-1), scores.argmax(axis=1))
    assert (held == model.pre[0](samples)).all()  # the held samples left as they were


@pytest.mark.parametrize("bound", [("FILL_BLOCKS", 3), ("FILL_BYTES", 1)])
def test_a_local_run_writes_its_streams_blocks_into_the_record_many_at_once(
    model: LoadedModel,
    samples: np.ndarray,
    monkeypatch: pytest.MonkeyPatch,
    bound: tuple[str, int],
) -> None:
    """The blocks a local run keeps and writes into its record several at a time (every
    few blocks or bytes, when rows are shipped, at the end) land on their own rows: a
    failed query's error and no top-1, an answered query's times and the model's top-1
    on its rows, each completed when its block's post-processing ended."""
    import agent.localrecord as localrecord
    import agent.localrun as localrun
    import agent.stream as streams
    from mlscope import samples as samplesmod

    monkeypatch.setattr(localrecord, *bound)
    monkeypatch.setattr(streams, "STREAM_BLOCK", 4)
    fills: list[int] = []
    fill = localrun.LocalRun._fill

    def counted(self: Any) -> None:
        fills.append(len(self._answers))
        fill(self)

    monkeypatch.setattr(localrun.LocalRun, "_fill", counted)
    raw = samples.copy()
    raw[[5, 17, 40], 0, 0] = POISON
    held = model.pre[0](raw)
    inputs, _ = samplesmod.feed(held, None, 2, 3)
    clean = model.predictor
    model.predictor = Slow(clean)
    ex, run = batched_run(model, inputs, 2, 60)
    try:
        assert run.streamed
        run.prepare()
        run.run()
        first, cols, errors = run.take(final=True)
    finally:
        ex.stop(close=False)
    bad = {i for i in range(60) if (inputs(i)[:, 0, 0, 0] == np.float32(POISON / 16)).any()}
    good = [i for i in range(60) if i not in bad]
    assert bad and (first, len(cols["ok"])) == (0, 60)
    assert set(errors) == bad and all("poisoned" in e for e in errors.values())
    assert cols["ok"].tolist() == [int(i not in bad) for i in range(60)]
    want = np.stack([clean.predict([inputs(i)])[0].argmax(axis=1) for i in good])
    np.testing.assert_array_equal(cols["top1"][good], want)
    assert (cols["top1"][sorted(bad)] == -1).all()
    assert (cols["predict_start"][good] <= cols["predict_end"][good]).all()
    assert (cols["agent_replied"] >= cols["agent_received"]).all()
    assert (cols["completed"][good] >= cols["predict_end"][good]).all()
    assert (cols["completed"] == cols["agent_replied"]).all() and (cols["completed"] > 0).all()
    assert len(set(cols["completed"].tolist())) > 3  # several blocks, each its own time
    assert len([f for f in fills if f]) > 3 and max(fills) <= 3  # bounded while it ran


def test_blocks_written_at_once_keep_each_querys_own_top1(
    model: LoadedModel, samples: np.ndarray
) -> None:
    """Blocks whose outputs have a different number of rows per query are scored block
    by block: joined, their first values would be split at the wrong places."""
    from agent.stream import Answered
    from mlscope import samples as samplesmod

    inputs, _ = samplesmod.feed(model.pre[0](samples), None, 5, 0)
    ex, run = batched_run(model, inputs, 5, 4)
    try:
        t0 = run.prepare()

        def block(first: int, rows_per_query: int) -> Answered:
            n = 2 * rows_per_query
            times = np.array([[first + q, t0 + 1, t0 + 2, t0 + 3] for q in range(2)], np.int64)
            out = np.arange(100 * first, 100 * first + n, dtype=np.int32)[:, None]
            return Answered(times=times, outputs=out, errors={}, post_end=t0 + 4)

        run.answered(block(0, 3))  # 6 rows, then 10: 16 rows for 4 queries
        run.answered(block(2, 5))
        _, cols, _ = run.take(final=True)
    finally:
        ex.stop(close=False)
    top1 = cols["top1"][:4]
    assert top1[0, :3].tolist() == [0, 1, 2] and top1[1, :3].tolist() == [3, 4, 5]
    assert top1[2].tolist() == [200, 201, 202, 203, 204]
    assert top1[3].tolist() == [205, 206, 207, 208, 209]
    assert (top1[:2, 3:] == -1).all()
    assert cols["ok"][:4].tolist() == [1] * 4 and (cols["completed"][:4] == 4).all()


def test_a_stream_answers_sooner_when_its_outputs_are_large_and_ends_when_stopped(
    model: LoadedModel, samples: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept outputs are bounded in bytes (a model with large outputs answers query by
    query), and an executor that stops ends a stream that would go on for ever."""
    import agent.stream as streams

    monkeypatch.setattr(streams, "STREAM_BYTES", 1)
    x = model.pre[0](samples[:2])

    class Endless(Stream):
        def next_query(self) -> tuple[int, np.ndarray] | None:
            self.k += 1
            return self.k - 1, x

    s = Endless([])
    ex = Executor(model)
    runner = threading.Thread(target=ex.stream, args=(s,), kwargs={"timeout": 60})
    runner.start()
    while s.k < 20:
        time.sleep(0.001)
    ex.stop()
    runner.join(30)
    assert not runner.is_alive()
    assert s.blocks and all(len(b.index) == 1 for b in s.blocks)
    answered = np.concatenate([b.index for b in s.blocks])
    assert (answered == np.arange(len(answered))).all() and len(answered) >= 20


def test_a_stream_of_a_slow_model_answers_on_a_thread_of_its_own_in_order(
    model: LoadedModel, samples: np.ndarray
) -> None:
    """A model whose predicts are long: once its last few were, its answers are
    post-processed beside the next predict, on one thread, in issue order, with the
    same outputs; a fault of the stream's code there ends the stream and is raised to
    its caller."""
    raws = [samples[2 * q : 2 * q + 2] for q in range(24)]
    want = np.concatenate([expected(model, r) for r in raws])
    model.predictor = Slow(model.predictor, sleep_s=0.002)
    xs: list[np.ndarray | None] = [model.pre[0](r) for r in raws]
    s = Stream(xs, TraceLevel.MODEL)
    failing = Stream(xs * 2)
    failing.fail_at = 6
    ex = Executor(model)
    replies = Replies()
    try:
        ex.stream(s, timeout=60)
        with pytest.raises(RuntimeError, match="fault in answering"):
            ex.stream(failing, timeout=60)
        ex.submit(job(0, samples[:2], replies))
        (r,) = replies.take(1)
    finally:
        ex.stop()
    assert r.ok
    infer, post = f"infer-{model.name}", f"post-{model.name}"
    assert s.threads == {infer}
    # The first blocks on the predict thread (its last predicts not known yet), then
    # every block on the answering thread: never back, so they stay in order.
    first_post = s.answered_by.index(post)
    assert set(s.answered_by[:first_post]) <= {infer}
    assert set(s.answered_by[first_post:]) == {post} and len(s.answered_by[first_post:]) >= 3
    assert np.concatenate([b.index for b in s.blocks]).tolist() == list(range(24))
    outputs = np.concatenate([b.outputs for b in s.blocks if b.outputs is not None])
    np.testing.assert_array_equal(outputs, want)
    spans = s.spans.columns if s.spans is not None else {}
    assert len(spans["name"]) == 4 * 24
    assert post in failing.answered_by  # its fault was on the answering thread
    assert len(failing.blocks) == 6 and failing.k < 48  # it stopped taking queries


class Stray(Slow):
    """A fast model whose chosen predicts stall (a preemption of the predict thread)."""

    def __init__(self, inner: Any, stall: set[int]) -> None:
        super().__init__(inner)
        self.stall, self.calls = stall, 0

    def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        self.calls += 1
        if self.calls in self.stall:
            time.sleep(0.003)
        return super().predict(inputs)


@pytest.mark.parametrize("stall", [{1}, {2}, {40}, {40, 41}, {1, 2, 40}])
def test_a_fast_model_answers_on_its_predict_thread_through_stray_slow_predicts(
    model: LoadedModel, samples: np.ndarray, stall: set[int]
) -> None:
    """A stray slow predict (at the start, within a block, two in a row) does not move a
    fast model's answers to a thread of their own, which would take the GIL and a core
    from the runtime for the rest of the stream; its answers stay in order."""
    raws = [samples[(2 * q) % 64 : (2 * q) % 64 + 2] for q in range(80)]
    want = np.concatenate([expected(model, r) for r in raws])
    model.predictor = Stray(model.predictor, stall)
    s = streamed(model, [model.pre[0](r) for r in raws])
    assert s.answered_on == {f"infer-{model.name}"}
    assert np.concatenate([b.index for b in s.blocks]).tolist() == list(range(80))
    outputs = np.concatenate([b.outputs for b in s.blocks if b.outputs is not None])
    np.testing.assert_array_equal(outputs, want)


@pytest.mark.parametrize("scenario", ["batched", "concurrency"])
def test_a_long_closed_loop_holds_only_the_rows_it_has_not_shipped(
    model: LoadedModel, samples: np.ndarray, scenario: str
) -> None:
    """A closed loop in the agent (a batched stream; a concurrency loop through the
    executor) that outruns its record forgets the rows it has shipped instead of
    growing for ever: every row is shipped once, in order, with its own answer, and
    the record's room stays a few shipments wide."""
    from mlscope import samples as samplesmod

    held = model.pre[0](samples)
    inputs, _ = samplesmod.feed(held, None, 1, 11)
    total = 12_000
    spec = ScenarioSpec(
        name=scenario,
        batch_size=1,
        concurrency=2,
        max_queries=total,
        duration_s=60,
        min_duration_s=0,
        min_queries=1,
    )
    want = model.predictor.predict([inputs.block(0, total)])[0].argmax(axis=1)
    ex = Executor(model, ExecutorConfig(pre_workers=0))
    run = local_run(ex, spec, inputs)
    assert run.streamed == (scenario == "batched")
    room: list[int] = []
    shipped: list[tuple[int, dict[str, np.ndarray]]] = []
    runner = threading.Thread(target=run.run)
    try:
        run.prepare()
        runner.start()
        while runner.is_alive():
            first, cols, errors = run.take()
            assert errors == {}
            shipped.append((first, cols))
            room.append(run.rec.n)
            time.sleep(0.005)
        runner.join()
        shipped.append(run.take(final=True)[:2])
    finally:
        ex.stop()
    starts = [first for first, _ in shipped]
    sizes = [len(cols["ok"]) for _, cols in shipped]
    assert starts == list(np.cumsum([0, *sizes[:-1]]))  # contiguous, each row once
    assert sum(sizes) == total == run.issued == run.queries
    ok = np.concatenate([cols["ok"] for _, cols in shipped])
    done = np.concatenate([cols["completed"] for _, cols in shipped])
    top1 = np.concatenate([cols["top1"] for _, cols in shipped]).reshape(-1)
    assert (ok == 1).all() and (done > 0).all()
    np.testing.assert_array_equal(top1, want)
    assert max(room) < total // 2, max(room)  # it forgot shipped rows: never held them all


def test_a_stream_that_answered_just_before_its_time_was_up_lasted_its_duration(
    model: LoadedModel, samples: np.ndarray
) -> None:
    """A stream whose last block was answered just before its duration was up, and
    whose next query then found the time up, lasted its duration: its window is not
    cut to its last answer, and the minimum-duration rule holds. The stream records
    when it found the time up; a claim past the duration counts only up to it."""
    from broker.scenario import closed_window
    from broker.summary import judge
    from mlscope import samples as samplesmod
    from mlscope.validity import ValidityPolicy

    inputs, _ = samplesmod.feed(model.pre[0](samples), None, 4, 0)
    spec = ScenarioSpec(
        name="batched", batch_size=4, duration_s=0.3, min_duration_s=0.3, min_queries=1
    )
    ex = Executor(model, ExecutorConfig(pre_workers=0))
    run = local_run(ex, spec, inputs)
    plain = run.answered
    late: list[int] = []

    def answered(block: Any) -> None:  # the block's bookkeeping outlasts the time left
        plain(block)
        left = run._deadline - time.perf_counter_ns()
        if 0 < left < 50_000_000 and not late:
            late.append(left)
            time.sleep(left / 1e9 + 0.002)

    run.answered = answered
    try:
        assert run.streamed
        run.prepare()
        run.run()
    finally:
        ex.stop()
    rec = run.rec
    duration_ns = int(spec.duration_s * 1e9)
    assert late and int(rec.completed.max()) < duration_ns <= rec.time_up_ns
    assert closed_window(rec, spec) == spec.duration_s
    verdict = judge(
        rec,
        spec,
        ValidityPolicy(),
        window_s=closed_window(rec, spec),
        requested_rate=None,
        poisson=False,
        open_loop=False,
    )
    assert not any(r.startswith("ran ") for r in verdict.reasons), verdict.reasons
    rec.time_up_ns = 10 * duration_ns  # proves the duration was reached, nothing more
    assert closed_window(rec, spec) == spec.duration_s
    rec.time_up_ns = 0  # stopped otherwise (a stop, its count): until its last answer
    assert closed_window(rec, spec) == int(rec.completed.max()) / 1e9 < spec.duration_s


def test_a_closed_loop_in_the_agent_records_when_its_time_was_up_and_not_when_stopped(
    model: LoadedModel, samples: np.ndarray
) -> None:
    """A closed loop through the executor notes the moment it found its duration up;
    one that ended at its query count does not."""
    from mlscope import samples as samplesmod

    inputs, _ = samplesmod.feed(model.pre[0](samples), None, 1, 0)
    for max_queries, timed in ((None, True), (5, False)):
        spec = ScenarioSpec(
            name="concurrency",
            batch_size=1,
            concurrency=2,
            duration_s=0.2,
            max_queries=max_queries,
            min_duration_s=0,
            min_queries=1,
        )
        run = ran_locally(model, spec, inputs)
        assert not run.streamed
        if timed:
            assert run.rec.time_up_ns >= int(spec.duration_s * 1e9)
        else:
            assert run.rec.time_up_ns == 0 and run.issued == 5


def test_a_stopped_executor_and_its_model_are_freed_when_dropped_not_at_the_next_gc(
    zoo_dir: Path, samples: np.ndarray
) -> None:
    """An agent drops a model's executor when it unloads the model (each load of a
    cold start, a model no evaluation uses any more). The executor must not hold
    itself in a reference cycle: the cyclic GC may not run for minutes (an agent makes
    few Python objects), and each executor it kept held ~40 MB more for efficientnet,
    in the next cold start's memory figures. Its queries went through the pool, the
    predict thread and a stream."""
    e = digits_entry()
    model = LoadedModel.open(e, e.graph(zoo_dir), PredictorOptions(threads=1))
    replies = Replies()
    ex = Executor(model, ExecutorConfig(pre_workers=1, inline_max_us=0), warm=True)
    gone, predictor = weakref.ref(ex), weakref.ref(model.predictor)
    held = model.pre[0](samples[:8])
    gc.collect()
    gc.disable()
    try:
        ex.first_inference_ns()
        for i in range(4):
            assert ex.submit(job(i, samples[i : i + 2], replies))
        assert all(r.ok for r in replies.take(4))
        s = Stream([held[:4], held[4:]])
        ex.stream(s, timeout=30)
        assert s.k == 2
        ex.stop()
        del ex, model
        assert gone() is None, [type(r).__name__ for r in gc.get_referrers(gone())]
        assert predictor() is None
    finally:
        gc.enable()
