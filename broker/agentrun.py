"""A run whose load is generated in the agent (``placement: agent``), seen from the server.

::

    server                                        agent (agent/localrun.py)
      ctl RunOp {scenario}, reply inbox ────────► schedule, sample order, pacer: local
      ◄──────────────────── RunStarted {t0_agent}
      on mlscope.agent.<id>.rows.<evaluation>:
      ◄── RunRows (columns, every 0.25 s) ─────── rows done so far
      ◄── RunRows final {queries, not_issued,  ─── the rest, and the totals
                        loadgen_cpu_s, process_cpu_s}

Rows travel on the agent's own rows subject, not as answers to the run request: on a
bus with credentials a responder may answer only for a while after a request
(``allow_responses``), and a run lasts as long as it lasts. The server subscribes
before it sends the request, so no row is missed.

The server fills the same :class:`mlscope.record.RunRecord` a server-placed run fills:
the agent's times are ns from its ``t0``, and ``t0`` is mapped onto the server's clock
with the offset measured by ping (``rec.t0_ns = t0_agent - offset``), so stored rows,
spans and the trace timeline line up as for any run. The server scores each query's
top-1 against its own labels (the same seeded order, :mod:`mlscope.samples`) and judges
the run with the same code (:func:`broker.summary.judge`). The final rows' CPU times
go into the record as well: the load generator's own threads' as ``cpu_s`` (what a
server-placed run's load generator reports, read by the summary's ``loadgen_cost`` the
same way) and the agent process's as ``process_cpu_s`` (:mod:`agent.localcpu`).

An agent that goes silent is pinged; if it does not answer, or another process now
answers under its id (:func:`gone`), the rows it shipped are kept and the run gets the
reason "agent <id> lost after N of M queries" ("(it restarted)" for the latter); rows
it had not shipped are not stored (their times never left the agent).

A cancelled job (:mod:`broker.cancel`) releases the agent's evaluation at once, which
stops the run there; the agent then ships its final rows, every query it issued (one
still in flight without its completion), and those are what the cancelled run stores.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import anyio
import numpy as np

from broker import lgclock
from mlscope import codec, names, samples, wire
from mlscope.bus import Bus, next_msg, request
from mlscope.contracts import (
    MAX_SCHEDULED_QUERIES,
    ROWS_EVERY_S,
    AgentDescription,
    PingOp,
    ReleaseOp,
    RunOp,
    RunRows,
    RunStarted,
    ScenarioSpec,
    TraceLevel,
)
from mlscope.errors import BusError, EvaluationError, MLScopeError, error_from_wire
from mlscope.record import ARRAYS, ROW_BYTES, RunRecord
from mlscope.registry import list_agents

__all__ = ["IDLE_S", "Absence", "drive", "gone"]

log = logging.getLogger("mlscope.server")

IDLE_S = 3.0
"""Silence (no rows) after which the server pings the agent: it ships every
:data:`~mlscope.contracts.ROWS_EVERY_S`."""
START_TIMEOUT_S = 30.0
CANCEL_ROWS_WAIT_S = 5.0
"""How long a cancelled run waits for the agent's final rows."""
END_SLACK_S = 60.0
"""Beyond the run's duration and drain, how long a live but silent agent is awaited."""
Labels = samples.QueryRows | None
OUTSIDE_RUN = (
    "the query's completion is outside its run (before it was due, before the agent "
    "replied, or after its rows reached the server)"
)
"""Why an answered row of a local run whose latency no run can have counts as failed."""
AGENT_TIMES = ("agent_received", "predict_start", "predict_end", "agent_replied")
"""An answered query's agent times, in the order they happen."""


async def drive(
    bus: Bus,
    *,
    agent: AgentDescription,
    evaluation_id: str,
    spec: ScenarioSpec,
    trace_level: TraceLevel,
    offset_ns: int,
    labels: Labels,
    on_progress: Callable[[RunRecord, float], Awaitable[Any]] | None = None,
    run_id: str | None = None,
) -> tuple[RunRecord, tuple[str, ...]]:
    """Have the agent run ``spec`` for ``evaluation_id`` (``run_id``: which of its
    runs, when it makes several: the agent keeps the run's spans under it); the filled
    record and any reasons it is INVALID."""
    agent_id = agent.agent_id
    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox)
    rows_sub = await bus.nc.subscribe(names.agent_rows(agent_id, evaluation_id))
    try:
        op = RunOp(
            evaluation_id=evaluation_id,
            run_id=run_id,
            scenario=spec,
            trace_level=trace_level.name.lower(),
            max_bytes=bus.payload_budget(),
        )
        asked = lgclock.now()
        await bus.nc.publish(names.agent_ctl(agent_id), codec.encode_model(op), reply=inbox)
        started = await _started(sub, agent_id)
        rec = RunRecord(n=max(started.queries, 1), batch_size=spec.batch_size)
        rec.t0_ns = _t0(started, offset_ns, asked, agent_id)
        rec.preprocessed = started.preprocess == "ahead"
        rec.streamed = started.streamed
        most = started.queries or spec.max_queries or MAX_SCHEDULED_QUERIES
        collector = _Collector(
            rec, labels, agent, max_bytes=op.max_bytes, most=min(most, MAX_SCHEDULED_QUERIES)
        )
        limit = spec.duration_s + 10.0 + END_SLACK_S
        try:
            reasons = await collector.collect(bus, rows_sub, limit, on_progress)
        except anyio.get_cancelled_exc_class():  # the job is cancelled: keep what ran
            with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_ROWS_WAIT_S):
                await collector.stopped(bus, evaluation_id, rows_sub, on_progress)
            raise
    finally:
        for s in (sub, rows_sub):
            await s.unsubscribe()
    return collector.rec, reasons


async def _started(sub: Any, agent_id: str) -> RunStarted:
    """The agent's answer to the run request (its typed error raised)."""
    msg = await next_msg(sub, START_TIMEOUT_S)
    if msg is None:
        raise BusError(
            f"agent {agent_id} did not start the local run within {START_TIMEOUT_S:.0f} s",
            agent_id=agent_id,
        )
    data = codec.decode(msg.data)
    if isinstance(data, dict) and data.get("kind") == "error":
        raise error_from_wire(data["error"])
    return codec.validate(RunStarted, data)


def _t0(started: RunStarted, offset_ns: int, asked_ns: int, agent_id: str) -> int:
    """The run's offset 0 on our clock. The agent starts its run as it answers (50 ms
    ahead), so its ``t0_agent`` falls between the request and the answer, give or take
    the start timeout (a WireError naming the agent otherwise)."""
    return lgclock.on_our_clock(
        started.t0_agent,
        offset_ns,
        since_ns=asked_ns,
        slack_s=START_TIMEOUT_S,
        what=f"agent {agent_id} started its run",
        agent_id=agent_id,
    )


class _Collector:
    """RunRows into a RunRecord, scored with the server's labels; ``max_bytes``: the
    largest message the run's request let the agent send; ``most``: the rows the run
    may have (an open loop's schedule, a closed loop's ``max_queries``)."""

    def __init__(
        self,
        rec: RunRecord,
        labels: Labels,
        agent: AgentDescription,
        *,
        max_bytes: int,
        most: int = MAX_SCHEDULED_QUERIES,
    ) -> None:
        self.rec, self.labels, self.agent = rec, labels, agent
        self.most = most
        self.per_message = max(1, max_bytes // ROW_BYTES)
        """The most rows one message of ``max_bytes`` can carry."""
        self.agent_id = agent.agent_id
        self.began = time.monotonic()
        self.messages = 0
        self.seq = -1
        """The last message's ``seq`` (-1 before the first)."""
        self.skipped = 0
        """Rows the messages skipped so far: those of messages lost on the bus."""
        self.issued = 0
        self.rows = 0

    async def collect(
        self,
        bus: Bus,
        sub: Any,
        limit_s: float,
        on_progress: Callable[[RunRecord, float], Awaitable[Any]] | None,
    ) -> tuple[str, ...]:
        began = time.monotonic()
        shown = 0.0
        while True:
            # The deadline holds whether the agent is silent or not: one that keeps
            # sending rows and never a final one is given up all the same.
            if time.monotonic() - began > limit_s:
                self._end(self.rows)
                return (
                    f"agent {self.agent_id} did not finish its local run within "
                    f"{limit_s:.0f} s (answered {self.answered()} of {self.issued} queries)",
                )
            msg = await next_msg(sub, IDLE_S)
            if msg is None:
                if absence := await gone(bus, self.agent):
                    return (self._lost(absence),)
                continue
            rows = codec.decode_model(RunRows, msg.data)
            self.add(rows)
            if on_progress is not None and time.monotonic() - shown > 0.5:
                shown = time.monotonic()
                await on_progress(self.rec, shown - began)
            if rows.final:
                return self.finish(rows)

    async def stopped(
        self,
        bus: Bus,
        evaluation_id: str,
        sub: Any,
        on_progress: Callable[[RunRecord, float], Awaitable[Any]] | None,
    ) -> None:
        """The run is cancelled here: release the agent's evaluation, which stops its
        run and ships its final rows (every query it issued, those still in flight
        included), and add them; then report the record (what a cancelled job
        stores). Only the rows shipped so far when the agent does not answer. The
        rows are the answer, so the release asks for no reply; the evaluator's own
        release on its way out then finds the session ended."""
        began = time.monotonic()
        release = codec.encode_model(ReleaseOp(evaluation_id=evaluation_id))
        await bus.nc.publish(names.agent_ctl(self.agent_id), release)
        try:
            while (msg := await next_msg(sub, CANCEL_ROWS_WAIT_S)) is not None:
                rows = codec.decode_model(RunRows, msg.data)
                self.add(rows)
                if rows.final:
                    self.finish(rows)
                    break
        except MLScopeError as exc:  # bad rows: the cancel goes on with those added
            log.warning("agent %s: cancelled run's final rows: %s", self.agent_id, exc)
        if on_progress is not None:
            with contextlib.suppress(MLScopeError):
                await on_progress(self.rec, time.monotonic() - began)

    def add(self, rows: RunRows) -> None:
        """Copy one message's rows into the record (growing it as needed). Rows that
        are not columns of one length and of numbers, that reach past the most
        queries a run may hold, or that start past a gap no lost messages leave
        (:meth:`_check_gap`), are an EvaluationError naming the agent; answered
        rows whose times no clock can produce count as failed queries."""
        cols = _checked_columns(rows, self.agent_id, self.most)
        self._check_gap(rows)
        self.messages += 1
        self.seq = max(self.seq, rows.seq)
        self.issued = max(self.issued, rows.issued)
        count = len(cols["ok"]) if "ok" in cols else 0
        a, b = rows.start, rows.start + count
        rec = self.rec
        while b > rec.n:
            rec.grow()
        for name in ARRAYS:
            if name in cols:
                getattr(rec, name)[a:b] = cols[name]
        for i, e in rows.errors.items():
            rec.errors[int(i)] = e
        self._fail_disordered(a, b)
        self._fail_outside(a, b)
        top1 = cols.get("top1")
        if top1 is not None and count:
            top1 = top1.reshape(count, -1)
            ok = rec.ok[a:b].astype(bool)
            pred = samples.top1(top1)  # a class index or -1, never a value wrapped into int32
            rec.prediction[a:b] = np.where(ok, pred, -1) if pred is not None else -1
            if self.labels is not None:
                want = self.labels.span(a, b)
                k = min(want.shape[1], top1.shape[1])
                hits = np.count_nonzero(top1[:, :k] == want[:, :k], axis=1)
                rec.correct[a:b] = np.where(ok, hits, 0)
        self.rows = max(self.rows, b)
        rec.done += int(np.count_nonzero(cols["completed"])) if "completed" in cols else 0

    def _check_gap(self, rows: RunRows) -> None:
        """Rows that start past the last one received leave a gap the record grows to
        hold; only lost messages leave one (an agent ships its rows in order, each
        message from where the last ended). A gap must fit in the rows the messages
        its ``seq`` says were lost could carry, and all gaps together in one full
        message lost each :data:`~mlscope.contracts.ROWS_EVERY_S` since the run
        started (``seq`` is the agent's word: time bounds it), else an EvaluationError
        naming the agent. So an agent makes the record hold at most the rows it sent
        and ~4 full messages' worth a second, never a run's worth from one message.
        A legitimate agent loses fewer rows than that unless it both loses messages
        and answers more queries a second than ``4 * max_bytes / 74`` (57 k for 1 MiB)."""
        gap = rows.start - self.rows
        if gap <= 0:
            return
        lost = max(rows.seq - self.seq - 1, 0)
        elapsed = time.monotonic() - self.began
        if gap > lost * self.per_message:
            problem = (
                f"rows from {rows.start} after {self.rows}, past what {lost} lost messages carry"
            )
        elif self.skipped + gap > (elapsed / ROWS_EVERY_S + 2) * self.per_message:
            problem = (
                f"{self.skipped + gap} rows skipped in {elapsed:.1f} s, past what the messages "
                "lost in that time carry"
            )
        else:
            self.skipped += gap
            return
        raise _malformed(rows, self.agent_id, problem)

    def _fail_disordered(self, a: int, b: int) -> None:
        """Answered rows ``a .. b - 1`` whose agent times break
        :func:`mlscope.wire.agent_times_ordered` (a negative queueing or compute) become
        failed queries, as a served run's would."""
        rec = self.rec
        ordered = wire.agent_times_ordered(*(getattr(rec, name)[a:b] for name in AGENT_TIMES))
        for i in np.flatnonzero((rec.ok[a:b] != 0) & ~ordered):
            rec.ok[a + i] = 0
            rec.errors[a + int(i)] = wire.DISORDERED_TIMES

    def _fail_outside(self, a: int, b: int) -> None:
        """Answered rows ``a .. b - 1`` that complete before they were due or before the
        agent replied (a negative latency), or after the rows arrived here (give or take
        the start timeout: the clock offset's error is far less), become failed queries:
        no run produces them, and their latency would be a figure of the verdict."""
        rec = self.rec
        now_ns = lgclock.now() - rec.t0_ns + int(START_TIMEOUT_S * 1e9)
        done = rec.completed[a:b]
        inside = (rec.scheduled[a:b] <= done) & (rec.agent_replied[a:b] <= done) & (done <= now_ns)
        for i in np.flatnonzero((rec.ok[a:b] != 0) & ~inside):
            rec.ok[a + i] = 0
            rec.errors[a + int(i)] = OUTSIDE_RUN

    def answered(self) -> int:
        return int(np.count_nonzero(self.rec.ok[: self.rows]))

    def _end(self, n: int) -> None:
        if n < self.rec.n:
            self.rec.trim(n)

    def _lost(self, absence: Absence) -> str:
        """The agent is gone: keep the rows it shipped."""
        self._end(self.rows)
        issued = max(self.issued, self.rows)
        restarted = " (it restarted)" if absence == "restarted" else ""
        return (
            f"agent {self.agent_id} lost after {self.answered()} of {issued} queries"
            f"{restarted} (placement agent: {issued - self.rows} issued queries were not "
            "reported)"
        )

    def finish(self, rows: RunRows) -> tuple[str, ...]:
        """The run's end: its totals, and what went wrong on the way."""
        self._end(rows.queries)
        self.rec.not_issued = rows.not_issued
        # The load generator's CPU (its threads' in the agent) and the agent process's:
        # the summary's loadgen_cost (broker.summary), as for any run.
        self.rec.cpu_s = rows.loadgen_cpu_s or 0.0
        self.rec.process_cpu_s = rows.process_cpu_s
        why: list[str] = []
        if self.messages != rows.seq + 1:
            why.append(
                f"{rows.seq + 1 - self.messages} of {rows.seq + 1} row messages of the "
                "local run were lost on the bus"
            )
        if rows.error is not None:
            err = error_from_wire(rows.error)
            why.append(f"the agent's local run failed: {err.message}")
        return tuple(why)


def _checked_columns(rows: RunRows, agent_id: str, most: int) -> dict[str, np.ndarray]:
    """``rows``' columns once each is a known one, of integers, one per row (``top1``:
    a row each), and the rows end within the ``most`` the run may have (the record
    grows to hold them: one row far out would take gigabytes)."""
    cols = rows.columns
    count = len(cols["ok"]) if "ok" in cols else 0
    problem = ""
    unknown = sorted(set(cols) - {*ARRAYS, "top1"})
    if unknown:
        problem = f"unknown columns {', '.join(repr(n)[:40] for n in unknown[:5])}"
    elif rows.start + count > most:
        problem = f"rows past {most} queries"
    else:
        for name, col in cols.items():
            if col.dtype.kind not in "biu" or col.ndim != (2 if name == "top1" else 1):
                problem = f"column {name!r} is not integers, one per row"
            elif len(col) != count:
                problem = f"column {name!r} has {len(col)} rows, 'ok' {count}"
            if problem:
                break
    if problem:
        raise _malformed(rows, agent_id, problem)
    return cols


def _malformed(rows: RunRows, agent_id: str, problem: str) -> EvaluationError:
    """Why ``rows`` from the agent ``agent_id`` end its run."""
    return EvaluationError(
        f"agent {agent_id} sent malformed local-run rows: {problem}",
        agent_id=agent_id,
        evaluation_id=rows.evaluation_id,
    )


Absence = Literal["", "silent", "restarted"]
"""Why the agent process given a run is gone (:func:`gone`); "" while it is there."""


async def gone(bus: Bus, agent: AgentDescription) -> Absence:
    """Whether the agent process that was given a run is gone: ``"silent"`` when its id
    answers no ping within 2 s; ``"restarted"`` when it answers but its registry entry
    names another process (pid or start time differ: an agent restarted under its id
    knows nothing of the lost one's run, and would answer pings until a deadline);
    ``""`` while it is there, or while the registry cannot tell."""
    try:
        await request(
            bus, names.agent_ctl(agent.agent_id), codec.encode_model(PingOp()), timeout=2.0
        )
    except MLScopeError:
        return "silent"
    try:
        now = {a.agent_id: a for a in await list_agents(bus)}.get(agent.agent_id)
    except MLScopeError:
        return ""
    if now is not None and (now.pid, now.started_at) != (agent.pid, agent.started_at):
        return "restarted"
    return ""
