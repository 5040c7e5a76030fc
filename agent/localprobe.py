"""Whether a local open loop's executor threads may run real-time (:mod:`agent.localrun`).

Decided before the clock starts, from the schedule's mean rate and a warm predict
time of the run's batch, probed through the executor outside the run's record.
"""

from __future__ import annotations

import threading

from agent.job import Job
from agent.localrecord import now
from agent.pipeline import Executor
from mlscope import samples
from mlscope.contracts import QueryReply, TraceLevel
from mlscope.schedule import Schedule

__all__ = ["REALTIME_MAX_BUSY", "REALTIME_MAX_QPS", "probe", "short_enough"]

REALTIME_MAX_QPS = 5_000.0
"""Above this mean rate an open loop's executor threads keep their normal priority (the
server's rule for its event-loop thread: a busy real-time thread takes a core)."""
REALTIME_MAX_BUSY = 0.5
"""Nor when the model would keep its predict thread busier than this (mean rate x a
warm predict of the run's batch): a real-time thread that computes most of the time
would starve the rest of the host."""


def short_enough(
    sched: Schedule | None, worker: Executor, inputs: samples.QueryRows, *, preprocessed: bool
) -> bool:
    """Whether the executor's threads may run real-time during this open loop: the
    pacer takes the GIL from them after each query, and one preempted by another
    process while it holds the GIL stalls the pacer (p99 issue lag 0.5-1.9 ms
    against 85-90 µs with them real-time, noop at 1,000 QPS on a loaded 2-core VM).
    Only at a mean rate and a warm predict time (two probe queries of the run's
    batch, outside the record) that keep the predict thread mostly idle."""
    if sched is None or not len(sched) or sched.duration_s <= 0:
        return False
    rate = len(sched) / sched.duration_s
    predict = min(probe(worker, inputs, preprocessed=preprocessed) for _ in range(2))
    return rate <= REALTIME_MAX_QPS and rate * predict / 1e9 <= REALTIME_MAX_BUSY


def probe(worker: Executor, inputs: samples.QueryRows, *, preprocessed: bool) -> float:
    """One query of the run's batch through the executor: its predict time (ns;
    infinite when it fails or is refused)."""
    done = threading.Event()
    got: list[QueryReply] = []

    def reply(r: QueryReply) -> None:
        got.append(r)
        done.set()

    job = Job(
        index=-1,
        inputs=inputs(0),
        received_ns=now(),
        level=TraceLevel.NONE,
        spans=None,
        reply=reply,
        preprocessed=preprocessed,
    )
    if not worker.submit(job) or not done.wait(10.0) or not got[0].ok:
        return float("inf")
    return float(got[0].t_predict_end - got[0].t_predict_start)
