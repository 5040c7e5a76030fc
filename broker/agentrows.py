"""A local run's rows (placement agent) as the server takes them: each
:class:`~mlscope.contracts.RunRows` message checked (known integer columns of one
length, within the rows the run may have, past no gap that lost messages could not
leave) and copied into the run's :class:`~mlscope.record.RunRecord`, scored with the
server's labels; answered rows whose times no run can have count as failed queries.
The bus side (the request, the wait, an agent gone silent or restarted, a cancel) is
``broker/agentrun.py``.
"""

from __future__ import annotations

import time

import numpy as np

from broker import lgclock
from mlscope import samples, wire
from mlscope.contracts import (
    MAX_SCHEDULED_QUERIES,
    ROWS_EVERY_S,
    AgentDescription,
    RunRows,
)
from mlscope.errors import EvaluationError, error_from_wire
from mlscope.record import ARRAYS, ROW_BYTES, RunRecord

__all__ = ["AGENT_TIMES", "OUTSIDE_RUN", "START_TIMEOUT_S", "Labels", "RowCollector"]

START_TIMEOUT_S = 30.0
"""How long an agent may take to start a local run; also how far a row's completion may
fall past the moment its rows arrived (the clock offset's error is far less)."""
Labels = samples.QueryRows | None
OUTSIDE_RUN = (
    "the query's completion is outside its run (before it was due, before the agent "
    "replied, or after its rows reached the server)"
)
"""Why an answered row of a local run whose latency no run can have counts as failed."""
AGENT_TIMES = ("agent_received", "predict_start", "predict_end", "agent_replied")
"""An answered query's agent times, in the order they happen."""


class RowCollector:
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

    def end(self, n: int) -> None:
        """Keep the first ``n`` rows (those the run has)."""
        if n < self.rec.n:
            self.rec.trim(n)

    def lost(self, *, restarted: bool) -> str:
        """The agent is gone (``restarted``: another process answers under its id):
        keep the rows it shipped; the reason the run gets."""
        self.end(self.rows)
        issued = max(self.issued, self.rows)
        again = " (it restarted)" if restarted else ""
        return (
            f"agent {self.agent_id} lost after {self.answered()} of {issued} queries"
            f"{again} (placement agent: {issued - self.rows} issued queries were not "
            "reported)"
        )

    def finish(self, rows: RunRows) -> tuple[str, ...]:
        """The run's end: its totals, and what went wrong on the way."""
        self.end(rows.queries)
        self.rec.not_issued = rows.not_issued
        # When the agent found its time up: not after its rows arrived here (give or
        # take the start timeout, as a row's completion), or it is no moment of the run.
        arrived = lgclock.now() - self.rec.t0_ns + int(START_TIMEOUT_S * 1e9)
        self.rec.time_up_ns = rows.time_up if rows.time_up <= arrived else 0
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
