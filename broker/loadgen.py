"""The load generator: drives one agent with a scenario and keeps every timestamp.

Open loop (``online``): a seeded Poisson schedule is released by a pacer thread, so
the event loop's millisecond timer rounding never reaches the schedule. Up to
``LEAD_MAX_QPS`` (2,000/s) the pacer sleeps (no spin) until a tuned lead before each
deadline and hands the due batch to the event loop, which holds each query until it
is due (sleeping, then spinning the last stretch) and publishes it: the thread hop
falls before the deadline, not into the issue lag, and nothing is issued early
(:class:`LeadTuner`). Above that rate the pacer spins to each deadline itself.
Latency counts from each query's *scheduled* time: a late issue counts against the
system under test (no coordinated omission).

Closed loop (``single-stream``, ``concurrency``, each point of ``batched``): a fixed
number of queries in flight (``spec.concurrency``), each sent the moment a previous one
completes; its scheduled time is its issue time.

Open loops take any :class:`mlscope.schedule.Schedule` (Poisson, constant, multi-stream,
replay, piecewise, or one slice of a dealt global schedule): query ``i`` of the slice
is sent with its *global* index ``schedule.index[i]``, so several drivers in several
processes can share one global schedule and one start time (``start_ns``).

Every query keeps scheduled, issued and completed times (load-generator clock) and
the agent's received / predict-start / predict-end / replied times, converted to
the load-generator clock with the offset estimated over request/reply.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np

from mlscope import codec, names, wire
from mlscope.bus import Bus, request
from mlscope.contracts import ScenarioSpec, TraceLevel
from mlscope.errors import ConfigError, EvaluationError, OverloadedError
from mlscope.pacer import DEFAULT_BUSY_S, DEFAULT_SPIN_S, OutstandingLimit, Pacer
from mlscope.record import RunRecord
from mlscope.schedule import Schedule
from mlscope.stats import percentile
from mlscope.tuning import ProcessTuning

__all__ = [
    "Driver",
    "encode_query",
    "estimate_offset",
    "running_p50_ms",
]

now = time.perf_counter_ns
DRAIN_TIMEOUT_S = 10.0
START_LEAD_NS = 20_000_000  # start 20 ms out, so the first query is on time
LOOP_REALTIME_MAX_QPS = 5_000.0
"""Above this mean rate the event-loop thread keeps its normal priority: it is busy
most of the time there, and a busy real-time thread would take a core from the agent
and nats-server (the system under test)."""


LOOP_SLEEP_NS = 80_000
LOOP_SPIN_NS = 50_000
"""A batch that reaches the loop more than LOOP_SLEEP_NS before it is due sleeps until
LOOP_SPIN_NS before (a real-time thread's sleep ends ~25 µs late, a spin is exact)."""
LEAD_MAX_QPS = 2_000.0
"""Up to this mean rate the pacer releases queries ahead and the loop holds each until
its deadline (:class:`LeadTuner`): the loop is then blocked for at most the lead (≤ 400
µs) per batch, a small share of the 500 µs mean gap. Above it the holds would take
much of the loop's time, and replies would wait behind them, so the pacer spins and
releases each query when due (the hop to the loop then counts in the issue lag)."""


class LeadTuner:
    """The pacer's lead, tuned while the run goes so that ~1 batch in 4 reaches the
    event loop after its deadline.

    Released ``lead`` before its first query is due, a batch waits for the thread hop
    to the loop (a thread wake-up: ~100 µs on the 2-core VM of BENCHMARKS.md) and then
    spins on the loop to the deadline. Too short a lead puts the hop into the issue
    lag, too long a one spins the loop (CPU, and replies wait). The lead moves up by
    ``up_ns`` after a late arrival and down by a third of it after an early one: a
    stochastic approximation of the hop's 75th percentile (P(late) = 1/4 at balance),
    bounded by ``max_ns``. The pacer then sleeps to ``deadline - lead`` without
    spinning: its own lateness is part of what the lead absorbs.
    """

    def __init__(
        self, *, start_ns: int = 150_000, up_ns: int = 6_000, max_ns: int = 400_000
    ) -> None:
        self.lead_ns, self.up_ns, self.max_ns = start_ns, up_ns, max_ns
        self.pacer: Pacer | None = None
        self.late = self.early = 0

    def observe(self, *, late: bool) -> None:
        """One batch's arrival on the loop (on the loop thread)."""
        if late:
            self.late += 1
            self.lead_ns = min(self.lead_ns + self.up_ns, self.max_ns)
        else:
            self.early += 1
            self.lead_ns = max(self.lead_ns - self.up_ns // 3, 0)
        if self.pacer is not None:
            self.pacer.lead_ns = self.lead_ns


async def estimate_offset(
    bus: Bus, agent_id: str, *, rounds: int = 9, subject: str | None = None
) -> tuple[int, int]:
    """(agent clock - our clock, round trip) in ns from the ping with the smallest RTT
    (the first of equals) among ``rounds`` pings (at least one).

    NTP-style: offset = t_agent - (t_send + t_recv) / 2, error bounded by RTT / 2.
    ``subject``: another responder's control subject (a load-generator service's).
    """
    if rounds < 1:
        raise ConfigError(f"rounds must be at least 1, got {rounds}")
    target = subject or names.agent_ctl(agent_id)
    payload = codec.encode({"op": "ping"})
    pings = [await _ping(bus, target, payload) for _ in range(rounds)]
    return min(pings, key=lambda ping: ping[1])


async def _ping(bus: Bus, subject: str, payload: bytes) -> tuple[int, int]:
    """One ping: (agent clock - our clock, round trip) in ns."""
    t1 = now()
    reply = await request(bus, subject, payload, timeout=5.0)
    t2 = now()
    return int(reply["t_agent"]) - (t1 + t2) // 2, t2 - t1


def _hold_until(due: int, t: int) -> int:
    """Block the calling (event-loop) thread until ``due``; returns the time then. Far
    from it, sleep most of the way (a spin costs CPU), then spin (a sleep ends late)."""
    if due - t > LOOP_SLEEP_NS:
        time.sleep((due - t - LOOP_SPIN_NS) / 1e9)
        t = now()
    while t < due:
        t = now()
    return t


def _mean_rate(offsets: np.ndarray) -> float:
    last = float(offsets[-1]) if offsets.size else 0.0
    return offsets.size / (last / 1e9) if last > 0 else float("inf")


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
        self.offset_ns, self.on_progress = offset_ns, on_progress
        self.schedule, self.start_ns, self.payloads = schedule, start_ns, payloads
        self.tuning = tuning
        self.inbox = bus.nc.new_inbox()  # under this connection's role's inbox prefix
        self._outstanding = 0
        self._all_done = asyncio.Event()
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._first_global = 0
        self._stride = 1
        self.record: RunRecord | None = None
        self._gate: OutstandingLimit | None = None
        self._lead: LeadTuner | None = None
        self._cpu0 = 0.0

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

    async def _on_reply(self, msg: Any) -> None:
        t = now()
        rec = self.record
        if rec is None:  # a reply after the run's record was let go: nothing to fill
            return
        data = codec.decode(msg.data)
        if data.get("kind") == "error":
            i = self._local(int(data["error"].get("fields", {}).get("index", -1)))
            if i >= 0 and rec.completed[i] == 0:
                rec.errors[i] = data["error"]["message"]
                rec.refused[i] = data["error"].get("code") == OverloadedError.code
                self._complete(rec, i, t)
            return
        # Hot path: the reply's fields read straight from the decoded mapping.
        i = self._local(int(data["index"]))
        if i < 0 or rec.completed[i] != 0:
            return  # not ours or a duplicate
        if data.get("ok"):
            off = self.offset_ns + rec.t0_ns
            rec.agent_received[i] = int(data["t_received"]) - off
            rec.predict_start[i] = int(data["t_predict_start"]) - off
            rec.predict_end[i] = int(data["t_predict_end"]) - off
            rec.agent_replied[i] = int(data["t_replied"]) - off
            rec.ok[i] = 1
            out = data.get("outputs")
            if isinstance(out, np.ndarray) and out.size and out.ndim >= 1:
                top1 = out.reshape(out.shape[0], -1)[:, 0]
                rec.prediction[i] = int(top1[0])
                if self.labels is not None:
                    g = int(data["index"])
                    rec.correct[i] = int(np.count_nonzero(top1 == self.labels(g)))
        else:
            rec.errors[i] = str((data.get("error") or {}).get("message", "error"))
        self._complete(rec, i, t)

    def _complete(self, rec: RunRecord, i: int, t: int) -> None:
        rec.completed[i] = t - rec.t0_ns
        rec.done += 1
        self._outstanding -= 1
        if self._gate is not None:
            self._gate.release()
        if self._outstanding == 0:
            self._all_done.set()
        waiter = self._waiters.pop(i, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ------------------------------------------------------------------ scenarios

    async def run(self) -> RunRecord:
        sub = await self.bus.nc.subscribe(self.inbox, cb=self._on_reply)
        self._cpu0 = time.process_time()
        try:
            with self.tuning.load():
                rec = await self._run()
            # The load's own cost: from the clock's start (an open loop's queries are
            # all encoded before it) to the last reply.
            rec.cpu_s = time.process_time() - self._cpu0
        finally:
            await sub.unsubscribe()
        return rec

    async def _run(self) -> RunRecord:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._progress)
            if self.schedule is not None:
                rec = await self._open_loop(self.schedule)
            else:  # the scenario decided (broker.scenario.Scenario.closed_loop)
                rec = await self._closed_loop()
            tg.cancel_scope.cancel()
        return rec

    async def _progress(self) -> None:
        while True:
            await anyio.sleep(0.5)
            if self.record is not None and self.on_progress is not None:
                await self.on_progress(self.record, (now() - self.record.t0_ns) / 1e9)

    async def _send(self, indices: range, payloads: list[bytes]) -> None:
        """Hand queries to the bus client, each once it is due (a batch released ahead
        by the pacer's lead waits here, spinning: never early); each one's issue time
        is stamped here, so issue lag holds the pacer's part and the event loop's
        (``paced`` -> ``issued``)."""
        publish, subject, inbox = self.bus.nc.publish, self.subject, self.inbox
        rec = self.record
        if rec is None:
            raise EvaluationError("queries sent before the run's record exists")
        issued, scheduled, t0 = rec.issued, rec.scheduled, rec.t0_ns
        first = True
        for i in indices:
            due = t0 + int(scheduled[i])
            t = now()
            if first and self._lead is not None:
                self._lead.observe(late=t > due)
                first = False
            if t < due:
                t = _hold_until(due, t)
            issued[i] = max(t - t0, 1)
            await publish(subject, payloads[i], reply=inbox)

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
        if rec.n == 0:
            raise EvaluationError(f"scenario {s.name!r} schedules no query")
        self._index(sched)
        glob = sched.index.tolist()
        # Every payload is built before the clock starts.
        payloads = self.payloads if self.payloads is not None else [self.payload(g) for g in glob]
        if len(payloads) != rec.n:
            raise EvaluationError(f"{len(payloads)} payloads for {rec.n} queries")
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()

        def issue(indices: range) -> None:  # on the loop: one hop per batch of due queries
            self._outstanding += len(indices)
            self._all_done.clear()
            task = loop.create_task(self._send(indices, payloads))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        self._gate = OutstandingLimit(s.max_outstanding)
        rate = _mean_rate(offsets)
        lead = self._lead = LeadTuner() if rate <= LEAD_MAX_QPS else None

        def hop(indices: range, _issued_ns: int) -> None:  # on the pacer thread
            loop.call_soon_threadsafe(issue, indices)

        # The pacer thread needs the GIL the moment its sleep ends (a short switch
        # interval), no GC pause may hold it, and the loop thread it hands the GIL to
        # must not be preempted: all set before the clock starts (a full collection
        # takes ms), by the process's one owner of them (jobs run concurrently).
        with self.tuning.measurement(realtime_loop=rate <= LOOP_REALTIME_MAX_QPS):
            rec.t0_ns = self.start_ns if self.start_ns is not None else now() + START_LEAD_NS
            rec.scheduled[:] = offsets
            pacer = Pacer(
                offsets,
                gate=self._gate,
                start_ns=rec.t0_ns,
                issue_many=hop,
                realtime=True,
                lead_s=lead.lead_ns / 1e9 if lead is not None else 0.0,
                spin_s=0.0 if lead is not None else DEFAULT_SPIN_S,
                busy_s=0.0 if lead is not None else DEFAULT_BUSY_S,
            )
            if lead is not None:
                lead.pacer = pacer
            self._cpu0 = time.process_time()
            pacer.start()
            try:
                # Abandoned on cancellation (SIGTERM, Ctrl-C): the finally below stops
                # the pacer at once instead of waiting out the schedule.
                result = await anyio.to_thread.run_sync(pacer.join, abandon_on_cancel=True)
                rec.paced[:] = result.issued_ns
                rec.not_issued = len(result.not_issued)  # counted, never silently dropped
                with anyio.move_on_after(DRAIN_TIMEOUT_S):
                    if self._outstanding > 0:
                        await self._all_done.wait()
            finally:
                pacer.stop()
        return rec

    async def _closed_loop(self) -> RunRecord:
        """``spec.concurrency`` queries in flight until ``duration_s`` (or max_queries)."""
        s = self.spec
        cap = s.max_queries or 2**31
        rec = self.record = RunRecord(n=min(cap, max(s.concurrency, 1024)), batch_size=s.batch_size)
        loop = asyncio.get_running_loop()
        rec.t0_ns = now()
        deadline = rec.t0_ns + int(s.duration_s * 1e9)
        count = 0
        stalled = False

        async def stream() -> None:
            nonlocal count, stalled
            while count < cap and now() < deadline and not stalled:
                i = count
                count += 1
                if i >= rec.n:  # the run outlasts the room: grow, never stop early
                    rec.grow()
                payload = self.payload(i)
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters[i] = fut
                t = now() - rec.t0_ns
                rec.scheduled[i] = rec.paced[i] = rec.issued[i] = t
                self._outstanding += 1
                await self.bus.nc.publish(self.subject, payload, reply=self.inbox)
                with anyio.move_on_after(DRAIN_TIMEOUT_S):
                    await fut
                if rec.completed[i] == 0:
                    stalled = True  # the agent stopped answering

        async with anyio.create_task_group() as tg:
            for _ in range(s.concurrency):
                tg.start_soon(stream)
        rec.trim(count)
        return rec


def running_p50_ms(rec: RunRecord) -> float | None:
    """p50 latency of the queries completed so far (for progress display only)."""
    done = rec.completed > 0
    if not done.any():
        return None
    lat = (rec.completed[done] - rec.scheduled[done]) / 1e6
    return percentile(lat[-2000:], 50)
