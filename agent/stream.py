"""A stream: a closed loop the model's predict thread runs itself (``Executor.stream``).

An agent's ``batched`` run on samples it holds pre-processed only measures throughput,
so nothing has to leave between two predicts but the next query's rows. The predict
thread takes the next query (:meth:`Stream.next_query`), predicts, and post-processes
the answers in blocks (at most :data:`STREAM_BLOCK` queries or :data:`STREAM_BYTES` of
outputs, and before the oldest would be :data:`STREAM_FLUSH_NS` late), with no
hand-off, reply object or queue per query, so a small model's runtime is not kept
waiting by the platform's Python. A model whose predicts take :data:`STREAM_HELPER_NS`
or more (most of its last few) answers its blocks on a thread of its own while the
next predict runs.

A query's error is its own (the stream goes on); when a block's post-processing fails,
the block is post-processed query by query so that only the culprit gets the error.
An exception of the stream's own code ends it and reaches the caller.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import numpy as np

from agent.queryspans import Outcome, emit_spans
from agent.tracer import SpanBuffer
from mlscope.contracts import TraceLevel
from mlscope.errors import MLScopeError

__all__ = [
    "STREAM_BLOCK",
    "STREAM_BYTES",
    "STREAM_FLUSH_NS",
    "STREAM_HELPER_MIN",
    "STREAM_HELPER_NS",
    "STREAM_HELPER_WINDOW",
    "Answered",
    "Host",
    "Stream",
    "run",
]

now = time.perf_counter_ns

STREAM_BLOCK = 64
"""Most queries of a stream post-processed in one call."""
STREAM_HELPER_NS = 1_000_000
"""A stream whose predicts take at least this long (:data:`STREAM_HELPER_MIN` of its last
:data:`STREAM_HELPER_WINDOW`) answers its blocks on a thread of its own (:class:`_Answerer`)
while the next predict runs: right after a long predict, the post-processing of one
query runs cold (efficientnet_lite0's top-5 of 1,000 scores: ~215 µs, against 34 µs in a
warm loop) and would keep the runtime waiting. A fast model keeps answering on the
predict thread through stray slow predicts (a cold start, a preemption): a second
thread that wakes for every block takes the GIL and a core from a runtime that needs
both (digits_cnn at batch 32 on 2 cores: ~10 % of its throughput)."""
STREAM_HELPER_WINDOW = 8
STREAM_HELPER_MIN = 6
STREAM_BYTES = 16 << 20
"""... and most bytes of raw outputs a stream keeps for it (a model with large outputs
answers sooner)."""
STREAM_FLUSH_NS = 5_000_000
"""A stream post-processes its answers before the oldest waiting one would be this late
(its predict's end to its answer; a predict longer than this answers each query at
once). Post-processing a block costs ~100-200 µs on top of its rows on a 2-core VM,
which a 0.2 ms batch of a small model could not afford per query."""


@dataclass(slots=True)
class Answered:
    """Queries of a stream answered together, in issue order: their times, one row per
    query; the outputs of those that succeeded, in order, in one array. Built on the
    predict thread, so it holds only what was at hand; its columns are views, taken by
    whoever reads them (a local run reads many blocks at once)."""

    times: np.ndarray
    """One row per query (ns, ``perf_counter_ns``): its index, when the predict thread
    took it, its predict's start and end."""
    outputs: np.ndarray | None
    """The post-processed outputs of the queries answered, joined on axis 0."""
    errors: dict[int, MLScopeError]
    """Position in this block -> the query's typed error."""
    post_end: int
    """When the block's post-processing ended (its answers' time)."""

    @property
    def index(self) -> np.ndarray:
        return self.times[:, 0]

    @property
    def received(self) -> np.ndarray:
        """When the predict thread took each query."""
        return self.times[:, 1]

    @property
    def predict_start(self) -> np.ndarray:
        return self.times[:, 2]

    @property
    def predict_end(self) -> np.ndarray:
        return self.times[:, 3]

    @property
    def ok(self) -> np.ndarray:
        """Whether each query was answered (else its error is in :attr:`errors`)."""
        mask = np.ones(len(self.times), bool)
        if self.errors:
            mask[list(self.errors)] = False
        return mask


class Stream(Protocol):
    """A closed loop the predict thread runs itself (``Executor.stream``)."""

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


@dataclass(frozen=True, slots=True)
class Host:
    """What a stream needs of the executor that runs it."""

    name: str
    """The model's name (its answering thread is ``post-<name>``)."""
    predict: Callable[[np.ndarray, TraceLevel], tuple[np.ndarray, int, int]]
    """A query's pre-processed first input -> the model's first output, and when its
    predict started and ended (ns); other inputs filled. Raises the query's error."""
    post: Callable[[np.ndarray], np.ndarray]
    """The model's post-processing of raw outputs (axis 0 the batch)."""
    failed: Callable[[Exception, int], MLScopeError]
    """A query's predict or post-processing failed: its typed error."""
    stopping: Callable[[], bool]
    """The executor is stopping: the stream ends at its next query."""


Block = tuple[list[int], list[np.ndarray | MLScopeError]]
"""A block waiting for its answers: four numbers per query, one query after another
(index, taken, predict start, predict end), and each query's first output or its
error."""


def run(host: Host, s: Stream) -> None:
    """``s`` to its end, on the calling (predict) thread. Between two predicts it does
    only what each query needs (its index and inputs, two clock reads, its output
    kept): Python run right after a predict runs several times slower than in a warm
    loop on a small machine, and every microsecond of it is the runtime's."""
    times: list[int] = []  # per query: index, taken, predict start, predict end
    raw: list[np.ndarray | MLScopeError] = []  # each query's first output, or error
    kept = 0
    took: deque[int] = deque(maxlen=STREAM_HELPER_WINDOW)  # the last predicts' durations
    helper: _Answerer | None = None
    predict, level, stopping, next_query = host.predict, s.level, host.stopping, s.next_query
    try:
        while not stopping() and (got := next_query()) is not None:
            i, x = got
            t_in = now()
            try:
                out, t0, t1 = predict(x, level)
                raw.append(out)
                kept += out.nbytes
            except Exception as exc:  # the query's error: the stream goes on
                t0 = t1 = now()
                raw.append(host.failed(exc, int(x.shape[0])))
            times += (i, t_in, t0, t1)
            took.append(t1 - t0)
            # Answer now if the next predict would make the oldest answer late.
            late = 2 * t1 - t0 - times[3] >= STREAM_FLUSH_NS
            if late or len(raw) >= STREAM_BLOCK or kept >= STREAM_BYTES:
                if helper is None and _slow(took):
                    helper = _Answerer(host, s)
                if helper is not None:  # from then on every block: they stay in order
                    helper.put((times, raw))
                else:
                    answer(host, s, (times, raw))
                times, raw, kept = [], [], 0
            if helper is not None and helper.error is not None:
                break
        if raw:
            if helper is not None:
                helper.put((times, raw))
            else:
                answer(host, s, (times, raw))
    finally:
        if helper is not None:
            helper.close()  # its blocks answered; its error raised


def _slow(took: deque[int]) -> bool:
    """Whether :data:`STREAM_HELPER_MIN` of the last :data:`STREAM_HELPER_WINDOW` predicts took
    :data:`STREAM_HELPER_NS` or more."""
    return (
        len(took) == STREAM_HELPER_WINDOW
        and sum(t >= STREAM_HELPER_NS for t in took) >= STREAM_HELPER_MIN
    )


def answer(host: Host, s: Stream, block: Block) -> None:
    """Post-process a block's outputs in one call (one by one when that fails, so only
    the culprit gets the error), emit their spans, hand them to the stream."""
    times, raw = block
    post = host.post
    errors = {k: r for k, r in enumerate(raw) if isinstance(r, MLScopeError)}
    good = (
        [r for r in raw if not isinstance(r, MLScopeError)]
        if errors
        else cast(list[np.ndarray], raw)
    )
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
                errors[k] = host.failed(exc, len(r))
        outputs = np.concatenate(parts) if parts else None
    done = Answered(
        times=np.array(times, dtype=np.int64).reshape(-1, 4),
        outputs=outputs,
        errors=errors,
        post_end=now(),
    )
    if s.spans is not None and s.level >= TraceLevel.MODEL:
        for k, r in enumerate(raw):
            if not isinstance(r, MLScopeError) and k not in errors:
                i, t_in, t0, t1 = times[4 * k : 4 * k + 4]
                out = Outcome(
                    t_predict=t0, t_predict_end=t1, t_post_end=done.post_end, batch=len(r)
                )
                emit_spans(s.spans, i, s.level, len(r), t_in, out, pre=(t_in, t_in))
    s.answered(done)


class _Answerer:
    """A stream's blocks answered on a thread of its own, in the order they were put
    (:data:`STREAM_HELPER_NS`); the first error of the stream's code stops it and is
    raised by :meth:`close`."""

    def __init__(self, host: Host, stream: Stream) -> None:
        self.host, self.stream = host, stream
        self.error: BaseException | None = None
        self._q: queue.SimpleQueue[Block | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"post-{host.name}", daemon=True)
        self._thread.start()

    def put(self, block: Block) -> None:
        self._q.put(block)

    def _run(self) -> None:
        while (block := self._q.get()) is not None:
            if self.error is not None:
                continue  # the stream is ending: the rest go unanswered
            try:
                answer(self.host, self.stream, block)
            except BaseException as exc:  # the stream's code: raised by close()
                self.error = exc

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()
        if self.error is not None:
            raise self.error
