"""The streaming pipeline executor (paper section 4.4.2): one per loaded model.

::

    submit ──► ready stream (ordered) ────────────────► predict thread ──► reply
       │                                                   ▲  batch, predict,
       └──► work stream ──► pre-processing pool ──(latch)──┘  post, emit
                               (K threads)

* **Admission / backpressure.** At most ``capacity`` queries are admitted and not yet
  answered; :meth:`Executor.submit` returns False beyond that and the agent answers
  "overloaded" at the edge. Nothing else queues, so no stream is unbounded.
* **Pre-processing overlaps inference.** Each admitted query is offered to a pool of
  ``pre_workers`` threads, which pre-process it while the predict thread runs earlier
  batches (the runtimes release the GIL while they compute). A query that the predict
  thread is already idly waiting for is pre-processed inline instead: an idle pipeline
  then costs one thread hand-off per query, like a plain worker thread. A query whose
  samples are held pre-processed (``Job.preprocessed``) is ready when it is submitted:
  no pool thread wakes for it.
* **Dynamic batching.** The predict thread takes queries in arrival order and merges
  consecutive ones into one ``predict`` call until ``max_batch`` samples are gathered
  or the first query is ``max_wait_us`` old; a query that would overflow the batch
  starts the next one. A full query (its own batch already ``max_batch``) never waits.
* **Order.** Replies leave in admission order, errors included.
* **Streams.** A closed loop that only measures throughput (:meth:`Executor.stream`:
  an agent's ``batched`` run on samples it holds pre-processed) is run by the predict
  thread itself, between the queries admitted before and after it (:mod:`agent.stream`).
* **Errors are per query.** A query whose pre-processing fails gets its typed error
  and drops out of the batch; when a merged batch fails, its queries are retried one
  by one so that only the culprit gets the error. The thread never dies on a query.

One call site runs ``predictor.predict`` (:meth:`Executor._predict`) and one function
emits a query's spans (:func:`agent.queryspans.emit_spans`): framework-level profiling
hooks go there.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from agent import profiling
from agent import stream as streams
from agent.profiling import NULL, Capture
from agent.queryspans import Outcome, emit_spans
from agent.stream import Stream
from agent.tracer import SpanBuffer
from mlscope.contracts import QueryReply, TraceLevel
from mlscope.errors import EvaluationError, InferenceError, InputMismatchError, MLScopeError
from mlscope.operators import Pipeline
from mlscope.predictor import Predictor

__all__ = ["Executor", "ExecutorConfig", "Job", "Model"]

now = time.perf_counter_ns
log = logging.getLogger("mlscope.agent")

_PENDING, _CLAIMED, _DONE = 0, 1, 2
_INLINE_SEQ = -2
"""The seq of a query run by :meth:`Executor.try_inline` (outside the ready stream)."""


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


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    capacity: int = 256
    """Queries admitted and not yet answered; beyond it :meth:`Executor.submit` refuses."""
    pre_workers: int = 2
    """Threads that pre-process queries while earlier batches are predicted."""
    max_batch: int = 1
    """Most samples in one ``predict`` call (queries are merged up to it)."""
    max_wait_us: int = 500
    """How long the first query of a partial batch waits for more (from its arrival)."""
    inline_max_us: int = 150
    """:meth:`Executor.try_inline` runs a query on the caller's thread when the pipeline
    is idle and the last query took at most this long in the executor (pre-processing
    to post-processing); 0 never does."""


@dataclass(frozen=True, slots=True)
class Job:
    """One query as the executor sees it."""

    index: int
    inputs: np.ndarray
    """The first input: a batch of raw samples (its axis 0 is the batch)."""
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


@dataclass(eq=False, slots=True)
class _StreamCall:
    stream: Stream
    done: threading.Event
    error: BaseException | None = None


@dataclass(eq=False, slots=True)
class _Slot:
    job: Job
    seq: int
    samples: int
    state: int = _PENDING
    latch: threading.Lock | None = None
    x: Any = None
    """The model's inputs for this query (a list), pre-processed, filled where not
    carried; None until then."""
    error: MLScopeError | None = None
    t_pre: int = 0
    t_pre_end: int = 0
    replied: bool = False


class Executor:
    """Pre-process pool -> batching predict thread -> post-process -> reply, in order."""

    def __init__(
        self, model: Model, config: ExecutorConfig | None = None, *, warm: bool = False
    ) -> None:
        """``warm``: the predict thread's first act is the model's first inference
        (``model.warmup()``; :meth:`first_inference_ns` waits for it). A TorchScript
        model runs at full speed only on the thread that ran it first: with two
        intra-op threads, 15 ms a call there and 33 ms on another thread of the same
        process, so the thread that will predict is the one that warms it up."""
        self.model = model
        self.config = config or ExecutorConfig()
        self.max_batch = self.config.max_batch
        self._max_wait_ns = self.config.max_wait_us * 1000
        self._lock = threading.Lock()
        self._inflight = 0
        self._seq = 0
        self._idle_seq = -1  # the seq the predict thread is idly waiting for, else -1
        self._predicting = threading.Lock()
        """Held around every batch: the predict thread and an inline query never
        call the predictor at once."""
        self._last_ns = 1 << 62  # the last query's time in the executor (none yet: slow)
        self._inline_ns = self.config.inline_max_us * 1000
        self._warm = warm
        self._stopping = False
        self._first: queue.SimpleQueue[int | BaseException] = queue.SimpleQueue()
        self._ready: queue.SimpleQueue[_Slot | _StreamCall | None] = queue.SimpleQueue()
        self._work: queue.SimpleQueue[_Slot | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._pre_loop, name=f"pre-{model.name}-{i}", daemon=True)
            for i in range(self.config.pre_workers)
        ]
        self._threads.append(
            threading.Thread(target=self._predict_loop, name=f"infer-{model.name}", daemon=True)
        )
        self._stream_host = streams.Host(
            name=model.name,
            predict=self._predict_ready,
            post=lambda raw: self.model.post(raw),
            failed=self._failed,
            stopping=lambda: self._stopping,
        )
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ edge

    def submit(self, job: Job) -> bool:
        """Admit a query; False when ``capacity`` queries are in flight (answer overloaded)."""
        with self._lock:
            if self._inflight >= self.config.capacity:
                return False
            self._inflight += 1
            seq = self._seq
            self._seq += 1
        samples = int(job.inputs.shape[0]) if job.inputs.ndim else 1
        slot = _Slot(job, seq, samples)
        if job.preprocessed:  # nothing to overlap: ready now, no pool thread woken
            self._preprocess(slot)
            slot.state = _DONE
        self._ready.put(slot)
        if not job.preprocessed and seq != self._idle_seq and self.config.pre_workers:
            self._work.put(slot)
        return True

    def try_inline(self, job: Job) -> bool:
        """Run ``job`` to its reply on the calling thread, if that is cheap; False: it
        was not run (submit it).

        An idle pipeline whose last query took at most ``inline_max_us`` (a null or tiny
        model) answers on the caller's thread, the event loop that received the query:
        no hand-off to the predict thread and back, each a thread wake-up that costs
        more than such a query's whole predict. Never below trace level framework
        (profilers belong to the predict thread), never while anything is in flight
        (replies stay in order)."""
        if self._last_ns > self._inline_ns or job.level >= TraceLevel.FRAMEWORK:
            return False
        with self._lock:
            if self._inflight or not self._predicting.acquire(blocking=False):
                return False
            self._inflight += 1
        try:
            slot = _Slot(job, _INLINE_SEQ, int(job.inputs.shape[0]) if job.inputs.ndim else 1)
            self._preprocess(slot)
            slot.state = _DONE
            self._answer([slot])
        finally:
            self._predicting.release()
        return True

    def stream(self, s: Stream, *, timeout: float) -> None:
        """Run ``s`` on the predict thread (after the queries admitted before it) until
        its :meth:`Stream.next_query` says None; returns when its last answers were
        given. An exception of the stream's own code ends it and is raised here; a
        stream still running after ``timeout`` seconds is an InferenceError (the
        stream should then be told to end)."""
        if s.level >= TraceLevel.FRAMEWORK:
            raise InferenceError(
                f"{self.model.name}: a stream runs below trace level framework",
                model=self.model.name,
                framework=self.model.predictor.framework,
            )
        call = _StreamCall(s, threading.Event())
        self._ready.put(call)
        if not call.done.wait(timeout):
            raise InferenceError(
                f"{self.model.name}: a stream did not end within {timeout:.0f} s",
                model=self.model.name,
                framework=self.model.predictor.framework,
            )
        if call.error is not None:
            raise call.error

    @property
    def inflight(self) -> int:
        return self._inflight

    def thread_ids(self) -> list[int]:
        """Native ids of the executor's threads (pre-processing pool and predict), for
        a caller that sets their scheduling (an agent's local open-loop run)."""
        return [t.native_id for t in self._threads if t.native_id is not None]

    def stop(self, *, close: bool = True) -> None:
        """Answer what was admitted, stop the threads, emit the layer spans the
        framework profiler held back and (unless told not to, for a model that is
        reused) close the predictor. A stream still running ends at its next query."""
        self._stopping = True
        self._ready.put(None)
        for _ in range(self.config.pre_workers):
            self._work.put(None)
        for t in self._threads:
            t.join(timeout=10)
        profiling.flush(self.model.predictor)  # layer spans a profiler still holds
        if close:
            self.model.predictor.close()

    # ------------------------------------------------------------------ pre-processing

    def _pre_loop(self) -> None:
        while (slot := self._work.get()) is not None:
            if slot.seq == self._idle_seq:
                continue  # the idle predict thread does it inline: no hand-off
            with self._lock:
                if slot.state != _PENDING:
                    continue
                slot.state = _CLAIMED
                slot.latch = latch = threading.Lock()
                latch.acquire()
            self._preprocess(slot)
            slot.state = _DONE
            latch.release()

    def _preprocess(self, slot: _Slot) -> None:
        m, raw = self.model, slot.job.inputs
        slot.t_pre = now()
        try:
            if raw.ndim < 1 or raw.shape[0] < 1:
                raise InputMismatchError(
                    f"{m.name}: a query needs a batch of at least one sample",
                    model=m.name,
                    framework=m.predictor.framework,
                    expected="(batch, ...)",
                    actual=list(raw.shape),
                )
            slot.x = self._inputs(raw, slot.job.more, done=slot.job.preprocessed)
        except MLScopeError as exc:
            slot.error = exc
        except Exception as exc:  # an operator's own error: the query was malformed
            slot.error = InputMismatchError(
                f"{m.name}: pre-processing failed: {exc}",
                model=m.name,
                framework=m.predictor.framework,
                index=slot.job.index,
                expected=[None, *m.sample_shape],
                actual={"shape": list(raw.shape), "dtype": str(raw.dtype)},
            )
        slot.t_pre_end = now()

    def _inputs(
        self, raw: np.ndarray, more: tuple[np.ndarray, ...], *, done: bool = False
    ) -> list[np.ndarray]:
        """Each input through its own pre-processing (the first not when ``done``);
        inputs the query left out filled."""
        m = self.model
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
            pre[n](more[n - 1]) if n <= len(more) else m.fill(n, len(raw))
            for n in range(1, len(pre))
        ]
        return [raw if done else pre[0](raw), *rest]

    def _merge(self, parts: list[list[np.ndarray]]) -> list[np.ndarray]:
        """Several queries' inputs as one batch: each joined on its batch axis; an input
        shared by the batch must be equal in all (else ValueError: run them one by one)."""
        out = []
        for n, axis in enumerate(self.model.batch_axes):
            arrays = [p[n] for p in parts]
            if axis is not None:
                out.append(np.concatenate(arrays, axis=axis))
            elif all(np.array_equal(a, arrays[0]) for a in arrays[1:]):
                out.append(arrays[0])
            else:
                raise ValueError(f"queries disagree on shared input {n}")
        return out

    def _ensure_preprocessed(self, slot: _Slot) -> None:
        with self._lock:
            mine = slot.state == _PENDING
            if mine:
                slot.state = _CLAIMED
        if mine:
            self._preprocess(slot)
            slot.state = _DONE
        elif slot.state != _DONE and slot.latch is not None:
            slot.latch.acquire()  # released by the pool thread when it is done
            slot.latch.release()

    def _drop(self, slot: _Slot) -> None:
        """A query of a released evaluation: not pre-processed (a pool thread already at
        it is waited for), not predicted; answered with an error."""
        with self._lock:
            mine = slot.state == _PENDING
            if mine:
                slot.state = _DONE
        if not mine and slot.state != _DONE and slot.latch is not None:
            slot.latch.acquire()
            slot.latch.release()
        slot.error = EvaluationError(
            f"{self.model.name}: evaluation released before query {slot.job.index} ran",
            index=slot.job.index,
        )

    # ------------------------------------------------------------------ batching

    def first_inference_ns(self) -> int:
        """How long the model's first inference took on the predict thread (only with
        ``warm``); its error raised when it failed (the executor is then of no use)."""
        got = self._first.get()
        self._first.put(got)  # a second caller sees the same
        if isinstance(got, BaseException):
            raise got
        return got

    def _first_inference(self) -> None:
        warmup = getattr(self.model, "warmup", None)
        try:
            with self._predicting:
                took = int(warmup()) if warmup is not None else 0
        except BaseException as exc:  # handed to whoever waits: a model's own error
            self._first.put(exc)
            return
        self._first.put(took)

    def _predict_loop(self) -> None:
        if self._warm:
            self._first_inference()
        held: _Slot | _StreamCall | None = None
        stopping = False
        while not stopping:
            first = held
            if first is None:
                first = self._ready.get()
                self._idle_seq = -1
                if first is None:
                    break
            if isinstance(first, _StreamCall):
                held = None
                self._run_stream(first)
                continue
            batch, held, stopping = self._gather(first)
            try:
                self._run_batch(batch, idle_next=held is None)
            except Exception as exc:  # a fault here must not stop the model: answer, go on
                m = self.model
                err = InferenceError(
                    f"{m.name}: pipeline failure: {exc!r}",
                    model=m.name,
                    framework=m.predictor.framework,
                )
                for slot in batch:
                    if not slot.replied:
                        try:
                            self._finish(slot, Outcome(error=err))
                        except Exception as again:  # its replier failed: the next query goes on
                            log.error(
                                "%s: query %d not answered: %r", m.name, slot.job.index, again
                            )

    def _gather(self, first: _Slot) -> tuple[list[_Slot], _Slot | _StreamCall | None, bool]:
        """Consecutive queries up to ``max_batch`` samples or the first one's max wait."""
        batch, n, limit = [first], first.samples, self.max_batch
        deadline = first.job.received_ns + self._max_wait_ns
        while n < limit:
            left = (deadline - now()) / 1e9
            try:
                nxt = self._ready.get(timeout=left) if left > 0 else self._ready.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                return batch, None, True
            if isinstance(nxt, _StreamCall) or n + nxt.samples > limit:
                return batch, nxt, False
            batch.append(nxt)
            n += nxt.samples
        return batch, None, False

    # ------------------------------------------------------------------ inference

    def _run_batch(self, batch: list[_Slot], *, idle_next: bool) -> None:
        for slot in batch:
            released = slot.job.released
            if released is not None and released.is_set():
                self._drop(slot)
            else:
                self._ensure_preprocessed(slot)
        with self._predicting:
            self._answer(batch, idle_next=idle_next)

    def _answer(self, batch: list[_Slot], *, idle_next: bool = False) -> None:
        """Predict the pre-processed ``batch`` and reply to each of its queries."""
        good = [s for s in batch if s.error is None]
        outcomes: dict[int, Outcome] = {}
        if good:
            self._infer(good, outcomes)
            out = outcomes.get(good[-1].seq)
            if out is not None and out.error is None:
                self._last_ns = (out.t_post_end - good[0].t_pre) // len(good)
        if idle_next:
            # Before the replies go out: a query sent in answer to one of them finds
            # this thread about to be idle and is pre-processed inline, not by the pool.
            with self._lock:
                self._idle_seq = self._seq if self._ready.empty() else -1
        for slot in batch:
            out = outcomes.get(slot.seq) or Outcome(error=slot.error)
            self._finish(slot, out)

    def _infer(self, slots: list[_Slot], outcomes: dict[int, Outcome]) -> None:
        m = self.model
        try:
            xs = slots[0].x if len(slots) == 1 else self._merge([s.x for s in slots])
            level = max(s.job.level for s in slots)
            out, cap, t_pred, t_post = self._predict(xs, level)
            result = m.post(out[0])
            t_end = now()
        except Exception as exc:
            if len(slots) > 1:  # isolate the culprit: one query at a time
                for s in slots:
                    self._infer([s], outcomes)
                return
            outcomes[slots[0].seq] = Outcome(error=self._failed(exc, slots[0].samples))
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

    def _failed(self, exc: Exception, samples: int) -> MLScopeError:
        """A query's predict or post-processing failed: its typed error."""
        if isinstance(exc, MLScopeError):
            return exc
        m = self.model
        return InferenceError(
            f"{m.name}: {exc}", model=m.name, framework=m.predictor.framework, batch_size=samples
        )

    def _predict(
        self, xs: list[np.ndarray], level: TraceLevel
    ) -> tuple[list[np.ndarray], Capture, int, int]:
        """The one call site of ``predictor.predict``: (outputs, capture, start, end).
        At level framework or more it runs under the framework's own profiler (its
        layer spans go under each query's predict); start and end are taken inside the
        capture, so the profiler's own start and stop stay out of the predict span."""
        predictor = self.model.predictor
        if level < TraceLevel.FRAMEWORK:
            t0 = now()
            out = predictor.predict(xs)
            return out, NULL, t0, now()
        with profiling.capture(predictor, full=level >= TraceLevel.FULL) as cap:
            t0 = now()
            out = predictor.predict(xs)
            t1 = now()
        return out, cap, t0, t1

    # ------------------------------------------------------------------ streams

    def _run_stream(self, call: _StreamCall) -> None:
        """A stream, to its end; its own code's exception is handed to the caller."""
        try:
            with self._predicting:
                streams.run(self._stream_host, call.stream)
        except BaseException as exc:  # the stream's code: raised in Executor.stream
            call.error = exc
        finally:
            call.done.set()

    def _predict_ready(self, x: np.ndarray, level: TraceLevel) -> tuple[np.ndarray, int, int]:
        """A stream's query: its pre-processed first input predicted (others filled)."""
        out, _, t0, t1 = self._predict(self._inputs(x, (), done=True), level)
        return out[0], t0, t1

    # ------------------------------------------------------------------ replies

    def _finish(self, slot: _Slot, out: Outcome) -> None:
        """Answer one query. A reply that cannot be built is the query's error (built
        without validation), never the predict thread's end."""
        job = slot.job
        try:
            reply = self._reply(slot, out)
        except Exception as exc:
            m = self.model
            err = InferenceError(
                f"{m.name}: reply: {exc!r}", model=m.name, framework=m.predictor.framework
            )
            reply = QueryReply.model_construct(
                index=job.index,
                ok=False,
                error=err.to_wire(),
                t_received=job.received_ns,
                t_replied=now(),
            )
        slot.replied = True
        with self._lock:
            self._inflight -= 1
        job.reply(reply)

    def _reply(self, slot: _Slot, out: Outcome) -> QueryReply:
        job = slot.job
        labels = self._labels(out) if job.labels and out.error is None else None
        if out.error is not None:
            reply = QueryReply(
                index=job.index,
                ok=False,
                error=out.error.to_wire(),
                t_received=job.received_ns,
                t_replied=now(),
            )
        else:
            if job.spans is not None and job.level >= TraceLevel.MODEL:
                samples = int(job.inputs.shape[0])
                emit_spans(
                    job.spans,
                    job.index,
                    job.level,
                    samples,
                    job.received_ns,
                    out,
                    pre=(slot.t_pre, slot.t_pre_end),
                )
            reply = QueryReply(
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
        return reply

    def _labels(self, out: Outcome) -> np.ndarray | None:
        """The labels of a query's result (only asked for outside load runs); a lookup
        that fails turns the outcome into the query's error."""
        m = self.model
        if m.labeler is None or out.result is None:
            return None
        try:
            return m.labeler(out.result)
        except (ValueError, IndexError, TypeError) as exc:
            out.error = InferenceError(
                f"{m.name}: labels: {exc}", model=m.name, framework=m.predictor.framework
            )
            return None
