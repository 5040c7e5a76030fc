"""The streaming pipeline executor (paper section 4.4.2): one per loaded model.

::

    submit ──► ready stream (ordered) ────────────────► predict thread ──► reply
       │                                                   ▲  batch, predict,
       └──► work stream ──► pre-processing pool ──(latch)──┘  post, emit
                               (K threads)

* **Admission / backpressure.** At most ``capacity`` queries, holding at most
  ``inflight_bytes`` of inputs, are admitted and not yet answered; :meth:`Executor.submit`
  returns False beyond either and the agent answers "overloaded" at the edge. Nothing
  else queues, so no stream is unbounded, in queries or in memory.
* **Pre-processing overlaps inference.** Each admitted query is offered to a pool of
  ``pre_workers`` threads, which pre-process it while the predict thread runs earlier
  batches (the runtimes release the GIL while they compute). A query that the predict
  thread is already idly waiting for is pre-processed inline instead: an idle pipeline
  then costs one thread hand-off per query, like a plain worker thread. A query whose
  samples are held pre-processed (``Job.ready``) is ready when it is submitted: no
  pool thread wakes for it; one whose inputs are still to be gathered
  (:class:`agent.job.Deferred`) is gathered as its pre-processing.
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

The threads and their order are here; what is done to a query (its inputs, its batch's
predict, its reply) is :mod:`agent.job`, and the pool's claim on each query
:mod:`agent.prepool`. One call site runs ``predictor.predict`` (:func:`agent.job.predict`)
and one function emits a query's spans (:func:`agent.queryspans.emit_spans`):
framework-level profiling hooks go there.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np

from agent import profiling
from agent import stream as streams
from agent.job import (
    DONE,
    Job,
    Model,
    Slot,
    build_reply,
    infer,
    inference_error,
    model_inputs,
    predict,
    query_inputs,
    unbuilt_reply,
)
from agent.prepool import PrePool
from agent.queryspans import Outcome
from agent.stream import Stream
from mlscope.contracts import TraceLevel
from mlscope.errors import EvaluationError, InferenceError, MLScopeError

__all__ = ["Executor", "ExecutorConfig"]

now = time.perf_counter_ns
log = logging.getLogger("mlscope.agent")

_INLINE_SEQ = -2
"""The seq of a query run by :meth:`Executor.try_inline` (outside the ready stream)."""


@dataclass(frozen=True, kw_only=True)
class ExecutorConfig:
    capacity: int = 256
    """Queries admitted and not yet answered; beyond it :meth:`Executor.submit` refuses."""
    inflight_bytes: int = 1 << 30
    """Bytes of inputs the queries admitted and not yet answered may hold together;
    a query past it is refused as one past ``capacity`` is (an idle executor admits any
    query: each was bounded on its own where it was made). An overloaded open loop of
    large queries would otherwise hold ``capacity`` of them: 256 batches of 64 images
    of 224 × 224 × 3 floats are 9.9 GB."""
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


@dataclass(eq=False, slots=True)
class _StreamCall:
    stream: Stream
    done: threading.Event
    error: BaseException | None = None


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
        self._inflight_bytes = 0
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
        self._ready: queue.SimpleQueue[Slot | _StreamCall | None] = queue.SimpleQueue()
        # What the executor hands its pool and its streams reaches it through a weak
        # proxy: an executor in a reference cycle with itself would keep its model
        # (tens of MB) after the agent dropped it, until the next full GC.
        me = weakref.proxy(self)
        self._pool = PrePool(
            model.name,
            self.config.pre_workers,
            lock=self._lock,
            preprocess=lambda slot: me._preprocess(slot),
            idle_seq=lambda: me._idle_seq,
        )
        self._threads = [
            *self._pool.threads,
            threading.Thread(target=self._predict_loop, name=f"infer-{model.name}", daemon=True),
        ]
        self._stream_host = streams.Host(
            name=model.name,
            predict=lambda x, level: me._predict_ready(x, level),
            post=lambda raw: me.model.post(raw),
            failed=functools.partial(inference_error, model),
            stopping=lambda: me._stopping,
        )
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ edge

    def submit(self, job: Job) -> bool:
        """Admit a query; False when ``capacity`` queries or ``inflight_bytes`` of inputs
        are in flight (answer overloaded)."""
        nbytes = job.inputs.nbytes
        with self._lock:
            if self._full(nbytes):
                return False
            self._inflight += 1
            self._inflight_bytes += nbytes
            seq = self._seq
            self._seq += 1
        samples = int(job.inputs.shape[0]) if job.inputs.ndim else 1
        slot = Slot(job, seq, samples, nbytes)
        ready = job.ready
        if ready:  # nothing to overlap: ready now, no pool thread woken
            self._preprocess(slot)
            slot.state = DONE
        self._ready.put(slot)
        if not ready and seq != self._idle_seq and self.config.pre_workers:
            self._pool.offer(slot)
        return True

    def _full(self, nbytes: int) -> bool:
        return self._inflight >= self.config.capacity or bool(
            self._inflight and self._inflight_bytes + nbytes > self.config.inflight_bytes
        )

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
            self._inflight_bytes += job.inputs.nbytes
        try:
            slot = Slot(
                job,
                _INLINE_SEQ,
                int(job.inputs.shape[0]) if job.inputs.ndim else 1,
                job.inputs.nbytes,
            )
            self._preprocess(slot)
            slot.state = DONE
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
        self._pool.stop()
        for t in self._threads:
            t.join(timeout=10)
        profiling.flush(self.model.predictor)  # layer spans a profiler still holds
        if close:
            self.model.predictor.close()

    # ------------------------------------------------------------------ pre-processing

    def _preprocess(self, slot: Slot) -> None:
        slot.t_pre = now()
        try:
            slot.x = query_inputs(self.model, slot.job)
        except MLScopeError as exc:
            slot.error = exc
        slot.t_pre_end = now()

    def _drop(self, slot: Slot) -> None:
        """A query of a released evaluation: not pre-processed (a pool thread already at
        it is waited for), not predicted; answered with an error."""
        self._pool.skip(slot)
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
        held: Slot | _StreamCall | None = None
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
            held, stopping = self._batch_from(first)

    def _batch_from(self, first: Slot) -> tuple[Slot | _StreamCall | None, bool]:
        """Gather a batch from ``first`` and answer it: the query after it (held for the
        next batch), and whether the executor is stopping. Its queries are this call's
        locals only: the thread keeps nothing of a run once it has answered it (a run's
        last reply holds its schedule, record and samples)."""
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
                        log.error("%s: query %d not answered: %r", m.name, slot.job.index, again)
        return held, stopping

    def _gather(self, first: Slot) -> tuple[list[Slot], Slot | _StreamCall | None, bool]:
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

    def _run_batch(self, batch: list[Slot], *, idle_next: bool) -> None:
        for slot in batch:
            released = slot.job.released
            if released is not None and released.is_set():
                self._drop(slot)
            else:
                self._pool.ensure(slot)
        with self._predicting:
            self._answer(batch, idle_next=idle_next)

    def _answer(self, batch: list[Slot], *, idle_next: bool = False) -> None:
        """Predict the pre-processed ``batch`` and reply to each of its queries."""
        good = [s for s in batch if s.error is None]
        outcomes: dict[int, Outcome] = {}
        if good:
            infer(self.model, good, outcomes)
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
        out, _, t0, t1 = predict(self.model, model_inputs(self.model, x, (), done=True), level)
        return out[0], t0, t1

    # ------------------------------------------------------------------ replies

    def _finish(self, slot: Slot, out: Outcome) -> None:
        """Answer one query. A reply that cannot be built is the query's error, never
        the predict thread's end."""
        job = slot.job
        try:
            reply = build_reply(self.model, job, out, pre=(slot.t_pre, slot.t_pre_end))
        except Exception as exc:
            reply = unbuilt_reply(self.model, job, exc)
        slot.replied = True
        with self._lock:
            self._inflight -= 1
            self._inflight_bytes -= slot.nbytes
        job.reply(reply)
