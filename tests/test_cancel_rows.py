"""What a cancelled run stores, in either placement: every query it issued (answered,
or in flight and lost, saying so), each with its issue time, and a summary whose
counts are those of its stored rows.

Real stack (nats-server, server owning chDB, a noop agent) serving ``noop_slow``: the
noop model behind a custom step that sleeps, so that queries queue up in the agent and
a cancel finds many in flight. The job is cancelled the way ``mlscope cancel`` does it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from analysis.source import BusSource
from analysis.summary import summary as analysis_summary
from broker.cancel import IN_FLIGHT, cancelled_summary, issued_part
from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import remote
from mlscope.api import cancel_job
from mlscope.contracts import EvaluationSummary, JobEvent, JobRequest, ScenarioSpec
from mlscope.jobs import submit
from mlscope.outcomes import ERROR_OUTCOMES, Outcome, classify
from mlscope.record import RunRecord
from mlscope.schedule import build_schedule
from mlscope.settings import Settings
from tests.conftest import noop_step_stack

pytestmark = pytest.mark.timeout(180)

STEP_S = 0.05
"""Each query's pre-processing (2 pre-processing workers: 40 queries a second)."""
QPS = 80.0
"""Twice what the agent answers: a backlog of ~40 queries a second, under the agent's
queue capacity (256) for the seconds before the cancel."""
STEPS = f"import time\n\n\ndef step(env, data):\n    time.sleep({STEP_S})\n    return data\n"
SPEC = "SELECT spec FROM evaluations FINAL WHERE evaluation_id = {e:String}"
ROWS = (
    "SELECT query_index, scheduled_ns, issued_ns, completed_ns, ok, outcome, error "
    "FROM queries FINAL WHERE evaluation_id = {e:String} ORDER BY query_index"
)


@pytest.fixture(scope="module")
def slow_stack(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[Stack]:
    """nats-server, server and a noop agent (custom code allowed) serving noop_slow:
    the built-in noop model with a sleeping custom step first."""
    base = tmp_path_factory.mktemp("cancelrows")
    with noop_step_stack(base, zoo_dir, name="noop_slow", steps=STEPS) as s:
        yield s


def online(placement: str, *, duration_s: float = 20.0, qps: float = QPS) -> JobRequest:
    return JobRequest(
        model="noop_slow",
        framework="noop",
        trace_level="none",
        placement=placement,  # type: ignore[arg-type]
        scenario=ScenarioSpec(name="online", qps=qps, duration_s=duration_s, preprocess="timed"),
    )


def cancelled_after(settings: Settings, job: JobRequest, seconds: float) -> EvaluationSummary:
    """Submit ``job``, cancel it (as ``mlscope cancel`` does) ``seconds`` after its
    progress first shows answered queries: its summary, as the submitter hears it."""
    answering = threading.Event()

    def seen(event: JobEvent) -> None:
        if event.event == "progress" and (event.queries_done or 0) >= 10:
            answering.set()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            lambda: anyio.run(
                lambda: submit(settings, job, on_event=seen, timeout=120), backend="asyncio"
            )
        )
        assert answering.wait(60), "the run never showed answered queries"
        time.sleep(seconds)
        reply = anyio.run(
            lambda: cancel_job(settings, job.job_id, reason="test", timeout=20.0),
            backend="asyncio",
        )
        assert reply is not None, "no server confirmed the cancel"
        summary = waiting.result(timeout=30)
    assert summary.status == "cancelled" and not summary.valid
    return summary


def stored(settings: Settings, query: str, evaluation_id: str) -> list[list[Any]]:
    async def go() -> list[list[Any]]:
        async with busmod.connect(settings, name="test") as bus:
            return (await remote.sql(bus, query, {"e": evaluation_id}))[1]

    return anyio.run(go, backend="asyncio")


def stored_summary(settings: Settings, evaluation_id: str) -> dict[str, Any]:
    sql = "SELECT summary FROM evaluations FINAL WHERE evaluation_id = {e:String}"
    got = stored(settings, sql, evaluation_id)
    assert got, f"{evaluation_id} not stored"
    doc: dict[str, Any] = json.loads(got[0][0])
    return doc


@pytest.mark.parametrize("placement", ["server", "agent"])
def test_a_cancelled_run_stores_every_query_it_issued(slow_stack: Stack, placement: str) -> None:
    """Cancelled with a backlog in the agent: every query issued is stored, with its
    issue time; those still in flight are lost, saying so; and the summary's counts
    are the stored rows' (recomputed here from the raw columns)."""
    settings = slow_stack.settings
    job = online(placement)
    summary = cancelled_after(settings, job, 2.0)
    rows = stored(settings, ROWS, summary.evaluation_id)
    assert rows, "no query row stored"
    # What it ran on is stored as a finished run's is (reports name its system).
    spec = stored(settings, SPEC, summary.evaluation_id)[0][0]
    doc = json.loads(spec)
    assert doc["cancelled"] and doc["manifest"]["name"] == "noop_slow", doc.keys()
    assert doc["agent"]["agent_id"] == summary.agent_id and doc["agent"]["cpu_model"], doc["agent"]
    index, scheduled, issued, completed, ok, outcome = (
        np.asarray([r[k] for r in rows], np.int64) for k in range(6)
    )
    error = [str(r[6]) for r in rows]
    assert (index == np.arange(len(rows))).all()  # no gap: nothing issued left out
    # Every query sent carries its issue time (a closed loop's included).
    sent = outcome != Outcome.NOT_ISSUED
    assert sent.any() and (issued[sent] > 0).all(), np.flatnonzero(sent & (issued == 0))[:10]
    # The stored outcomes are the raw columns' (refusals are not stored apart: failed).
    recomputed = classify(issued=issued, completed=completed, ok=ok)
    assert (recomputed == np.where(outcome == Outcome.REFUSED, Outcome.FAILED, outcome)).all()
    counts = {o: int(np.count_nonzero(outcome == o)) for o in Outcome}
    # The backlog was reported: queries in flight at the cancel are stored as lost.
    lost = outcome == Outcome.LOST
    assert counts[Outcome.LOST] > 10, counts
    assert all(error[i] == IN_FLIGHT for i in np.flatnonzero(lost)), {
        error[i] for i in np.flatnonzero(lost)
    }
    # Nothing issued is missing: the agent answered in issue order, so every query
    # due before the last answer had been issued, and is stored.
    assert scheduled.max() >= completed.max() - 300_000_000, (scheduled.max(), completed.max())
    # The summary (as heard and as stored) counts what the rows hold.
    for doc in (summary.model_dump(), stored_summary(settings, summary.evaluation_id)):
        assert doc["queries"] == len(rows)
        assert doc["lost"] == counts[Outcome.LOST]
        assert doc["errors"] == sum(counts[o] for o in ERROR_OUTCOMES)
        assert doc["not_issued"] == counts[Outcome.NOT_ISSUED]
        n_sent = int(sent.sum())
        answered = n_sent - counts[Outcome.LOST]
        assert f"{answered} of {n_sent} issued queries answered" in doc["invalid_reasons"][0]
        cost = doc["loadgen_cost"]  # the load generator's CPU time up to the cancel
        assert cost is not None and cost["cpu_s"] > 0 and cost["loadgens"] == 1, cost
        assert doc["placement"] == cost["placement"] == placement, (doc["placement"], cost)
        if placement == "agent":  # its pacer's, in the agent, beside the agent process's
            assert cost["process_cpu_s"] >= cost["cpu_s"], cost
    # Analysis (report, dashboard) counts the same rows and shows no figure for it.
    with BusSource(settings) as source:
        row = analysis_summary(source, [summary.evaluation_id]).iloc[0]
    assert row["queries"] == len(rows)
    assert row["errors"] == sum(counts[o] for o in ERROR_OUTCOMES)
    for figure in ("p50_ms", "p99_ms", "trimmed_mean_ms", "throughput_ips"):
        assert row[figure] is None, (figure, row[figure])


def test_a_schedule_of_no_query_is_the_same_invalid_run_in_either_placement(
    slow_stack: Stack,
) -> None:
    """A duration shorter than the schedule's first arrival: in either placement a
    completed INVALID evaluation of 0 queries, for the same reasons (the server's load
    generator failed with an ExceptionGroup and stored nothing)."""
    got = {}
    for placement in ("server", "agent"):
        job = online(placement, duration_s=0.01, qps=100.0)
        assert len(build_schedule(job.scenario)[0]) == 0  # the premise
        s = anyio.run(functools.partial(submit, slow_stack.settings, job, timeout=60))
        assert s.status == "completed" and not s.valid and s.queries == 0, s
        assert stored_summary(slow_stack.settings, s.evaluation_id)["queries"] == 0
        got[placement] = set(s.invalid_reasons)
    assert got["server"] == got["agent"], got


def test_issued_part_leaves_a_query_never_sent_not_issued() -> None:
    """A query the outstanding bound kept back, between sent ones, is stored not
    issued (no error of its own); the summary counts every outcome of the part."""
    rec = RunRecord(n=8, batch_size=1, t0_ns=5)
    rec.scheduled[:] = np.arange(1, 9) * 1000
    sent = [0, 1, 3, 4]
    rec.issued[sent] = rec.scheduled[sent]
    rec.completed[[0, 1, 3]] = rec.issued[[0, 1, 3]] + 50
    rec.ok[[0, 1]] = 1
    rec.errors[3] = "boom"  # answered with an error: failed
    part = issued_part(rec)
    assert part.n == 5
    assert list(part.outcomes()) == [
        Outcome.OK,
        Outcome.OK,
        Outcome.NOT_ISSUED,
        Outcome.FAILED,
        Outcome.LOST,
    ]
    assert part.errors == {3: "boom", 4: IN_FLIGHT}
    job = JobRequest(
        model="noop",
        framework="noop",
        scenario=ScenarioSpec(name="online", qps=10, duration_s=1),
    )
    s = cancelled_summary(job, None, reason="test", started_at=time.time(), rec=part)
    assert (s.queries, s.errors, s.lost, s.not_issued) == (5, 2, 1, 1)
    assert "3 of 4 issued queries answered" in s.invalid_reasons[0]
