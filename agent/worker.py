"""A loaded model and the thread that runs its queries.

One inference thread per loaded model takes queries from a bounded queue and runs
pre-process -> predict -> post-process, timing each step on the monotonic clock.
The queue bound is the agent's backpressure: a full queue answers "overloaded"
instead of growing. Replies go back to the event loop in one hop per query.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agent import profiling
from agent.operators import Pipeline, compile_steps
from agent.predictors import open_predictor
from agent.tracer import SpanBuffer
from mlscope.catalog import Entry
from mlscope.contracts import QueryReply, TraceLevel
from mlscope.errors import InputMismatchError, MLScopeError
from mlscope.predictor import Predictor, PredictorOptions

__all__ = ["Job", "LoadedModel", "ModelWorker"]

now = time.perf_counter_ns


@dataclass(frozen=True)
class Job:
    """One query as the worker sees it."""

    index: int
    inputs: np.ndarray
    received_ns: int
    level: TraceLevel
    spans: SpanBuffer | None
    reply: Callable[[QueryReply], None]


class LoadedModel:
    """A predictor with its compiled pre- and post-processing."""

    def __init__(self, entry: Entry, predictor: Predictor, load_ns: int) -> None:
        m = entry.manifest
        self.entry, self.predictor, self.load_ns = entry, predictor, load_ns
        self.name = m.name
        self.pre: list[Pipeline] = [compile_steps(i.steps, where=f"inputs.{n}.steps")
                                    for n, i in enumerate(m.inputs)]
        self.post: Pipeline = compile_steps(m.outputs[0].steps, where="outputs.0.steps")
        self.sample_shape = m.inputs[0].shape

    @classmethod
    def open(cls, entry: Entry, graph: Path, options: PredictorOptions) -> LoadedModel:
        t0 = now()
        pred = open_predictor(entry.manifest.framework.name, graph, entry.manifest, options)
        return cls(entry, pred, now() - t0)

    def warmup(self) -> int:
        """One inference on zeros; returns its duration (the cold first inference)."""
        raw = np.zeros((1, *self.sample_shape), np.float32)
        steps = self.entry.manifest.inputs[0].steps
        if steps and "decode" in steps[0]:  # raw input is an image to decode: uint8 HWC
            side = max(self.sample_shape)
            raw = np.zeros((1, side, side, 3), np.uint8)
        t0 = now()
        self.predictor.predict([self.pre[0](raw)])
        return now() - t0

    def check(self, inputs: np.ndarray) -> None:
        if inputs.ndim < 1 or inputs.shape[0] < 1:
            raise InputMismatchError(
                f"{self.name}: a query needs a batch of at least one sample",
                model=self.name, framework=self.predictor.framework,
                expected="(batch, ...)", actual=list(inputs.shape))


class ModelWorker:
    """The inference thread of one loaded model."""

    def __init__(self, model: LoadedModel, *, capacity: int = 256) -> None:
        self.model = model
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=capacity)
        self.thread = threading.Thread(target=self._run, name=f"infer-{model.name}",
                                       daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> bool:
        """Queue a job; False when the queue is full (the caller replies overloaded)."""
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            return False
        return True

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=10)
        self.model.predictor.close()

    def _run(self) -> None:
        while (job := self.queue.get()) is not None:
            job.reply(self._one(job))

    def _one(self, job: Job) -> QueryReply:
        m, spans, level = self.model, job.spans, job.level
        t_pre = now()
        try:
            m.check(job.inputs)
            x = m.pre[0](job.inputs)
            t_pred = now()
            if level >= TraceLevel.FRAMEWORK:  # layer spans from the framework's profiler
                with profiling.capture(m.predictor, full=level >= TraceLevel.FULL) as cap:
                    out = m.predictor.predict([x])
            else:
                cap = profiling.NULL
                out = m.predictor.predict([x])
            t_post = now()
            result = m.post(out[0])
            t_end = now()
        except MLScopeError as exc:
            return QueryReply(index=job.index, ok=False, error=exc.to_wire(),
                              t_received=job.received_ns, t_replied=now())
        if spans is not None and level >= TraceLevel.MODEL:
            attrs = {"batch_size": int(job.inputs.shape[0])}
            root = spans.add(parent=0, query_index=job.index, level=TraceLevel.MODEL,
                             kind="query", name="query", start_ns=job.received_ns,
                             end_ns=t_end, attrs=attrs)
            for name, a, b in (("preprocess", t_pre, t_pred), ("predict", t_pred, t_post),
                               ("postprocess", t_post, t_end)):
                sid = spans.add(parent=root, query_index=job.index, level=TraceLevel.MODEL,
                                kind="step", name=name, start_ns=a, end_ns=b)
                if name == "predict" and cap.events:
                    cap.emit(spans, parent=sid, query_index=job.index, window=(t_pred, t_post))
        return QueryReply(index=job.index, ok=True, outputs=np.ascontiguousarray(result),
                          t_received=job.received_ns, t_predict_start=t_pred,
                          t_predict_end=t_post, t_replied=now())
