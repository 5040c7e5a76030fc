"""A query in the executor, and what is done to it, apart from the threads that do it
(:mod:`agent.pipeline`).

A query is submitted as a :class:`Job` and admitted as a :class:`Slot`, for a model
that offers what :class:`Model` says. Its inputs are pre-processed and filled
(:func:`query_inputs`); a batch of admitted queries is predicted and post-processed
together (:func:`infer`: merged inputs, one :func:`predict`, the outputs split back per
query; a merged batch that fails is retried query by query so that only the culprit
gets its error); each query's reply is built from its outcome (:func:`build_reply`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from agent import profiling
from agent.profiling import NULL, Capture
from agent.queryspans import Outcome, emit_spans
from agent.tracer import SpanBuffer
from mlscope.contracts import QueryReply, TraceLevel
from mlscope.errors import InferenceError, InputMismatchError, MLScopeError
from mlscope.operators import Pipeline
from mlscope.predictor import Predictor

__all__ = [
    "CLAIMED",
    "DONE",
    "PENDING",
    "Deferred",
    "Job",
    "Model",
    "Slot",
    "build_reply",
    "infer",
    "inference_error",
    "merge_inputs",
    "model_inputs",
    "predict",
    "query_inputs",
    "unbuilt_reply",
]

now = time.perf_counter_ns


class Model(Protocol):
    """What the executor needs of a loaded model (:class:`agent.worker.LoadedModel`)."""

    name: str
    predictor: Predictor
    pre: list[Pipeline]
    post: Pipeline
    sample_shape: tuple[int, ...]
    labeler: Callable[[np.ndarray], np.ndarray] | None
    """Class indices -> their labels (:func:`mlscope.operators.labeler`), or None."""
    batch_axes: tuple[int | None, ...]
    """Per input, the axis merged batches are joined on (None: one value shared)."""

    def fill(self, n: int, batch: int) -> np.ndarray:
        """Input ``n`` (n >= 1) for a query that did not carry it."""
        ...


@dataclass(frozen=True, slots=True)
class Deferred:
    """A query's first input, not gathered yet: the executor gathers it (:meth:`take`)
    on one of its own threads, as the query's pre-processing. A load generator in the
    agent issues large queries this way, so that copying a batch out of the samples it
    holds (38 MB for 64 images of 224 x 224 x 3 floats) is the query's time, not the
    pacer's: on the pacer's thread it delayed the queries due next (issue lag)."""

    take: Callable[[], np.ndarray]
    shape: tuple[int, ...]
    """The gathered batch's shape (its axis 0 is the batch)."""
    dtype: np.dtype[Any]
    nbytes: int

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, slots=True)
class Job:
    """One query as the executor sees it."""

    index: int
    inputs: np.ndarray | Deferred
    """The first input: a batch of raw samples (its axis 0 is the batch), or one
    gathered by the executor (:class:`Deferred`)."""
    received_ns: int
    level: TraceLevel
    spans: SpanBuffer | None
    reply: Callable[[QueryReply], None]
    raw: bool = False
    """Also return the model's raw first output (for accuracy and divergence runs)."""
    labels: bool = False
    """Also return the labels of the post-processed class indices (when the model has them)."""
    more: tuple[np.ndarray, ...] = ()
    """The further inputs of a multi-input model, in manifest order; those left out are
    filled (:meth:`Model.fill`)."""
    preprocessed: bool = False
    """``inputs`` is already the first input's pre-processed form (samples an agent
    holds pre-processed: :mod:`agent.samplelib`); its pre-processing is skipped."""
    released: threading.Event | None = None
    """Set when the query's evaluation is released (its job ended or was cancelled): a
    query still queued then is answered with an error and never run, so a cancelled
    run's backlog does not keep the host busy under the next measurement."""

    @property
    def ready(self) -> bool:
        """Nothing to do before its predict but fill: pre-processed, and gathered."""
        return self.preprocessed and not isinstance(self.inputs, Deferred)


PENDING, CLAIMED, DONE = 0, 1, 2
"""A slot's pre-processing: nobody's yet, under way, over (or never to be done)."""


@dataclass(eq=False, slots=True)
class Slot:
    """An admitted query in the executor."""

    job: Job
    seq: int
    samples: int
    nbytes: int
    """Bytes of the query's inputs, counted against the executor's ``inflight_bytes``."""
    state: int = PENDING
    latch: threading.Lock | None = None
    x: Any = None
    """The model's inputs for this query (a list), pre-processed, filled where not
    carried; None until then."""
    error: MLScopeError | None = None
    t_pre: int = 0
    t_pre_end: int = 0
    replied: bool = False


# ------------------------------------------------------------------ inputs


def query_inputs(m: Model, job: Job) -> list[np.ndarray]:
    """The model's inputs for ``job`` (:func:`model_inputs`); a query that is not a
    batch of samples, or that an operator fails on (or its gathering, when
    :class:`Deferred`), is an InputMismatchError."""
    given = job.inputs
    try:
        raw = given.take() if isinstance(given, Deferred) else given
        if raw.ndim < 1 or raw.shape[0] < 1:
            raise InputMismatchError(
                f"{m.name}: a query needs a batch of at least one sample",
                model=m.name,
                framework=m.predictor.framework,
                expected="(batch, ...)",
                actual=list(raw.shape),
            )
        return model_inputs(m, raw, job.more, done=job.preprocessed)
    except MLScopeError:
        raise
    except Exception as exc:  # an operator's own error: the query was malformed
        raise InputMismatchError(
            f"{m.name}: pre-processing failed: {exc}",
            model=m.name,
            framework=m.predictor.framework,
            index=job.index,
            expected=[None, *m.sample_shape],
            actual={"shape": list(given.shape), "dtype": str(given.dtype)},
        ) from exc


def model_inputs(
    m: Model, raw: np.ndarray, more: tuple[np.ndarray, ...], *, done: bool = False
) -> list[np.ndarray]:
    """Each input through its own pre-processing (the first not when ``done``);
    inputs the query left out filled."""
    pre = m.pre
    if len(more) >= len(pre):
        raise InputMismatchError(
            f"{m.name} takes {len(pre)} input(s), the query carried {1 + len(more)}",
            model=m.name,
            framework=m.predictor.framework,
            expected=len(pre),
            actual=1 + len(more),
        )
    rest = [
        pre[n](more[n - 1]) if n <= len(more) else m.fill(n, len(raw)) for n in range(1, len(pre))
    ]
    return [raw if done else pre[0](raw), *rest]


def merge_inputs(m: Model, parts: list[list[np.ndarray]]) -> list[np.ndarray]:
    """Several queries' inputs as one batch: each joined on its batch axis; an input
    shared by the batch must be equal in all (else ValueError: run them one by one)."""
    out = []
    for n, axis in enumerate(m.batch_axes):
        arrays = [p[n] for p in parts]
        if axis is not None:
            out.append(np.concatenate(arrays, axis=axis))
        elif all(np.array_equal(a, arrays[0]) for a in arrays[1:]):
            out.append(arrays[0])
        else:
            raise ValueError(f"queries disagree on shared input {n}")
    return out


# ------------------------------------------------------------------ inference


def infer(m: Model, slots: list[Slot], outcomes: dict[int, Outcome]) -> None:
    """The pre-processed ``slots`` predicted and post-processed as one batch: each one's
    outcome, by seq, into ``outcomes``."""
    try:
        xs = slots[0].x if len(slots) == 1 else merge_inputs(m, [s.x for s in slots])
        level = max(s.job.level for s in slots)
        out, cap, t_pred, t_post = predict(m, xs, level)
        result = m.post(out[0])
        t_end = now()
    except Exception as exc:
        if len(slots) > 1:  # isolate the culprit: one query at a time
            for s in slots:
                infer(m, [s], outcomes)
            return
        outcomes[slots[0].seq] = Outcome(error=inference_error(m, exc, slots[0].samples))
        return
    if len(slots) == 1:  # the common case: no split
        parts, raws, total = [result], [out[0]], slots[0].samples
    else:
        bounds = np.cumsum([s.samples for s in slots])[:-1]
        parts, raws = np.split(result, bounds), np.split(out[0], bounds)
        total = int(bounds[-1] + slots[-1].samples)
    for s, part, raw in zip(slots, parts, raws, strict=True):
        outcomes[s.seq] = Outcome(
            result=part,
            raw=raw if s.job.raw else None,
            t_predict=t_pred,
            t_predict_end=t_post,
            t_post_end=t_end,
            batch=total,
            capture=cap,
        )


def predict(
    m: Model, xs: list[np.ndarray], level: TraceLevel
) -> tuple[list[np.ndarray], Capture, int, int]:
    """The one call site of ``predictor.predict``: (outputs, capture, start, end).
    At level framework or more it runs under the framework's own profiler (its
    layer spans go under each query's predict); start and end are taken inside the
    capture, so the profiler's own start and stop stay out of the predict span."""
    predictor = m.predictor
    if level < TraceLevel.FRAMEWORK:
        t0 = now()
        out = predictor.predict(xs)
        return out, NULL, t0, now()
    with profiling.capture(predictor, full=level >= TraceLevel.FULL) as cap:
        t0 = now()
        out = predictor.predict(xs)
        t1 = now()
    return out, cap, t0, t1


def inference_error(m: Model, exc: Exception, samples: int) -> MLScopeError:
    """A query's predict or post-processing failed: its typed error."""
    if isinstance(exc, MLScopeError):
        return exc
    return InferenceError(
        f"{m.name}: {exc}", model=m.name, framework=m.predictor.framework, batch_size=samples
    )


# ------------------------------------------------------------------ replies


def build_reply(m: Model, job: Job, out: Outcome, *, pre: tuple[int, int]) -> QueryReply:
    """The reply to ``job`` from its outcome; its model-level spans (pre-processed over
    ``pre``) are written on the way."""
    labels = _labels(m, out) if job.labels and out.error is None else None
    if out.error is not None:
        return QueryReply(
            index=job.index,
            ok=False,
            error=out.error.to_wire(),
            t_received=job.received_ns,
            t_replied=now(),
        )
    if job.spans is not None and job.level >= TraceLevel.MODEL:
        samples = int(job.inputs.shape[0])
        emit_spans(job.spans, job.index, job.level, samples, job.received_ns, out, pre=pre)
    return QueryReply(
        index=job.index,
        ok=True,
        outputs=np.ascontiguousarray(out.result),
        raw_outputs=None if out.raw is None else np.ascontiguousarray(out.raw),
        labels=labels,
        t_received=job.received_ns,
        t_predict_start=out.t_predict,
        t_predict_end=out.t_predict_end,
        t_replied=now(),
    )


def unbuilt_reply(m: Model, job: Job, exc: Exception) -> QueryReply:
    """The reply to ``job`` when :func:`build_reply` failed: the failure as the query's
    error, built without validation."""
    err = InferenceError(f"{m.name}: reply: {exc!r}", model=m.name, framework=m.predictor.framework)
    return QueryReply.model_construct(
        index=job.index,
        ok=False,
        error=err.to_wire(),
        t_received=job.received_ns,
        t_replied=now(),
    )


def _labels(m: Model, out: Outcome) -> np.ndarray | None:
    """The labels of a query's result (only asked for outside load runs); a lookup
    that fails turns the outcome into the query's error."""
    if m.labeler is None or out.result is None:
        return None
    try:
        return m.labeler(out.result)
    except (ValueError, IndexError, TypeError) as exc:
        out.error = InferenceError(
            f"{m.name}: labels: {exc}", model=m.name, framework=m.predictor.framework
        )
        return None
