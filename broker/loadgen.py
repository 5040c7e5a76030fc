"""The load generator: drives one agent with a scenario and keeps every timestamp.

Open loop (``online``): a seeded Poisson schedule is released by a pacer thread, so
the event loop's millisecond timer rounding never reaches the schedule. The pacer's
thread writes each query to a socket of the run's own (:class:`QueryLink`) the moment
it is due, and the link's reader thread stamps each reply as it arrives: no query or
reply waits for the event loop, which only reports progress. Latency counts from
each query's *scheduled* time: a late issue counts against the system under test (no
coordinated omission).

Closed loop (``single-stream``, ``concurrency``, each point of ``batched``): a fixed
number of queries in flight (``spec.concurrency``), each sent the moment a previous one
completes, from the link's reader thread that stamped that answer; its scheduled time
is its issue time (the streams in flight: :mod:`broker.closedloop`).

Open loops take any :class:`mlscope.schedule.Schedule` (Poisson, constant, multi-stream,
replay, piecewise, or one slice of a dealt global schedule): query ``i`` of the slice
is sent with its *global* index ``schedule.index[i]``, so several drivers in several
processes can share one global schedule and one start time (``start_ns``).

Every query keeps scheduled, issued and completed times (load-generator clock) and
the agent's received / predict-start / predict-end / replied times, converted to
the load-generator clock with the offset estimated over request/reply
(:mod:`broker.lgclock`). Issue times are written into the record as each query is
sent, so a run cancelled part-way (its job cancelled: :mod:`broker.cancel`) leaves a
record that holds every query it issued.
A schedule of no query (a duration shorter than its first arrival) is a run that
issued nothing, judged INVALID as such, as a closed loop's or an agent's would be.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec

import anyio
import numpy as np

from broker.closedloop import Streams
from broker.lgclock import now
from mlscope import samples, wire
from mlscope.bus import Bus
from mlscope.contracts import ScenarioSpec, TraceLevel
from mlscope.errors import BusError, EvaluationError
from mlscope.pacer import OutstandingLimit, Pacer
from mlscope.querylink import QueryLink
from mlscope.record import RunRecord
from mlscope.schedule import Schedule
from mlscope.stats import percentile
from mlscope.tuning import ProcessTuning

__all__ = [
    "Driver",
    "best_effort",
    "encode_query",
    "running_p50_ms",
]

DRAIN_TIMEOUT_S = 10.0
PACER_STOP_S = 2.0
"""How long a stopped pacer's thread is awaited (it ends within its current batch)."""
LAST_PROGRESS_S = 2.0
"""How long a cancelled run's last progress report may take."""
START_LEAD_NS = 20_000_000  # start 20 ms out, so the first query is on time
LINK_SPIN_S = 60e-6
LINK_BUSY_S = 60e-6
"""The pacer sleeps until LINK_SPIN_S before each query is due and spins the rest,
holding the GIL: a sleep ends ~25-100 µs late, a spin is exact. At 1,000 QPS that is
~60 µs of CPU per query (docs/BENCHMARKS.md, "Server placement: the query link")."""
FRAMES_PER_BLOCK = 16_384
"""Queries encoded per worker-thread call before a run's clock starts (~0.2 s of work)."""
log = logging.getLogger("mlscope.loadgen")
P = ParamSpec("P")


def encode_query(
    evaluation_id: str, index: int, inputs: np.ndarray, trace_level: TraceLevel
) -> bytes:
    """The wire bytes of one query (built without validation: the load generator is
    the trusted side; the agent checks what it receives)."""
    return wire.encode_query(evaluation_id, index, inputs, int(trace_level))


class Driver:
    """Runs one scenario against one agent subject and fills a :class:`RunRecord`.

    ``schedule``: the open-loop arrivals (None for a closed loop). ``start_ns``: the
    ``perf_counter_ns`` of offset 0, shared by cooperating drivers (default: 20 ms
    from when the run starts). ``inputs(g)`` / ``labels(g)`` take the global index.
    """

    def __init__(
        self,
        bus: Bus,
        *,
        evaluation_id: str,
        subject: str,
        spec: ScenarioSpec,
        inputs: Callable[[int], np.ndarray],
        labels: Callable[[int], np.ndarray] | None,
        trace_level: TraceLevel,
        offset_ns: int = 0,
        on_progress: Callable[[RunRecord, float], Any] | None = None,
        schedule: Schedule | None = None,
        start_ns: int | None = None,
        payloads: list[bytes] | None = None,
        tuning: ProcessTuning,
    ) -> None:
        self.bus, self.evaluation_id, self.subject, self.spec = bus, evaluation_id, subject, spec
        self.inputs, self.labels, self.trace_level = inputs, labels, trace_level
        self.offset_ns = offset_ns
        self.on_progress = (
            best_effort(on_progress, f"evaluation {evaluation_id}") if on_progress else None
        )
        self.schedule, self.start_ns, self.payloads = schedule, start_ns, payloads
        self.tuning = tuning
        self.inbox = bus.nc.new_inbox()  # under this connection's role's inbox prefix
        self._answered: Callable[[], None] | None = None  # a closed loop's next send
        self._writing: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        """Held while a reply is written into the record: a closed loop's lock, under
        which its record also grows (from whichever thread sends past its room, the
        event loop's first sends among them), so no answer is written into arrays
        that are being replaced."""
        self._first_global = 0
        self._stride = 1
        self.record: RunRecord | None = None
        self._gate: OutstandingLimit | None = None
        self._idle = threading.Event()  # set when the gate's last outstanding query ends
        self._threads_cpu_s = 0.0
        """CPU time of the run's own threads that have ended (the pacer's, the query
        link's reader's) and of a closed loop's first sends: the load generator's cost,
        not its process's, which may be a server's with an embedded database and other
        runs."""

    # ------------------------------------------------------------------ replies

    def payload(self, g: int) -> bytes:
        """The encoded query with global index ``g``."""
        return encode_query(self.evaluation_id, g, self.inputs(g), self.trace_level)

    def _local(self, g: int) -> int:
        """Position in this driver's record of global index ``g`` (-1 if not ours)."""
        i, rem = divmod(g - self._first_global, self._stride)
        rec = self.record
        if rem or rec is None or not 0 <= i < rec.n:
            return -1
        return i

    def _on_reply(self, payload: bytes, t: int) -> None:
        """One reply that arrived at ``t`` (on the query link's reader thread)."""
        rec = self.record
        if rec is None:  # a reply after the run's record was let go: nothing to fill
            return
        reply = wire.read_reply(payload)
        with self._writing:
            i = self._local(reply.index)
            if i < 0 or rec.completed[i] != 0:
                return  # not ours or a duplicate
            self._write(rec, i, reply.within(t - rec.t0_ns - int(rec.issued[i])))
            rec.completed[i] = t - rec.t0_ns
            rec.done += 1
        self._complete()

    def _write(self, rec: RunRecord, i: int, reply: wire.ReplyView) -> None:
        """Query ``i``'s answer (or its failure) into the record."""
        if not reply.ok:
            rec.errors[i] = reply.error
            rec.refused[i] = reply.refused
            return
        off = self.offset_ns + rec.t0_ns
        received, start, end, replied = reply.agent_ns
        rec.agent_received[i] = received - off
        rec.predict_start[i] = start - off
        rec.predict_end[i] = end - off
        rec.agent_replied[i] = replied - off
        rec.ok[i] = 1
        top1 = samples.top1(reply.outputs)
        if top1 is not None:
            rec.prediction[i] = top1[0]
            if self.labels is not None:
                rec.correct[i] = int(np.count_nonzero(top1 == self.labels(reply.index)))

    def _complete(self) -> None:
        """A query is answered: its room in the gate, or a closed loop's next send."""
        gate = self._gate
        if gate is not None:
            gate.release()
            if gate.outstanding == 0:
                self._idle.set()
        if self._answered is not None:
            self._answered()

    # ------------------------------------------------------------------ scenarios

    async def run(self) -> RunRecord:
        """The run, its record filled. Cancelled (a cancelled job), the record it
        leaves holds every query issued so far and the CPU time used up to the stop,
        reported to ``on_progress`` once more before the cancellation goes on (what a
        cancelled job stores)."""
        try:
            with self.tuning.load():
                rec = await self._run()
        except anyio.get_cancelled_exc_class():
            if self.record is not None:  # its threads have ended (up to the stop)
                self.record.cpu_s = self._threads_cpu_s
            await self._last_progress()
            raise
        # The load's own cost: its threads', from the clock's start (an open loop's
        # queries are all encoded before it) to the last reply.
        rec.cpu_s = self._threads_cpu_s
        self._let_go()
        return rec

    def _let_go(self) -> None:
        """Hold nothing of the finished run: its record is the caller's. The cancelled
        progress task's traceback keeps this driver in a reference cycle until a full
        GC (which a measurement turns off), and a record of millions of queries is
        hundreds of MB; a reply still arriving finds no record and is dropped."""
        self.record = None
        self._gate = None
        self._answered = None
        self._writing = contextlib.nullcontext()

    async def _run(self) -> RunRecord:
        """The scenario's loop beside the progress reporter; a failure of either is
        raised as itself, not as the task group's ExceptionGroup."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._progress)
                if self.schedule is not None:
                    rec = await self._open_loop(self.schedule)
                else:  # the scenario decided (broker.scenario.Scenario.closed_loop)
                    rec = await self._closed_loop()
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            exc = _sole(group)
            raise exc from exc.__cause__  # as it was raised (its own cause kept)
        return rec

    async def _last_progress(self) -> None:
        """Report the record as it is now (shielded: the run is being cancelled)."""
        if self.record is not None:
            with anyio.CancelScope(shield=True), anyio.move_on_after(LAST_PROGRESS_S):
                await self._report(self.record)

    async def _progress(self) -> None:
        while True:
            await anyio.sleep(0.5)
            if self.record is not None:
                await self._report(self.record)

    async def _report(self, rec: RunRecord) -> None:
        if self.on_progress is not None:
            await self.on_progress(rec, (now() - rec.t0_ns) / 1e9 if rec.t0_ns else 0.0)

    def _index(self, sched: Schedule) -> None:
        """Remember how global indices map to positions (a dealt slice is strided)."""
        idx = sched.index
        steps = np.diff(idx)
        if steps.size and (steps[0] < 1 or not (steps == steps[0]).all()):
            raise EvaluationError("a schedule slice needs evenly spaced global indices")
        self._first_global = int(idx[0]) if idx.size else 0
        self._stride = int(steps[0]) if steps.size else 1

    async def _open_loop(self, sched: Schedule) -> RunRecord:
        s = self.spec
        offsets = sched.offsets_ns
        rec = self.record = RunRecord(n=len(offsets), batch_size=s.batch_size)
        if rec.n == 0:  # judged as any run that issued nothing: INVALID, with why
            return rec
        self._index(sched)
        link = await anyio.to_thread.run_sync(self._open_link)
        failed: BaseException | None = None
        try:
            link.start(self._on_reply, on_end=self._idle.set)  # answers the server's pings
            frames = await self._frames(link, sched)
            if len(frames) != rec.n:
                raise EvaluationError(f"{len(frames)} payloads for {rec.n} queries")
            await self._pace(rec, offsets, link, frames)
        except EvaluationError as exc:  # raised below, after the link's own error if any
            failed = exc
        finally:
            link.close()
            self._threads_cpu_s += link.reader_cpu_s
        link.report()
        if link.error is not None:
            raise BusError(f"the bus refused the run's queries: {link.error}") from failed
        if failed is not None:
            raise failed
        return rec

    async def _frames(self, link: QueryLink, sched: Schedule) -> list[bytes]:
        """Every query's bytes, built before the clock starts: on worker threads, a
        block at a time, so the event loop goes on (a job's lease, pings, a cancel)
        while millions of queries are encoded, and a cancel ends it between blocks."""
        subject, payloads = self.subject, self.payloads
        glob = sched.index.tolist() if payloads is None else []
        n = len(glob) if payloads is None else len(payloads)
        frames: list[bytes] = []

        def block(a: int, b: int) -> list[bytes]:
            if payloads is not None:
                return [link.frame(subject, p) for p in payloads[a:b]]
            return [link.frame(subject, self.payload(g)) for g in glob[a:b]]

        for a in range(0, n, FRAMES_PER_BLOCK):
            frames += await anyio.to_thread.run_sync(block, a, min(a + FRAMES_PER_BLOCK, n))
        return frames

    def _open_link(self) -> QueryLink:
        """The run's own connection for its queries (opened in a worker thread)."""
        return QueryLink.open(
            self.bus.server_url(),
            self.bus.options,
            inbox=self.inbox,
            name=f"mlscope loadgen {self.evaluation_id}",
        )

    async def _pace(
        self, rec: RunRecord, offsets: np.ndarray, link: QueryLink, frames: list[bytes]
    ) -> None:
        """Issue every query at its time from the pacer's thread, then drain."""
        gate = self._gate = OutstandingLimit(self.spec.max_outstanding)

        def issue(indices: range, issued_ns: int) -> None:  # on the pacer thread
            # Stamped in the live record before the bytes leave (a reply cannot beat
            # its issue time), so a run cancelled mid-schedule keeps every issue time.
            rec.paced[indices.start : indices.stop] = issued_ns
            rec.issued[indices.start : indices.stop] = issued_ns
            try:
                link.send(b"".join(frames[indices.start : indices.stop]))
            except BusError as exc:  # the bus is unreachable: these are lost, say why
                for i in indices:
                    rec.errors[i] = f"not sent: {exc}"
                gate.release(len(indices))

        # The pacer thread needs the GIL the moment its sleep ends (a short switch
        # interval), no GC pause may hold it, and no thread that may hold it (the
        # event loop's, the link's reader) may be preempted: all set before the clock
        # starts (a full collection takes ms), by the process's one owner of them
        # (jobs run concurrently).
        with self.tuning.measurement():
            rec.t0_ns = self.start_ns if self.start_ns is not None else now() + START_LEAD_NS
            rec.scheduled[:] = offsets
            pacer = Pacer(
                offsets,
                gate=gate,
                start_ns=rec.t0_ns,
                issue_many=issue,
                realtime=True,
                spin_s=LINK_SPIN_S,
                busy_s=LINK_BUSY_S,
            )
            pacer.start()
            try:
                # Abandoned on cancellation (SIGTERM, Ctrl-C, a cancelled job): the
                # finally below stops the pacer at once instead of waiting out the
                # schedule.
                result = await anyio.to_thread.run_sync(pacer.join, abandon_on_cancel=True)
                rec.not_issued = len(result.not_issued)  # counted, never silently dropped
                await anyio.to_thread.run_sync(self._drain, gate, link, abandon_on_cancel=True)
            finally:
                pacer.stop()
                # The pacer's thread ends within its current batch: once it has, no
                # issue time changes (a cancelled run's rows are read right after).
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(_stopped, pacer)
                self._threads_cpu_s += pacer.cpu_s

    def _drain(self, gate: OutstandingLimit, link: QueryLink) -> None:
        """Wait (in a worker thread) until every issued query is answered, the link
        fails or DRAIN_TIMEOUT_S passes: queries still outstanding stay uncompleted."""
        self._idle.clear()  # set again by the last answer or the link's end
        if gate.outstanding > 0 and link.error is None:
            self._idle.wait(DRAIN_TIMEOUT_S)

    async def _closed_loop(self) -> RunRecord:
        """``spec.concurrency`` queries in flight until ``duration_s`` (or max_queries):
        each answer sends the next query from the link's reader thread, at once."""
        s = self.spec
        cap = s.max_queries or 2**31
        rec = self.record = RunRecord(n=min(cap, max(s.concurrency, 1024)), batch_size=s.batch_size)
        link = await anyio.to_thread.run_sync(self._open_link)
        streams = Streams(rec, link, lambda i: link.frame(self.subject, self.payload(i)), cap)
        self._answered = streams.answered
        self._writing = streams.lock
        try:
            link.start(self._on_reply, on_end=streams.finished.set)
            rec.t0_ns = now()
            streams.deadline = rec.t0_ns + int(s.duration_s * 1e9)
            cpu0 = time.thread_time()
            for _ in range(s.concurrency):
                streams.send_next()
            self._threads_cpu_s += time.thread_time() - cpu0
            seen = rec.done
            while not await anyio.to_thread.run_sync(
                streams.finished.wait, DRAIN_TIMEOUT_S, abandon_on_cancel=True
            ):
                if rec.done == seen:
                    break  # nothing answered in DRAIN_TIMEOUT_S: the agent stopped answering
                seen = rec.done
        finally:
            streams.stop()
            link.close()
            self._threads_cpu_s += link.reader_cpu_s
        link.report()
        if link.error is not None:
            raise BusError(f"the bus refused the run's queries: {link.error}") from streams.failure
        if streams.failure is not None:
            raise streams.failure
        rec.trim(streams.count)
        return rec


def _stopped(pacer: Pacer) -> None:
    """Wait (in a worker thread) until a stopped pacer's thread has ended; what its
    callback raised is the run's to report, not this wait's."""
    with contextlib.suppress(Exception):
        pacer.join(PACER_STOP_S)


def _sole(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one failure a task group wraps (the first, should there be several)."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def best_effort(report: Callable[P, Awaitable[Any]], what: str) -> Callable[P, Awaitable[None]]:
    """``report`` (a run's progress callback) made best effort: a report that fails,
    whatever the exception, is logged (the first failure as an error, with its
    traceback) and the run goes on. A figure only shown never ends a measurement."""
    failed = False

    async def reported(*args: P.args, **kwargs: P.kwargs) -> None:
        nonlocal failed
        try:
            await report(*args, **kwargs)
        except Exception:
            level = logging.DEBUG if failed else logging.ERROR
            log.log(level, "%s: a progress report failed; the run goes on", what, exc_info=True)
            failed = True

    return reported


def running_p50_ms(rec: RunRecord) -> float | None:
    """p50 latency of the queries completed so far (for progress display only).

    Read on the event loop while the run goes on, without the run's lock: a closed
    loop's reader thread may be growing the record, replacing its arrays one after
    another. So each array is read once, and both are cut to the shorter one."""
    completed, scheduled = rec.completed, rec.scheduled
    n = min(len(completed), len(scheduled))
    completed, scheduled = completed[:n], scheduled[:n]
    done = completed > 0
    if not done.any():
        return None
    lat = (completed[done] - scheduled[done]) / 1e6
    return percentile(lat[-2000:], 50)
