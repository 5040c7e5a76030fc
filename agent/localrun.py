"""The agent's local load generator (``placement: agent``): a scenario run here.

::

    RunOp ──► LocalRun (thread) ── open loop: mlscope.pacer.Pacer ── submit ──► Executor
                 │                  closed loop: the k-th reply submits the next  │
                 │                  a stream: the predict thread takes each next  │
                 │                                                               ▼
                 └── RunRecord (agent clock, ns from t0) ◄── reply callback (predict thread)
                        │
    shipper (event loop) ── RunRows (columns, under the max payload) ──► the server's inbox

The schedule, the pacer and the sample order are the server's own code
(:mod:`mlscope.schedule`, :mod:`mlscope.pacer`, :mod:`mlscope.samples`); the verdict is
computed by the server from the rows, with the same code as for a server-placed run.
What differs is only where queries come from: no query crosses the bus, so a run
measures the model, not the model served over the bus. A throughput scenario on samples
held pre-processed (``ScenarioTraits.local_stream``: ``batched``) is one stream on the
predict thread (:meth:`agent.pipeline.Executor.stream`): batches back to back, answers
post-processed in blocks, nothing per query between two predicts but its rows and times.

Times: ``scheduled`` (when the query was due; a closed loop's is its issue time),
``paced`` (released by the pacer), ``issued`` (handed to the executor), ``completed``
(its reply callback ran), the executor's received / predict start / predict end /
replied. All are ns from ``t0`` on this agent's ``perf_counter_ns``; the server maps
``t0`` onto its clock with the clock offset it measured (ping), so stored rows and
spans share one timeline as in a server-placed run.

This module issues a run's queries and takes their replies. The record they are
written into, a stream's answered blocks and the rows the shipper takes are
:mod:`agent.localrecord`'s; the run's inputs are :mod:`agent.localinputs`'s; whether an
open loop's executor threads run real-time is :mod:`agent.localprobe`'s; the run's CPU
time (the agent process's, and its load generator's own) is :mod:`agent.localcpu`'s.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from agent.job import Deferred, Job
from agent.localcpu import RunCpu
from agent.localprobe import short_enough
from agent.localrecord import LocalRecord, now
from agent.pipeline import Executor
from agent.tracer import SpanBuffer
from mlscope import samples, scenario_traits
from mlscope.contracts import QueryReply, ScenarioSpec, TraceLevel
from mlscope.errors import ConfigError, EvaluationError
from mlscope.pacer import OutstandingLimit, Pacer, RealtimeThreads
from mlscope.schedule import build_schedule

__all__ = ["LocalRun"]

log = logging.getLogger("mlscope.agent")
START_LEAD_NS = 50_000_000
"""Offset 0 is 50 ms after :meth:`LocalRun.prepare` (the run request's reply and the
start of the run's threads fit in it), so the first query is on time."""
DRAIN_TIMEOUT_S = 10.0
PREBUILD_BYTES = 64 << 20
"""An open loop's inputs are built before the clock starts when they fit in this;
else each query's are gathered by the executor (:class:`agent.job.Deferred`)."""
AHEAD_BYTES = 4 << 20
"""A stream gathers the inputs of the next queries at once, up to this many bytes (a
query of one sample is a view of the held samples instead)."""
AHEAD_QUERIES = 64
"""... and at most this many queries."""


class LocalRun(LocalRecord):
    """One scenario on one executor; :meth:`run` in a thread, :meth:`take` from another.

    ``inputs(i)`` comes from :func:`mlscope.samples.feed` with the run's seed and batch
    size: the server's sample order, over the raw rows or (``preprocessed``) the rows
    the agent pre-processed before the run.
    """

    def __init__(
        self,
        worker: Executor,
        spec: ScenarioSpec,
        *,
        inputs: samples.QueryRows,
        level: TraceLevel,
        spans: SpanBuffer | None,
        overloaded: Callable[[int], str],
        preprocessed: bool = False,
        released: threading.Event | None = None,
    ) -> None:
        self.traits = scenario_traits.get(spec.name)
        if not self.traits.local or spec.loadgens > 1 or spec.loadgen_hosts:
            many = spec.loadgens > 1 or bool(spec.loadgen_hosts)
            raise ConfigError(
                f"scenario {spec.name!r}"
                + (" with several load generators" if many else "")
                + " cannot run in the agent (placement agent); use placement server",
                field="placement",
                scenario=spec.name,
            )
        self.worker, self.spec, self.inputs = worker, spec, inputs
        self.preprocessed = preprocessed
        """``inputs`` gives pre-processed samples (held by the agent): queries skip that step."""
        self.level, self.spans, self._overloaded = level, spans, overloaded
        self.released = released
        """Set when the evaluation is released: its queries still queued are not run."""
        self.closed = self.traits.closed_loop
        """A closed loop: the scenario has no arrivals."""
        self.streamed = (
            self.closed
            and self.traits.local_stream
            and preprocessed
            and level < TraceLevel.FRAMEWORK
        )
        """Run as one stream on the predict thread (:meth:`Executor.stream`): a
        throughput scenario on samples held pre-processed, traced at most per query."""
        self._views: list[np.ndarray] = []
        """A stream's next queries' inputs, gathered ahead (query ``_ahead_first`` on)."""
        self._ahead_first = 0
        self.schedule = None if self.closed else build_schedule(spec)[0]
        n = len(self.schedule) if self.schedule is not None else self._closed_room()
        super().__init__(n)
        self._writing: contextlib.AbstractContextManager[Any] = (
            self._lock if self.closed else contextlib.nullcontext()
        )
        """Held to write a query's issue, refusal or answer into the record: a closed
        loop's record grows (and drops shipped rows) on another thread under the lock;
        an open loop's never does, so its per-query path takes no lock for it."""
        self._stop = threading.Event()
        self._done = threading.Event()
        self._outstanding = 0
        self._pacing = not self.closed
        """An open loop's pacer may still issue: no end while it does."""
        self._gate: OutstandingLimit | None = None
        self._deadline = 0
        self._prebuilt: list[np.ndarray] | None = None
        self._query_bytes = 0
        """Bytes of one query's inputs (an open loop's, set by :meth:`prepare`)."""
        self._query_shape: tuple[int, ...] = ()
        self._query_dtype: np.dtype[Any] = np.dtype(np.float32)
        self.realtime = False
        """Whether an open loop's executor threads run in SCHED_FIFO (see prepare)."""
        self._cap = spec.max_queries or 2**31
        self.cpu = RunCpu(separable=not self.closed)
        """The run's CPU time: the agent process's, and its load generator's own."""

    def _closed_room(self) -> int:
        s = self.spec
        return min(s.max_queries or 2**31, max(self.depth, 1024))

    @property
    def depth(self) -> int:
        """Queries a closed loop keeps in flight."""
        return self.traits.depth(self.spec.concurrency, local=True)

    # ------------------------------------------------------------------ running

    def stop(self) -> None:
        """End the run early (the agent shuts down): stop issuing, keep what was done."""
        self._stop.set()

    def prepare(self) -> int:
        """Everything that takes time before the clock starts (an open loop's inputs,
        the probe of its predict time), then offset 0: returns ``t0`` (agent clock).

        The process-wide tuning of an open loop (switch interval, no GC) is held by
        the caller around the whole run (``mlscope.tuning.ProcessTuning``)."""
        if not self.closed:
            first = self.inputs(0)
            self._query_shape, self._query_dtype = first.shape, first.dtype
            self._query_bytes = per = first.nbytes
            if per * self.rec.n <= PREBUILD_BYTES:
                self._prebuilt = [self.inputs(i) for i in range(self.rec.n)]
            self.realtime = short_enough(
                self.schedule, self.worker, self.inputs, preprocessed=self.preprocessed
            )
            log.info("local run: executor threads real-time: %s", self.realtime)
        self.rec.t0_ns = now() + START_LEAD_NS
        self._deadline = self.rec.t0_ns + int(self.spec.duration_s * 1e9)
        return self.rec.t0_ns

    def run(self) -> None:
        """The whole run, in the calling thread, after :meth:`prepare`; returns when
        every issued query is done (or :data:`DRAIN_TIMEOUT_S` after the load ended)."""
        self.cpu.start()
        try:
            if self.streamed:
                self._stream()
            elif self.closed:
                self._closed_loop()
            else:
                self._open_loop()
        finally:
            self.cpu.end()

    def _job(self, i: int, x: np.ndarray | Deferred, t: int) -> Job:
        return Job(
            index=i,
            inputs=x,
            received_ns=t,
            level=self.level,
            spans=self.spans,
            reply=self._on_reply,
            preprocessed=self.preprocessed,
            released=self.released,
        )

    def _deferred(self, i: int) -> Deferred:
        """Query ``i``'s inputs, to be gathered by the executor."""
        return Deferred(
            functools.partial(self.inputs, i),
            shape=self._query_shape,
            dtype=self._query_dtype,
            nbytes=self._query_bytes,
        )

    def _submit(self, i: int, x: np.ndarray | Deferred, *, inline: bool = False) -> None:
        """Hand query ``i`` (already counted as outstanding) to the executor; an
        executor at capacity refuses it as the agent's edge would ("overloaded"), and
        the run goes on. ``inline`` (an open loop's pacer): an idle executor whose
        queries are fast answers it on this thread (:meth:`Executor.try_inline`, as the
        agent's edge does for a query off the bus), with no hand-off to the predict
        thread and back: each a thread wake-up, which on a busy host now and then takes
        milliseconds."""
        t = now()
        with self._writing:
            self.rec.issued[i - self._base] = max(t - self.rec.t0_ns, 1)
        job = self._job(i, x, t)
        if inline and self.worker.try_inline(job):
            return
        if not self.worker.submit(job):
            self._refused(i)

    def _refused(self, i: int) -> None:
        """Query ``i`` (issued) was refused as overloaded: recorded, the run goes on."""
        with self._writing:
            self.rec.refused[i - self._base] = 1
            self.rec.errors[i] = self._overloaded(i)
        self._complete(i, chain=False)  # a refused closed-loop stream ends here

    def _closed_loop(self) -> None:
        for _ in range(self.depth):
            if not self._next_closed():
                break
        with self._lock:
            if self._outstanding == 0:
                self._done.set()
        self._done.wait(self.spec.duration_s + DRAIN_TIMEOUT_S + START_LEAD_NS / 1e9)
        with self._lock:
            self._trim()

    def _next_closed(self) -> bool:
        """Issue the next closed-loop query; False once time or the count is up.

        Its index is taken and counted as outstanding in one step: streams run on
        several threads, and a query whose index was taken but not yet submitted must
        keep the run from ending (else it is issued after the end, and lost)."""
        rec = self.rec
        while now() < rec.t0_ns:  # the first queries wait for offset 0
            time.sleep(0.001)
        with self._lock:  # index and scheduled time together: both in issue order
            i = self._issued
            t = now() - rec.t0_ns
            if self._stop.is_set() or i >= self._cap:
                return False
            if t >= self._deadline - rec.t0_ns:
                rec.time_up_ns = rec.time_up_ns or t
                return False
            if i - self._base >= rec.n:
                self._grow()
            self._issued = i + 1
            self._outstanding += 1
            rec.scheduled[i - self._base] = rec.paced[i - self._base] = max(t, 1)
        self._submit(i, self.inputs(i))
        return True

    def _stream(self) -> None:
        while now() < self.rec.t0_ns:  # the first query waits for offset 0
            time.sleep(0.001)
        try:
            self.worker.stream(self, timeout=self.spec.duration_s + DRAIN_TIMEOUT_S)
        finally:
            self._stop.set()  # a stream that outlived its time ends at its next query
            with self._lock:
                self._trim()

    def next_query(self) -> tuple[int, np.ndarray] | None:
        """A stream's next query (on the predict thread), its inputs a view of those
        gathered ahead; None once time or the count is up. Its times are written when
        it is answered (:meth:`answered`): in a stream a query is issued when the
        predict thread takes it. Between two predicts this is all the run's own work
        for a query (one index, one clock read), so it stays short."""
        i = self._issued
        k = i - self._ahead_first
        if k < len(self._views) and now() < self._deadline and not self._stop.is_set():
            self._issued = i + 1
            return i, self._views[k]
        return self._next_ahead(i)

    def _next_ahead(self, i: int) -> tuple[int, np.ndarray] | None:
        """Query ``i``, the first of the next queries gathered at once (their room in
        the record made now); None once time, the count or a stop ends the stream."""
        if self._stop.is_set() or i >= self._cap:
            return None
        t = now()
        if t >= self._deadline:
            self.rec.time_up_ns = self.rec.time_up_ns or t - self.rec.t0_ns
            return None
        b, held = self.spec.batch_size, self.inputs.a
        if b == 1:  # one row a query: views of the held samples, nothing copied
            n = AHEAD_QUERIES
        else:
            n = max(1, min(AHEAD_QUERIES, AHEAD_BYTES // max(int(held[:1].nbytes) * b, 1)))
        n = min(n, self._cap - i)
        with self._lock:
            while i + n - self._base > self.rec.n:
                self._grow()
        if b == 1:
            self._views = [held[r : r + 1] for r in self.inputs.indices(i, i + n).tolist()]
        else:
            block = self.inputs.block(i, i + n)
            self._views = [block[k * b : (k + 1) * b] for k in range(n)]
        self._ahead_first = i
        self._issued = i + 1
        return i, self._views[0]

    def _open_loop(self) -> None:
        rec, sched, s = self.rec, self.schedule, self.spec
        if sched is None:
            raise EvaluationError(f"scenario {s.name!r} is closed-loop: it has no schedule")
        prebuilt = self._prebuilt
        self._gate = gate = OutstandingLimit(s.max_outstanding)

        def issue(i: int, _scheduled: int, paced: int) -> None:  # on the pacer thread
            rec.paced[i - self._base] = paced
            with self._lock:
                self._outstanding += 1
                self._issued = max(self._issued, i + 1)
            # Not built ahead: the executor gathers the query's inputs, so the copy is
            # the query's time, not the next queries' issue lag; and it gathers nothing
            # for a query it refuses (an overloaded run of large queries)
            x = prebuilt[i] if prebuilt is not None else self._deferred(i)
            self._submit(i, x, inline=True)

        helpers = RealtimeThreads(self.worker.thread_ids(), enable=self.realtime)
        try:
            pacer = Pacer(
                sched, issue=issue, gate=gate, start_ns=rec.t0_ns, stop=self._stop, realtime=True
            )
            result = self.cpu.paced(pacer)  # its own thread: the real-time priority ends with it
            rec.not_issued = len(result.not_issued)
            with self._lock:
                self._pacing = False
                if self._outstanding == 0:
                    self._done.set()
            self._done.wait(DRAIN_TIMEOUT_S)
        finally:
            helpers.restore()

    # ------------------------------------------------------------------ replies

    def _on_reply(self, reply: QueryReply) -> None:
        """A query's answer (on the predict thread): its times and top-1, then the next
        closed-loop query."""
        rec, q = self.rec, reply.index
        top = samples.top1(reply.outputs) if reply.ok else None
        with self._writing:
            i = q - self._base
            t0 = rec.t0_ns
            rec.agent_received[i] = reply.t_received - t0
            if reply.ok:
                rec.predict_start[i] = reply.t_predict_start - t0
                rec.predict_end[i] = reply.t_predict_end - t0
                rec.ok[i] = 1
                if top is not None:
                    k = min(len(top), self.top1.shape[1])
                    self.top1[i, :k] = top[:k]
            else:
                rec.errors[q] = str((reply.error or {}).get("message", "error"))
            rec.agent_replied[i] = reply.t_replied - t0
        self._complete(q)

    def _complete(self, i: int, *, chain: bool = True) -> None:
        """Query ``i`` is done; a closed loop's stream then issues its next query
        (``chain``: not after a refusal, which would recurse as fast as it is refused)."""
        rec = self.rec
        with self._writing:
            rec.completed[i - self._base] = max(now() - rec.t0_ns, 1)
            rec.done += 1
        if self._gate is not None:
            self._gate.release()
        more = self.closed and chain and self._next_closed()
        with self._lock:
            self._outstanding -= 1
            if self._outstanding == 0 and not more and not self._pacing:
                self._done.set()
