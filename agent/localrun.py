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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from agent.job import Job, Model
from agent.pipeline import Executor
from agent.samplelib import MemoryBudget, preprocess_all
from agent.stream import Answered
from agent.tracer import SpanBuffer
from mlscope import samples, scenario_traits
from mlscope.catalog import Entry
from mlscope.contracts import (
    MAX_SCHEDULED_QUERIES,
    QueryReply,
    RunOp,
    ScenarioSpec,
    TraceLevel,
)
from mlscope.errors import ConfigError, EvaluationError
from mlscope.pacer import OutstandingLimit, Pacer, RealtimeThreads
from mlscope.record import ARRAYS, RunRecord
from mlscope.schedule import build_schedule

__all__ = ["LocalRun", "run_inputs"]

now = time.perf_counter_ns
log = logging.getLogger("mlscope.agent")
START_LEAD_NS = 50_000_000
"""Offset 0 is 50 ms after :meth:`LocalRun.prepare` (the run request's reply and the
start of the run's threads fit in it), so the first query is on time."""
DRAIN_TIMEOUT_S = 10.0
PREBUILD_BYTES = 64 << 20
"""An open loop's inputs are built before the clock starts when they fit in this."""
AHEAD_BYTES = 4 << 20
"""A stream gathers the inputs of the next queries at once, up to this many bytes (a
query of one sample is a view of the held samples instead)."""
AHEAD_QUERIES = 64
"""... and at most this many queries."""
FILL_BLOCKS = 256
"""A stream's answered blocks are written into the record at the latest once this many
wait (a run that nobody ships from during it keeps at most these) ..."""
FILL_BYTES = 64 << 20
"""... or once their outputs hold this many bytes (a model with large outputs)."""
REALTIME_MAX_QPS = 5_000.0
"""Above this mean rate an open loop's executor threads keep their normal priority (the
server's rule for its event-loop thread: a busy real-time thread takes a core)."""
REALTIME_MAX_BUSY = 0.5
"""Nor when the model would keep its predict thread busier than this (mean rate x a
warm predict of the run's batch): a real-time thread that computes most of the time
would starve the rest of the host."""


class LocalRun:
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
        self._answers: list[Answered] = []
        """A stream's answered blocks not yet written into the record (:meth:`_fill`)."""
        self._answer_bytes = 0
        self._views: list[np.ndarray] = []
        """A stream's next queries' inputs, gathered ahead (query ``_ahead_first`` on)."""
        self._ahead_first = 0
        self.schedule = None if self.closed else build_schedule(spec)[0]
        n = len(self.schedule) if self.schedule is not None else self._closed_room()
        if n * spec.batch_size > MAX_SCHEDULED_QUERIES:  # each sample's answer is kept
            raise ConfigError(
                f"a run of {n:,} queries of batch {spec.batch_size:,} holds "
                f"{n * spec.batch_size:,} samples' answers, over the "
                f"{MAX_SCHEDULED_QUERIES:,} one run may have",
                field="batch_size",
            )
        self.rec = RunRecord(n=n, batch_size=spec.batch_size)
        if self.schedule is not None:  # known before the run starts (a stop may come first)
            self.rec.scheduled[:] = self.schedule.offsets_ns
        self.top1 = np.full((n, spec.batch_size), -1, np.int32)
        self._lock = threading.Lock()  # record growth against snapshots
        self._stop = threading.Event()
        self._done = threading.Event()
        self._outstanding = 0
        self._pacing = not self.closed
        """An open loop's pacer may still issue: no end while it does."""
        self._issued = 0
        self._shipped = 0
        self._base = 0
        """The query whose times are the record's row 0: a closed loop that outruns its
        record forgets the rows it has shipped (:meth:`_grow`) instead of growing for
        ever (a tiny model's batched stream answers ~10^5 queries a second)."""
        self._gate: OutstandingLimit | None = None
        self._deadline = 0
        self._prebuilt: list[np.ndarray] | None = None
        self.realtime = False
        """Whether an open loop's executor threads run in SCHED_FIFO (see prepare)."""
        self._cap = spec.max_queries or 2**31
        self._cpu0 = 0.0
        self.cpu_s = 0.0

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
            per = self.inputs(0).nbytes
            if per * self.rec.n <= PREBUILD_BYTES:
                self._prebuilt = [self.inputs(i) for i in range(self.rec.n)]
            self.realtime = self._short_enough()
            log.info("local run: executor threads real-time: %s", self.realtime)
        self.rec.t0_ns = now() + START_LEAD_NS
        self._deadline = self.rec.t0_ns + int(self.spec.duration_s * 1e9)
        return self.rec.t0_ns

    def _short_enough(self) -> bool:
        """Whether the executor's threads may run real-time during this open loop: the
        pacer takes the GIL from them after each query, and one preempted by another
        process while it holds the GIL stalls the pacer (p99 issue lag 0.5-1.9 ms
        against 85-90 µs with them real-time, noop at 1,000 QPS on a loaded 2-core VM).
        Only at a mean rate and a warm predict time (two probe queries of the run's
        batch, outside the record) that keep the predict thread mostly idle."""
        sched = self.schedule
        if sched is None or not len(sched) or sched.duration_s <= 0:
            return False
        rate = len(sched) / sched.duration_s
        predict = min(self._probe() for _ in range(2))
        return rate <= REALTIME_MAX_QPS and rate * predict / 1e9 <= REALTIME_MAX_BUSY

    def _probe(self) -> float:
        """One query of the run's batch through the executor: its predict time (ns;
        infinite when it fails or is refused)."""
        done = threading.Event()
        got: list[QueryReply] = []

        def reply(r: QueryReply) -> None:
            got.append(r)
            done.set()

        job = Job(
            index=-1,
            inputs=self.inputs(0),
            received_ns=now(),
            level=TraceLevel.NONE,
            spans=None,
            reply=reply,
            preprocessed=self.preprocessed,
        )
        if not self.worker.submit(job) or not done.wait(10.0) or not got[0].ok:
            return float("inf")
        return float(got[0].t_predict_end - got[0].t_predict_start)

    def run(self) -> None:
        """The whole run, in the calling thread, after :meth:`prepare`; returns when
        every issued query is done (or :data:`DRAIN_TIMEOUT_S` after the load ended)."""
        self._cpu0 = time.process_time()
        try:
            if self.streamed:
                self._stream()
            elif self.closed:
                self._closed_loop()
            else:
                self._open_loop()
        finally:
            self.cpu_s = time.process_time() - self._cpu0

    def _job(self, i: int, x: np.ndarray, t: int) -> Job:
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

    def _submit(self, i: int, x: np.ndarray, *, inline: bool = False) -> None:
        """Hand query ``i`` (already counted as outstanding) to the executor; an
        executor at capacity refuses it as the agent's edge would ("overloaded"), and
        the run goes on. ``inline`` (an open loop's pacer): an idle executor whose
        queries are fast answers it on this thread (:meth:`Executor.try_inline`, as the
        agent's edge does for a query off the bus), with no hand-off to the predict
        thread and back: each a thread wake-up, which on a busy host now and then takes
        milliseconds."""
        rec = self.rec
        t = now()
        rec.issued[i - self._base] = max(t - rec.t0_ns, 1)
        job = self._job(i, x, t)
        if inline and self.worker.try_inline(job):
            return
        if not self.worker.submit(job):
            rec.refused[i - self._base] = 1
            rec.errors[i] = self._overloaded(i)
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
            if self._stop.is_set() or i >= self._cap or t >= self._deadline - rec.t0_ns:
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
        if self._stop.is_set() or i >= self._cap or now() >= self._deadline:
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

    def answered(self, block: Answered) -> None:
        """A stream's answered queries (on the predict thread, or the thread answering
        for it while it predicts): kept as they are. They are written into the record
        many blocks at once (:meth:`_fill`) when rows are shipped, when the stream ends,
        and at the latest every :data:`FILL_BLOCKS` blocks or :data:`FILL_BYTES` of
        outputs: off the predict thread, whose every
        microsecond between two predicts is the runtime's."""
        with self._lock:
            self._answers.append(block)
            if block.outputs is not None:
                self._answer_bytes += block.outputs.nbytes
            if len(self._answers) >= FILL_BLOCKS or self._answer_bytes >= FILL_BYTES:
                self._fill()

    def _fill(self) -> None:
        """The stream's kept blocks into the record, in one pass (under the lock): their
        times and top-1; each query completed when its block's post-processing ended.
        ``completed`` is written last (a row ships once it is set)."""
        blocks, self._answers, self._answer_bytes = self._answers, [], 0
        if not blocks:
            return
        rec, t0 = self.rec, self.rec.t0_ns
        times = np.concatenate([b.times for b in blocks]) if len(blocks) > 1 else blocks[0].times
        sizes = [len(b.times) for b in blocks]
        idx = times[:, 0] - self._base
        taken = np.maximum(times[:, 1] - t0, 1)
        rec.scheduled[idx] = rec.paced[idx] = rec.issued[idx] = taken
        rec.agent_received[idx] = taken
        ok = np.ones(len(idx), bool)
        first = 0
        for b, size in zip(blocks, sizes, strict=True):
            for k, err in b.errors.items():
                ok[first + k] = False
                rec.errors[int(b.times[k, 0])] = err.message
            first += size
        good = idx[ok]
        rec.predict_start[good] = times[ok, 2] - t0
        rec.predict_end[good] = times[ok, 3] - t0
        rec.ok[good] = 1
        self._top1(blocks, good)
        ends = np.repeat(np.array([b.post_end for b in blocks], np.int64) - t0, sizes)
        rec.agent_replied[idx] = ends
        rec.completed[idx] = np.maximum(ends, 1)
        rec.done += len(idx)

    def _top1(self, blocks: list[Answered], good: np.ndarray) -> None:
        """Each answered sample's top-1 (the first value of its output), the blocks' rows
        ``good`` of the record in order: in one step when every block's outputs have the
        same shape past axis 0 and as many rows per query, else block by block; a block
        whose outputs have no value per query leaves its rows unscored."""
        outs = [(b.outputs, len(b.times) - len(b.errors)) for b in blocks if b.outputs is not None]
        if not outs:
            return
        shapes = {(o.shape[1:], o.shape[0] / n if n else -1.0) for o, n in outs}
        if len(shapes) == 1:
            joined = outs[0][0] if len(outs) == 1 else np.concatenate([o for o, _ in outs])
            top = samples.top1(joined)
            if top is not None and len(good) and top.size % len(good) == 0:
                self._write_top1(good, top)
                return
        first = 0
        for b in blocks:
            n = len(b.times) - len(b.errors)
            top = samples.top1(b.outputs)
            if top is not None and n and top.size % n == 0:
                self._write_top1(good[first : first + n], top)
            first += n

    def _write_top1(self, rows: np.ndarray, top: np.ndarray) -> None:
        per = top.reshape(len(rows), -1)
        w = min(per.shape[1], self.top1.shape[1])
        self.top1[rows, :w] = per[:, :w]

    def _grow(self) -> None:
        """The run outlasts the record's room (under the lock, on the thread that writes
        the record): when at least half of it is shipped, forget those rows; else double
        it. Never stop early."""
        rec, shipped = self.rec, self._shipped - self._base
        if shipped >= rec.n // 2 > 0:
            rec.drop(shipped)
            kept = np.full_like(self.top1, -1)
            kept[: rec.n - shipped] = self.top1[shipped:]
            self.top1 = kept
            self._base += shipped
            rec.errors = {i: e for i, e in rec.errors.items() if i >= self._base}
            return
        rec.grow()
        grown = np.full((rec.n, self.spec.batch_size), -1, np.int32)
        grown[: len(self.top1)] = self.top1
        self.top1 = grown

    def _trim(self) -> None:
        """The run ended: the record holds exactly the queries issued (under the lock)."""
        self._fill()
        self.rec.trim(self._issued - self._base)
        self.top1 = self.top1[: self._issued - self._base]

    @property
    def queries(self) -> int:
        """Queries the record has held, shipped ones included (after the run: issued)."""
        return self._base + self.rec.n

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
            self._submit(i, prebuilt[i] if prebuilt is not None else self.inputs(i), inline=True)

        helpers = RealtimeThreads(self.worker.thread_ids(), enable=self.realtime)
        try:
            pacer = Pacer(
                sched, issue=issue, gate=gate, start_ns=rec.t0_ns, stop=self._stop, realtime=True
            )
            pacer.start()  # its own thread: the real-time priority ends with it
            result = pacer.join()
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
        i = q - self._base
        t0 = rec.t0_ns
        rec.agent_received[i] = reply.t_received - t0
        if reply.ok:
            rec.predict_start[i] = reply.t_predict_start - t0
            rec.predict_end[i] = reply.t_predict_end - t0
            rec.ok[i] = 1
            top = samples.top1(reply.outputs)
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
        rec.completed[i - self._base] = max(now() - rec.t0_ns, 1)
        rec.done += 1
        if self._gate is not None:
            self._gate.release()
        more = self.closed and chain and self._next_closed()
        with self._lock:
            self._outstanding -= 1
            if self._outstanding == 0 and not more and not self._pacing:
                self._done.set()

    # ------------------------------------------------------------------ shipping

    def take(self, *, final: bool = False) -> tuple[int, dict[str, np.ndarray], dict[int, str]]:
        """Rows not shipped yet, as copied columns: every row up to the first one still
        in flight; ``final``: every row of the run, in flight ones included (a run
        stopped early, as when its job is cancelled, reports every query it issued:
        a query in flight ships without its completion, and those never due are not
        rows of the run)."""
        with self._lock:
            self._fill()
            rec, a, base = self.rec, self._shipped, self._base
            hi = base + (self._final_rows() if final else min(self._issued - base, rec.n))
            pending = np.flatnonzero(rec.completed[a - base : hi - base] == 0)
            b = hi if final or not pending.size else a + int(pending[0])
            cols = {name: getattr(rec, name)[a - base : b - base].copy() for name in ARRAYS}
            cols["top1"] = self.top1[a - base : b - base].copy()
            errors = {i: e for i, e in list(rec.errors.items()) if a <= i < b}
            self._shipped = b
        return a, cols, errors

    def _final_rows(self) -> int:
        """How many of the record's rows the run has (under the lock): those issued or
        answered (a closed loop's record may have room past them) and, of an open
        loop, those due, every one once the schedule is over (one due and not issued:
        refused by the outstanding bound, or the run stopped before it)."""
        rec = self.rec
        answered = np.flatnonzero(rec.completed)
        rows = max(self._issued - self._base, int(answered[-1]) + 1 if answered.size else 0)
        if not self.closed:
            rows = max(rows, int(np.searchsorted(rec.scheduled, now() - rec.t0_ns, "right")))
        return min(rows, rec.n)

    @property
    def issued(self) -> int:
        return self._issued


def run_inputs(
    entry: Entry, model: Model, req: RunOp, *, zoo_dir: Path, budget: MemoryBudget
) -> tuple[samples.QueryRows, int | None]:
    """A local run's query inputs (the server's sample order) and, when its samples are
    held pre-processed, the bytes they took of ``budget`` (else None; the caller gives
    them back when the run's rows are shipped).

    ``preprocess`` None holds them where the pipeline pre-processes sample by sample and
    they fit; ``ahead`` insists (a typed error otherwise); ``timed`` never does."""
    spec = req.scenario
    data = samples.dataset(entry, zoo_dir)
    x, _ = samples.table(data, entry.manifest.inputs[0].shape, spec.seed)
    pre: np.ndarray | None = None
    if spec.preprocess != "timed":
        try:
            pre = preprocess_all(req.evaluation_id, x, model, budget)
        except ConfigError:
            if spec.preprocess == "ahead":
                raise
            log.info("local run %s: samples over the sample memory: timed", req.evaluation_id)
        if pre is None and spec.preprocess == "ahead":
            raise ConfigError(
                f"{entry.manifest.name}: its pre-processing does not run sample by sample, "
                "so its samples cannot be held pre-processed; use preprocess timed",
                field="preprocess",
            )
    inputs, _ = samples.feed(pre if pre is not None else x, None, spec.batch_size, spec.seed)
    return inputs, (None if pre is None else pre.nbytes)
