"""Helpers of the executor and stream tests: digits_cnn on ONNX Runtime and its held-out
samples (the fixtures ``model`` and ``samples``, registered in conftest), a predictor
wrapper that can be slowed, blocked or poisoned, and query jobs."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.job import Job
from agent.pipeline import Executor
from agent.tracer import SpanBuffer
from agent.worker import LoadedModel
from mlscope.catalog import Catalog, Entry, default_manifest_dirs
from mlscope.contracts import QueryReply, TraceLevel
from mlscope.errors import InferenceError
from mlscope.predictor import PredictorOptions

POISON = 255  # a sample whose first pixel is this makes the test predictor fail


def digits_entry() -> Entry:
    return Catalog.load(default_manifest_dirs()).find("digits_cnn", framework="onnxruntime")


@pytest.fixture
def model(zoo_dir: Path) -> LoadedModel:
    """digits_cnn on ONNX Runtime, one thread (the model every test here drives)."""
    e = digits_entry()
    return LoadedModel.open(e, e.graph(zoo_dir), PredictorOptions(threads=1))


@pytest.fixture
def samples(zoo_dir: Path) -> np.ndarray:
    """64 of digits_cnn's held-out samples, raw (uint8 8x8 images)."""
    with np.load(zoo_dir / "digits_cnn" / "1.0.0" / "holdout.npz") as npz:
        x: np.ndarray = npz["x"][:64]
    return x


class Slow:
    """Wraps the real predictor: records batch sizes, may sleep, block or fail."""

    def __init__(self, inner: Any, *, sleep_s: float = 0.0) -> None:
        self.inner, self.sleep_s = inner, sleep_s
        self.framework, self.device = inner.framework, inner.device
        self.batches: list[int] = []
        self.gate = threading.Event()
        self.gate.set()

    def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        self.gate.wait()
        self.batches.append(len(inputs[0]))
        time.sleep(self.sleep_s)
        if np.any(inputs[0][:, 0, 0, 0] == np.float32(POISON / 16)):
            raise InferenceError("poisoned sample", model="digits_cnn", framework="onnxruntime")
        out: list[np.ndarray] = self.inner.predict(inputs)
        return out

    def close(self) -> None:
        self.inner.close()


class Replies:
    def __init__(self) -> None:
        self.q: queue.SimpleQueue[QueryReply] = queue.SimpleQueue()

    def __call__(self, r: QueryReply) -> None:
        self.q.put(r)

    def take(self, n: int) -> list[QueryReply]:
        return [self.q.get(timeout=30) for _ in range(n)]


def job(
    i: int, x: np.ndarray, replies: Replies, spans: SpanBuffer | None = None, raw: bool = False
) -> Job:
    return Job(
        index=i,
        inputs=x,
        received_ns=time.perf_counter_ns(),
        level=TraceLevel.MODEL if spans is not None else TraceLevel.NONE,
        spans=spans,
        reply=replies,
        raw=raw,
    )


def local_run(
    ex: Executor,
    spec: Any,
    inputs: Any,
    released: threading.Event | None = None,
    *,
    preprocessed: bool = True,
) -> Any:
    """An agent's local run of ``spec`` on ``ex``, over samples held pre-processed (or,
    not ``preprocessed``, raw: pre-processed in each query)."""
    from agent.localrun import LocalRun

    return LocalRun(
        ex,
        spec,
        inputs=inputs,
        level=TraceLevel.NONE,
        spans=None,
        overloaded=lambda i: "overloaded",
        preprocessed=preprocessed,
        released=released,
    )


def ran_locally(model: LoadedModel, spec: Any, inputs: Any, config: Any = None) -> Any:
    """An agent's local run of ``spec`` on a new executor (``config``: one with no
    pre-processing threads), prepared and run to its end, the executor stopped."""
    from agent.pipeline import ExecutorConfig

    ex = Executor(model, config or ExecutorConfig(pre_workers=0))
    run = local_run(ex, spec, inputs)
    try:
        run.prepare()
        run.run()
    finally:
        ex.stop()
    return run


def expected(model: LoadedModel, x: np.ndarray) -> np.ndarray:
    out: np.ndarray = model.post(model.predictor.predict([model.pre[0](x)])[0])
    return out
