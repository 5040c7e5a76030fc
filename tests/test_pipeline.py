"""The streaming pipeline executor: order, batching, max wait, backpressure, overlap,
error isolation -- on the real digits_cnn ONNX model -- and typed error replies from a
live agent over the bus (bad input, a model that fails to load, a runtime failure)."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.pipeline import Executor, ExecutorConfig
from agent.service import Agent, AgentConfig
from agent.tracer import SpanBuffer
from agent.worker import LoadedModel
from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.catalog import Catalog, Entry
from mlscope.contracts import Query, QueryReply
from mlscope.errors import InferenceError, InputMismatchError, ModelLoadError, error_from_wire
from mlscope.predictor import PredictorOptions
from mlscope.settings import Settings
from tests.agent_fixtures import Ask, run_agent
from tests.pipeline_fixtures import (
    POISON,
    Replies,
    Slow,
    digits_entry,
    expected,
    job,
)

pytestmark = pytest.mark.timeout(120)


def test_order_and_results_preserved_under_dynamic_batching(
    model: LoadedModel, samples: np.ndarray
) -> None:
    want = expected(model, samples)
    slow = Slow(model.predictor, sleep_s=0.002)
    model.predictor = slow
    ex = Executor(model, ExecutorConfig(max_batch=8, max_wait_us=20_000))
    replies = Replies()
    slow.gate.clear()  # queries pile up behind the first batch, then are merged
    sizes = [1, 2, 1, 3, 1, 1, 4, 2, 1, 1]
    starts = np.cumsum([0, *sizes])
    try:
        for i, n in enumerate(sizes):
            assert ex.submit(job(i, samples[starts[i] : starts[i] + n], replies, raw=True))
        slow.gate.set()
        got = replies.take(len(sizes))
    finally:
        ex.stop()
    assert [r.index for r in got] == list(range(len(sizes)))
    for i, r in enumerate(got):
        assert r.ok and r.outputs is not None and r.raw_outputs is not None
        np.testing.assert_array_equal(r.outputs, want[starts[i] : starts[i + 1]])
        assert r.raw_outputs.shape == (sizes[i], 10)
    assert max(slow.batches) <= 8 and len(slow.batches) < len(sizes)  # merged, bounded
    assert sum(slow.batches) == sum(sizes)


def test_partial_batch_waits_at_most_max_wait_and_full_one_not_at_all(
    model: LoadedModel, samples: np.ndarray
) -> None:
    ex = Executor(model, ExecutorConfig(max_batch=8, max_wait_us=200_000))
    replies = Replies()
    try:
        ex.submit(job(0, samples[:1], replies))
        (alone,) = replies.take(1)
        ex.submit(job(1, samples[:8], replies))
        (full,) = replies.take(1)
    finally:
        ex.stop()
    assert alone.ok and full.ok
    # Nothing else came: the lone query waited out the 200 ms, and no longer than needed.
    assert 0.2 <= (alone.t_predict_start - alone.t_received) / 1e9 < 5
    assert (full.t_predict_start - full.t_received) / 1e9 < 0.2


def test_backpressure_refuses_beyond_capacity_and_recovers(
    model: LoadedModel, samples: np.ndarray
) -> None:
    slow = Slow(model.predictor)
    model.predictor = slow
    ex = Executor(model, ExecutorConfig(capacity=3))
    replies = Replies()
    slow.gate.clear()
    try:
        admitted = [ex.submit(job(i, samples[i : i + 1], replies)) for i in range(5)]
        assert admitted == [True, True, True, False, False]
        assert ex.inflight == 3
        slow.gate.set()
        assert all(r.ok for r in replies.take(3))
        assert ex.submit(job(9, samples[:1], replies))
        assert replies.take(1)[0].index == 9
    finally:
        ex.stop()
    assert ex.inflight == 0


def test_backpressure_bounds_the_bytes_of_inputs_in_flight(
    model: LoadedModel, samples: np.ndarray
) -> None:
    """An overloaded run of large queries held ``capacity`` of them, whatever their
    size; the bytes they hold are bounded too, and an idle executor admits any query."""
    slow = Slow(model.predictor)
    model.predictor = slow
    row = samples[:1].nbytes
    ex = Executor(model, ExecutorConfig(capacity=100, inflight_bytes=5 * row))
    replies = Replies()
    slow.gate.clear()
    try:
        admitted = [ex.submit(job(i, samples[2 * i : 2 * i + 2], replies)) for i in range(4)]
        assert admitted == [True, True, False, False]  # 2 + 2 rows held; 2 more pass 5
        assert ex.submit(job(4, samples[4:5], replies))  # one row still fits
        assert not ex.submit(job(5, samples[5:6], replies))
        slow.gate.set()
        assert [r.index for r in replies.take(3)] == [0, 1, 4]
        big = samples[:8]  # alone larger than the bound: admitted into an idle executor
        assert ex.submit(job(9, big, replies))
        assert replies.take(1)[0].ok
    finally:
        ex.stop()
    assert ex.inflight == 0


def test_preprocessing_overlaps_inference(model: LoadedModel, samples: np.ndarray) -> None:
    pre = model.pre[0]

    def slow_pre(x: np.ndarray) -> Any:
        time.sleep(0.03)
        return pre(x)

    model.pre = [slow_pre]
    model.predictor = Slow(model.predictor, sleep_s=0.03)
    spans = SpanBuffer()
    ex = Executor(model, ExecutorConfig(pre_workers=2))
    replies = Replies()
    try:
        for i in range(6):
            ex.submit(job(i, samples[i : i + 1], replies, spans))
        got = replies.take(6)
    finally:
        ex.stop()
    assert [r.index for r in got] == list(range(6)) and all(r.ok for r in got)
    cols = spans.take()
    rows = list(
        zip(cols["query_index"], cols["name"], cols["start_ns"], cols["end_ns"], strict=True)
    )
    pre_at = {q: (a, b) for q, n, a, b in rows if n == "preprocess"}
    pred_at = {q: (a, b) for q, n, a, b in rows if n == "predict"}
    # Some query was pre-processed while an earlier one was being predicted.
    overlapped = [
        (j, q)
        for q in range(1, 6)
        for j in range(q)
        if pre_at[q][0] < pred_at[j][1] and pre_at[q][1] > pred_at[j][0]
    ]
    assert overlapped, (pre_at, pred_at)
    # Each query's own steps are in order: pre, then predict.
    assert all(pre_at[q][1] <= pred_at[q][0] for q in range(6))


def test_errors_are_isolated_per_query_and_the_executor_keeps_serving(
    model: LoadedModel, samples: np.ndarray
) -> None:
    slow = Slow(model.predictor)
    model.predictor = slow
    ex = Executor(model, ExecutorConfig(max_batch=8, max_wait_us=50_000))
    replies = Replies()
    poisoned = samples[:1].copy()
    poisoned[0, 0, 0] = POISON
    slow.gate.clear()
    try:
        ex.submit(job(0, samples[:2], replies))
        ex.submit(job(1, np.zeros((1, 7, 7), np.uint8), replies))  # cannot be reshaped
        ex.submit(job(2, poisoned, replies))  # fails inside predict
        ex.submit(job(3, np.zeros((0, 8, 8), np.uint8), replies))  # empty batch
        ex.submit(job(4, samples[2:3], replies))
        slow.gate.set()
        got = replies.take(5)
        ex.submit(job(5, samples[3:4], replies))
        got += replies.take(1)
    finally:
        ex.stop()
    assert [r.index for r in got] == [0, 1, 2, 3, 4, 5]
    assert [r.ok for r in got] == [True, False, False, False, True, True]
    shape = error_from_wire(got[1].error or {})
    assert isinstance(shape, InputMismatchError)
    assert shape.fields["model"] == "digits_cnn" and shape.fields["framework"] == "onnxruntime"
    assert shape.fields["expected"] == [None, 1, 8, 8]
    assert shape.fields["actual"]["shape"] == [1, 7, 7]
    runtime = error_from_wire(got[2].error or {})
    assert isinstance(runtime, InferenceError) and "poisoned" in str(runtime)
    assert isinstance(error_from_wire(got[3].error or {}), InputMismatchError)


def test_a_fault_in_the_pipeline_itself_answers_the_batch_and_keeps_serving(
    model: LoadedModel, samples: np.ndarray
) -> None:
    slow = Slow(model.predictor)
    model.predictor = slow
    post = model.post
    model.post = lambda x: np.float32(0.0)  # cannot be split back into queries
    ex = Executor(model, ExecutorConfig(max_batch=4, max_wait_us=50_000))
    replies = Replies()
    slow.gate.clear()
    try:
        for i in range(3):
            ex.submit(job(i, samples[i : i + 1], replies))
        slow.gate.set()
        broken = replies.take(3)
        model.post = post
        ex.submit(job(3, samples[:1], replies))
        (fine,) = replies.take(1)
    finally:
        ex.stop()
    assert [r.index for r in broken] == [0, 1, 2] and not any(r.ok for r in broken)
    err = error_from_wire(broken[0].error or {})
    assert isinstance(err, InferenceError) and "pipeline failure" in str(err)
    assert fine.ok and ex.inflight == 0


def test_a_reply_that_cannot_be_built_or_sent_never_ends_the_predict_thread(
    model: LoadedModel, samples: np.ndarray
) -> None:
    """A query whose reply fails validation is answered with its error; a replier that
    raises loses only its own answer: the queries after both are answered."""
    ex = Executor(model, ExecutorConfig(max_batch=1, pre_workers=0, inline_max_us=0))
    replies = Replies()

    def refusing(_r: QueryReply) -> None:
        raise RuntimeError("the replier's own failure")

    bad_index = dataclasses.replace(job(0, samples[:1], replies), index="zero")  # type: ignore[arg-type]
    try:
        ex.submit(bad_index)
        (first,) = replies.take(1)
        ex.submit(dataclasses.replace(job(1, samples[:1], replies), reply=refusing))
        ex.submit(job(2, samples[:1], replies))
        (after,) = replies.take(1)
    finally:
        ex.stop()
    assert not first.ok and "reply" in str(error_from_wire(first.error or {}))
    assert after.index == 2 and after.ok and ex.inflight == 0


def test_a_warm_executor_runs_the_first_inference_on_its_predict_thread(
    model: LoadedModel, samples: np.ndarray
) -> None:
    """The thread that warms a model up is the one that predicts every query (a
    TorchScript model is twice as slow on any other); the first inference's time and
    a failed warm-up come back to the caller."""

    class Where(Slow):
        def __init__(self, inner: Any) -> None:
            super().__init__(inner)
            self.threads: list[int] = []

        def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
            self.threads.append(threading.get_ident())
            return super().predict(inputs)

    where = Where(model.predictor)
    model.predictor = where
    ex = Executor(model, ExecutorConfig(pre_workers=0, inline_max_us=0), warm=True)
    replies = Replies()
    try:
        first = ex.first_inference_ns()
        for i in range(3):
            ex.submit(job(i, samples[i : i + 1], replies))
        assert all(r.ok for r in replies.take(3))
    finally:
        ex.stop()
    assert first > 0 and where.batches[0] == 1  # the warm-up: one sample
    assert len(where.threads) == 4 and len(set(where.threads)) == 1
    assert where.threads[0] != threading.get_ident()

    class Broken(Slow):
        def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
            raise InferenceError("no", model="digits_cnn", framework="onnxruntime")

    model.predictor = Broken(where.inner)
    failed = Executor(model, warm=True)
    try:
        with pytest.raises(InferenceError, match="no"):
            failed.first_inference_ns()
    finally:
        failed.stop(close=False)


# --------------------------------------------------------------------------- live agent


def broken_entry(tmp_path: Path) -> Entry:
    """A manifest whose (checksummed) graph file is not a model."""
    graph = tmp_path / "broken.onnx"
    graph.write_bytes(b"this is not an onnx graph")
    m = digits_entry().manifest.model_copy(
        update={
            "name": "broken_cnn",
            "dataset": None,
            "assets": digits_entry().manifest.assets.model_copy(
                update={
                    "base_url": None,
                    "graph_path": "broken.onnx",
                    "sha256": hashlib.sha256(graph.read_bytes()).hexdigest(),
                }
            ),
        }
    )
    return Entry(manifest=m, path=tmp_path / "broken.yaml")


def test_agent_answers_typed_errors_and_keeps_serving(settings: Settings, tmp_path: Path) -> None:
    catalog = Catalog([digits_entry(), broken_entry(tmp_path)])
    agent = Agent(settings, AgentConfig(framework="onnxruntime", agent_id="careful"), catalog)

    async def ask(bus: busmod.Bus, subject: str, payload: bytes) -> Any:
        return codec.decode((await bus.nc.request(subject, payload, timeout=30)).data)

    async def body(bus: busmod.Bus, _ask_ctl: Ask) -> None:
        ctl, qs = names.agent_ctl("careful"), names.agent_query("careful")
        prep = {
            "op": "prepare",
            "evaluation_id": "ev-1",
            "model": "digits_cnn",
            "model_version": "1.0.0",
            "batch_size": 1,
            "trace_level": "none",
        }
        bad = await ask(
            bus, ctl, codec.encode({**prep, "model": "broken_cnn", "evaluation_id": "ev-2"})
        )
        err = error_from_wire(bad["error"])
        assert isinstance(err, ModelLoadError)
        assert err.fields["model"] == "broken_cnn"
        assert err.fields["framework"] == "onnxruntime"
        assert (await ask(bus, ctl, codec.encode(prep)))["ok"]
        wrong = Query(evaluation_id="ev-1", index=1, inputs=np.zeros((1, 5, 5)))
        reply = QueryReply.model_validate(await ask(bus, qs, codec.encode_model(wrong)))
        err = error_from_wire(reply.error or {})
        assert not reply.ok and isinstance(err, InputMismatchError)
        assert err.fields["actual"] == {"shape": [1, 5, 5], "dtype": "float64"}
        good = Query(evaluation_id="ev-1", index=2, inputs=np.ones((1, 8, 8), np.uint8))
        reply = QueryReply.model_validate(await ask(bus, qs, codec.encode_model(good)))
        assert reply.ok and reply.index == 2 and reply.raw_outputs is None
        # cold start: release with unload, prepare with reload -> loaded again
        again = await ask(bus, ctl, codec.encode({**prep, "reload": True}))
        assert again["cold"] and again["load_ns"] > 0
        rel = await ask(
            bus, ctl, codec.encode({"op": "release", "evaluation_id": "ev-1", "unload": True})
        )
        assert rel["unloaded"] is True and not agent.models.workers

    run_agent(settings, agent, body)


def test_a_preprocessed_query_skips_pre_processing_and_wakes_no_pool_thread(
    model: LoadedModel, samples: np.ndarray
) -> None:
    """Samples the agent holds pre-processed: the first input's pipeline never runs, the
    query is ready when submitted (no pool thread takes it), and the answer is the one
    the raw samples get."""
    want = expected(model, samples[:8])
    held = model.pre[0](samples[:8])
    ran: list[int] = []

    def counted(x: np.ndarray) -> Any:
        ran.append(len(x))
        raise AssertionError("pre-processed twice")

    model.pre = [counted]
    ex = Executor(model, ExecutorConfig(pre_workers=2))
    where: list[str] = []
    inner = ex._preprocess

    def tracked(slot: Any) -> None:
        where.append(threading.current_thread().name)
        inner(slot)

    ex._preprocess = tracked  # type: ignore[method-assign]
    replies = Replies()
    try:
        for i in range(4):
            j = job(i, held[2 * i : 2 * i + 2], replies)
            assert ex.submit(dataclasses.replace(j, preprocessed=True))
        got = replies.take(4)
    finally:
        ex.stop(close=False)
    assert ran == [] and all(r.ok for r in got), [r.error for r in got]
    np.testing.assert_array_equal(np.concatenate([r.outputs for r in got]), want)
    assert where == [threading.current_thread().name] * 4  # never a pool thread


def test_a_model_is_opened_on_a_thread_that_has_ended(
    zoo_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No thread but the predict thread keeps a runtime's worker team alive: the one
    that opened the model has ended when ``open`` returns (a live one halved PyTorch's
    speed on two cores), and a load error still reaches the caller typed."""
    from agent.predictors import open_predictor as real

    openers: list[threading.Thread] = []

    def recording(*args: Any) -> Any:
        openers.append(threading.current_thread())
        return real(*args)

    monkeypatch.setattr("agent.worker.open_predictor", recording)
    entry = digits_entry()
    m = LoadedModel.open(entry, entry.graph(zoo_dir), PredictorOptions(threads=1))
    try:
        (opener,) = openers
        assert opener is not threading.current_thread()
        assert not opener.is_alive()
    finally:
        m.predictor.close()
    with pytest.raises(ModelLoadError):
        LoadedModel.open(entry, zoo_dir / "missing.onnx", PredictorOptions(threads=1))


def test_queries_of_a_released_evaluation_still_queued_are_answered_not_run(
    model: LoadedModel, samples: np.ndarray
) -> None:
    """A cancelled run's backlog: the queries its agent admitted but had not run when
    the evaluation was released are answered with an error and never predicted, so
    the host is idle for the next measurement (a cancelled, overloaded run kept
    predicting for 11 s under the next evaluation)."""
    slow = Slow(model.predictor)
    model.predictor = slow
    ex = Executor(model, ExecutorConfig(capacity=32))
    replies = Replies()
    released = threading.Event()
    slow.gate.clear()  # the first query blocks in predict; the rest queue behind it
    try:
        for i in range(10):
            q = dataclasses.replace(job(i, samples[i : i + 1], replies), released=released)
            assert ex.submit(q)
        time.sleep(0.2)
        released.set()
        slow.gate.set()
        got = replies.take(10)
    finally:
        ex.stop()
    assert [r.index for r in got] == list(range(10))  # every query answered, in order
    assert sum(slow.batches) <= 1, slow.batches  # only the one already in predict ran
    dropped = [r for r in got if not r.ok]
    assert len(dropped) >= 9
    assert all("released" in (r.error or {}).get("message", "") for r in dropped)
    assert ex.inflight == 0
