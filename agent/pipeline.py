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
  thread itself: it takes the next query's inputs, predicts, and post-processes the
  answers in blocks (at most :data:`STREAM_BLOCK` queries or :data:`STREAM_FLUSH_NS`
  after the oldest one's predict ended), with no hand-off, reply object or queue per
  query, so a small model's runtime is not kept waiting by the platform's Python.
* **Errors are per query.** A query whose pre-processing fails gets its typed error
  and drops out of the batch; when a merged batch fails, its queries are retried one
  by one so that only the culprit gets the error. The thread never dies on a query.

One call site runs ``predictor.predict`` (:meth:`Executor._predict`) and one function
emits a query's spans (:func:`emit_spans`): framework-level profiling hooks go there.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from agent import profiling
from agent.profiling import NULL, Capture
from agent.tracer import SpanBuffer
from mlscope.contracts import QueryReply, TraceLevel
from mlscope.errors import InferenceError, InputMismatchError, MLScopeError
from mlscope.operators import Pipeline
from mlscope.predictor import Predictor

__all__ = [
    "STREAM_BLOCK",
    "STREAM_BYTES",
    "STREAM_FLUSH_NS",
    "STREAM_HELPER_NS",
    "Answered",
    "Executor",
    "ExecutorConfig",
    "Job",
    "Model",
    "Stream",
    "emit_spans",
]

now = time.perf_counter_ns

_PENDING, _CLAIMED, _DONE = 0, 1, 2
_INLINE_SEQ = -2
"""The seq of a query run by :meth:`Executor.try_inline` (outside the ready stream)."""
STREAM_BLOCK = 64
"""Most queries of a stream post-processed in one call."""
STREAM_HELPER_NS = 1_000_000
"""A stream whose predict takes at least this long answers its blocks on a thread of its
own (:class:`_Answerer`), while the next predict runs: right after a long predict, the
post-processing of one query runs cold (efficientnet_lite0's top-5 of 1,000 scores:
~215 µs, against 34 µs in a warm loop) and would keep the runtime waiting."""
STREAM_BYTES = 16 << 20
"""... and most bytes of raw outputs a stream keeps for it (a model with large outputs
answers sooner)."""
STREAM_FLUSH_NS = 5_000_000
"""A stream post-processes its answers before the oldest waiting one would be this late
(its predict's end to its answer; a predict longer than this answers each query at
once). Post-processing a block costs ~100-200 µs on top of its rows on a 2-core VM,
which a 0.2 ms batch of a small model could not afford per query."""


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


@dataclass(slots=True)
class Answered:
    """Queries of a stream answered together, in issue order: one value per query in
    each array; the outputs of those that succeeded, in order, in one array."""

    index: np.ndarray
    received: np.ndarray
    """When the predict thread took each query (ns, ``perf_counter_ns``)."""
    predict_start: np.ndarray
    predict_end: np.ndarray
    ok: np.ndarray
    """Whether each query was answered (else its error is in :attr:`errors`)."""
    outputs: np.ndarray | None
    """The post-processed outputs of the queries answered, joined on axis 0."""
    errors: dict[int, MLScopeError]
    """Position in this block -> the query's typed error."""
    post_end: int
    """When the block's post-processing ended (its answers' time)."""


class Stream(Protocol):
    """A closed loop the predict thread runs itself (:meth:`Executor.stream`)."""

    level: TraceLevel
    """Below :attr:`TraceLevel.FRAMEWORK` (profilers need a query at a time)."""
    spans: SpanBuffer | None

    def next_query(self) -> tuple[int, np.ndarray] | None:
        """The next query: its index and its first input, pre-processed (axis 0 the
        batch); None ends the stream."""
        ...

    def answered(self, block: Answered) -> None:
        """Queries answered, in issue order: on the predict thread, or (a model whose
        predict takes :data:`STREAM_HELPER_NS` or more) on one thread of its own while
        :meth:`next_query` goes on being called on the predict thread."""
        ...


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


@dataclass(slots=True)
class _Outcome:
    """What one query of a predicted batch gets back."""

    result: np.ndarray | None = None
    raw: np.ndarray | None = None
    error: MLScopeError | None = None
    t_predict: int = 0
    t_predict_end: int = 0
    t_post_end: int = 0
    batch: int = 0
    capture: Capture = NULL
    """Framework-level profile of the predict call (empty below level framework)."""


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
                        self._finish(slot, _Outcome(error=err))

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
            self._ensure_preprocessed(slot)
        with self._predicting:
            self._answer(batch, idle_next=idle_next)

    def _answer(self, batch: list[_Slot], *, idle_next: bool = False) -> None:
        """Predict the pre-processed ``batch`` and reply to each of its queries."""
        good = [s for s in batch if s.error is None]
        outcomes: dict[int, _Outcome] = {}
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
            out = outcomes.get(slot.seq) or _Outcome(error=slot.error)
            self._finish(slot, out)

    def _infer(self, slots: list[_Slot], outcomes: dict[int, _Outcome]) -> None:
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
            outcomes[slots[0].seq] = _Outcome(error=self._failed(exc, slots[0].samples))
            return
        if len(slots) == 1:  # the common case: no split
            parts, raws, total = [result], [out[0]], slots[0].samples
        else:
            bounds = np.cumsum([s.samples for s in slots])[:-1]
            parts, raws = np.split(result, bounds), np.split(out[0], bounds)
            total = int(bounds[-1] + slots[-1].samples)
        for s, part, raw in zip(slots, parts, raws, strict=True):
            outcomes[s.seq] = _Outcome(
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
                self._stream_loop(call.stream)
        except BaseException as exc:  # the stream's code: raised in Executor.stream
            call.error = exc
        finally:
            call.done.set()

    def _stream_loop(self, s: Stream) -> None:
        times: list[tuple[int, int, int, int]] = []  # index, taken, predict start, end
        raw: list[np.ndarray | MLScopeError] = []  # each query's first output, or error
        kept = 0
        helper: _Answerer | None = None
        try:
            while not self._stopping and (got := s.next_query()) is not None:
                i, x = got
                t_in = now()
                try:
                    out, _, t0, t1 = self._predict(self._inputs(x, (), done=True), s.level)
                    raw.append(out[0])
                    kept += out[0].nbytes
                except Exception as exc:  # the query's error: the stream goes on
                    t0 = t1 = now()
                    raw.append(self._failed(exc, int(x.shape[0])))
                times.append((i, t_in, t0, t1))
                # Answer now if the next predict would make the oldest answer late.
                late = 2 * t1 - t0 - times[0][3] >= STREAM_FLUSH_NS
                if late or len(raw) >= STREAM_BLOCK or kept >= STREAM_BYTES:
                    if helper is None and t1 - t0 >= STREAM_HELPER_NS:
                        helper = _Answerer(self, s)
                    if helper is not None:  # from then on every block: they stay in order
                        helper.put(times, raw)
                    else:
                        self._stream_answer(s, times, raw)
                    times, raw, kept = [], [], 0
                if helper is not None and helper.error is not None:
                    break
            if raw:
                if helper is not None:
                    helper.put(times, raw)
                else:
                    self._stream_answer(s, times, raw)
        finally:
            if helper is not None:
                helper.close()  # its blocks answered; its error raised

    def _stream_answer(
        self,
        s: Stream,
        times: list[tuple[int, int, int, int]],
        raw: list[np.ndarray | MLScopeError],
    ) -> None:
        """Post-process a block's outputs in one call (one by one when that fails, so
        only the culprit gets the error), emit their spans, hand them to the stream."""
        post = self.model.post
        errors = {k: r for k, r in enumerate(raw) if isinstance(r, MLScopeError)}
        good = [r for r in raw if not isinstance(r, MLScopeError)]
        outputs: np.ndarray | None = None
        try:
            if good:
                outputs = post(good[0] if len(good) == 1 else np.concatenate(good))
        except Exception:
            parts = []
            for k, r in enumerate(raw):
                if isinstance(r, MLScopeError):
                    continue
                try:
                    parts.append(post(r))
                except Exception as exc:
                    errors[k] = self._failed(exc, len(r))
            outputs = np.concatenate(parts) if parts else None
        cols = np.array(times, dtype=np.int64).reshape(-1, 4)
        ok = np.ones(len(raw), bool)
        ok[list(errors)] = False
        block = Answered(
            index=cols[:, 0],
            received=cols[:, 1],
            predict_start=cols[:, 2],
            predict_end=cols[:, 3],
            ok=ok,
            outputs=outputs,
            errors=errors,
            post_end=now(),
        )
        if s.spans is not None and s.level >= TraceLevel.MODEL:
            for k, (i, t_in, t0, t1) in enumerate(times):
                r = raw[k]
                if not isinstance(r, MLScopeError) and k not in errors:
                    done = _Outcome(
                        t_predict=t0, t_predict_end=t1, t_post_end=block.post_end, batch=len(r)
                    )
                    emit_spans(s.spans, i, s.level, len(r), t_in, done, pre=(t_in, t_in))
        s.answered(block)

    # ------------------------------------------------------------------ replies

    def _finish(self, slot: _Slot, out: _Outcome) -> None:
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
        slot.replied = True
        with self._lock:
            self._inflight -= 1
        job.reply(reply)

    def _labels(self, out: _Outcome) -> np.ndarray | None:
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


def emit_spans(
    spans: SpanBuffer,
    index: int,
    level: TraceLevel,
    samples: int,
    received_ns: int,
    out: _Outcome,
    *,
    pre: tuple[int, int],
) -> None:
    """The model-level spans of one answered query (``samples`` of them, received at
    ``received_ns``, pre-processed over ``pre``): query > preprocess, predict, post."""
    t_pre, t_pre_end = pre
    attrs: dict[str, Any] = {"batch_size": samples}
    if out.batch != attrs["batch_size"]:
        attrs["predict_batch"] = out.batch  # merged with other queries
    root = spans.add(
        parent=0,
        query_index=index,
        level=TraceLevel.MODEL,
        kind="query",
        name="query",
        start_ns=received_ns,
        end_ns=out.t_post_end,
        attrs=attrs,
    )
    for name, a, b in (
        ("preprocess", t_pre, t_pre_end),
        ("predict", out.t_predict, out.t_predict_end),
        ("postprocess", out.t_predict_end, out.t_post_end),
    ):
        cap = out.capture if name == "predict" else NULL
        step_attrs = (
            {"profiler_ns": max(cap.end_ns - cap.start_ns - (b - a), 0)}
            if cap is not NULL and cap.end_ns
            else None
        )
        sid = spans.add(
            parent=root,
            query_index=index,
            level=TraceLevel.MODEL,
            kind="step",
            name=name,
            start_ns=a,
            end_ns=b,
            attrs=step_attrs,
        )
        if cap is not NULL and level >= TraceLevel.FRAMEWORK:
            cap.emit(spans, parent=sid, query_index=index, window=(a, b))


class _Answerer:
    """A stream's blocks answered on a thread of its own, in the order they were put
    (:data:`STREAM_HELPER_NS`); the first error of the stream's code stops it and is
    raised by :meth:`close`."""

    def __init__(self, executor: Executor, stream: Stream) -> None:
        self.executor, self.stream = executor, stream
        self.error: BaseException | None = None
        self._q: queue.SimpleQueue[
            tuple[list[tuple[int, int, int, int]], list[np.ndarray | MLScopeError]] | None
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name=f"post-{executor.model.name}", daemon=True
        )
        self._thread.start()

    def put(
        self, times: list[tuple[int, int, int, int]], raw: list[np.ndarray | MLScopeError]
    ) -> None:
        self._q.put((times, raw))

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            if self.error is not None:
                continue  # the stream is ending: the rest go unanswered
            try:
                self.executor._stream_answer(self.stream, *item)
            except BaseException as exc:  # the stream's code: raised by close()
                self.error = exc

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()
        if self.error is not None:
            raise self.error
