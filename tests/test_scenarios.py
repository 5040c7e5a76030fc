"""Every scenario end to end at small scale: real nats-server, server and noop agent.

Timing is never asserted (the machine is shared); counts, stored rows, the schedule
and the shape of latencies are.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import anyio
import numpy as np
import pytest

from broker.scenario_kinds.peak import next_rate, peak_floor_qps
from broker.scenarios import build_schedule
from cli.stack import Stack
from cli.summary_text import format_summary
from mlscope import bus as busmod
from mlscope import names, remote, schedule
from mlscope.api import cancel_job
from mlscope.contracts import EvaluationSummary, JobEvent, JobRequest, ScenarioSpec
from mlscope.errors import BusError, ConfigError
from mlscope.jobs import submit
from mlscope.provision import provisioned
from mlscope.settings import Settings
from mlscope.stats import percentile
from mlscope.validity import ValidityPolicy
from tests.conftest import LOOSE, REPO, child_env, python

pytestmark = pytest.mark.timeout(240)


def run(settings: Settings, spec: ScenarioSpec) -> EvaluationSummary:
    job = JobRequest(model="noop", framework="noop", scenario=spec, trace_level="none")
    return anyio.run(lambda: submit(settings, job, timeout=180), backend="asyncio")


def stored(settings: Settings, sql: str, evaluation_id: str) -> list[list[object]]:
    """The rows of ``sql`` (its parameter ``e``: the evaluation) read through the server."""

    async def go() -> list[list[object]]:
        async with busmod.connect(settings, name="test") as bus:
            return (await remote.sql(bus, sql, {"e": evaluation_id}))[1]

    return anyio.run(go, backend="asyncio")


def stored_count(settings: Settings, evaluation_id: str) -> int:
    sql = "SELECT count() FROM queries FINAL WHERE evaluation_id = {e:String}"
    return int(str(stored(settings, sql, evaluation_id)[0][0]))


def rows(settings: Settings, evaluation_id: str) -> np.ndarray:
    """(index, scheduled, issued, completed) ns of every stored query, in index order."""
    sql = (
        "SELECT query_index, scheduled_ns, issued_ns, completed_ns FROM queries "
        "FINAL WHERE evaluation_id = {e:String} ORDER BY query_index"
    )
    return np.asarray(stored(settings, sql, evaluation_id), dtype=np.int64).reshape(-1, 4)


def test_cli_noop_online_json_has_issue_lag_and_split(noop_stack: Stack) -> None:
    out = subprocess.run(
        [
            python(),
            "-m",
            "cli.submit",
            "noop",
            "--framework",
            "noop",
            "--scenario",
            "online",
            "--qps",
            "300",
            "--duration",
            "2",
            "--json",
        ],
        env=child_env(noop_stack.settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["errors"] == 0 and doc["not_issued"] == 0
    assert doc["queries"] == len(schedule.poisson(300, duration_s=2, seed=0))
    lag = doc["issue_lag_us"]
    assert 0 <= lag["min"] <= lag["p50"] <= lag["p90"] <= lag["p99"] <= lag["p99.9"] <= lag["max"]
    # 2 s is shorter than the default 10 s minimum: INVALID, and it says why.
    assert not doc["valid"] and any("< minimum 10 s" in r for r in doc["invalid_reasons"])
    split = doc["latency_split_ms"]
    assert set(split) >= {"issue_lag", "transport", "queueing", "compute", "reply", "overhead"}
    assert split["compute"]["p50"] < split["overhead"]["p50"]  # noop computes nothing
    assert split["transport"]["p50"] > 0


@pytest.mark.parametrize(
    "spec",
    [
        ScenarioSpec(name="constant", qps=150, duration_s=1.5, **LOOSE),
        ScenarioSpec(name="multi-stream", qps=40, batch_size=4, duration_s=1.5, **LOOSE),
        ScenarioSpec(
            name="piecewise",
            segments=((20, 300, 1.0), (300, 300, 0.5), (600, 600, 0.3)),
            seed=4,
            **LOOSE,
        ),
        ScenarioSpec(name="replay", arrivals_s=(0.01, 0.02, 0.0, 0.005, 0.3, 0.001) * 8, **LOOSE),
    ],
    ids=lambda s: s.name,
)
def test_open_loop_scenarios_issue_their_schedule(noop_stack: Stack, spec: ScenarioSpec) -> None:
    s = run(noop_stack.settings, spec)
    expected, _ = build_schedule(spec)
    assert s.errors == 0 and s.not_issued == 0
    # Too few queries for early stopping's p99 is the rule such short runs break; on a
    # loaded machine the completions of a sub-second half window can also trail its
    # arrivals by a latency or two (the overload rule), or the agent's process wait a
    # second for a core (a gap in its answers), which is not what is tested.
    allowed = ("early stopping", "overloaded", "did not answer")
    assert all(r.startswith(allowed) for r in s.invalid_reasons), s.invalid_reasons
    assert s.queries == len(expected) and s.samples == len(expected) * spec.batch_size
    got = rows(noop_stack.settings, s.evaluation_id)
    assert (got[:, 0] == np.arange(len(expected))).all()
    assert (got[:, 1] == expected.offsets_ns).all()  # exactly the schedule
    assert (got[:, 2] >= got[:, 1]).all()  # never issued early
    assert (got[:, 3] > got[:, 2]).all()


@pytest.mark.parametrize("name,concurrency", [("single-stream", 1), ("concurrency", 3)])
def test_closed_loops_keep_n_outstanding(noop_stack: Stack, name: str, concurrency: int) -> None:
    s = run(
        noop_stack.settings,
        ScenarioSpec.model_validate(
            {"name": name, "concurrency": concurrency, "duration_s": 1.0, **LOOSE}
        ),
    )
    assert s.errors == 0 and s.queries > 50
    assert all(r.startswith("early stopping") for r in s.invalid_reasons), s.invalid_reasons
    got = rows(noop_stack.settings, s.evaluation_id)
    assert (got[:, 1] == got[:, 2]).all()  # a closed loop schedules a query when it sends it
    # At every issue, at most `concurrency` queries are in flight (counting itself).
    issued, done = got[:, 2], got[:, 3]
    in_flight = [(issued <= t).sum() - (done <= t).sum() for t in issued]
    assert max(in_flight) <= concurrency
    if concurrency > 1:
        assert max(in_flight) == concurrency


def test_batched_sweep_stores_every_point(noop_stack: Stack) -> None:
    sizes = (1, 8, 32)
    s = run(
        noop_stack.settings,
        ScenarioSpec(name="batched", batch_sizes=sizes, duration_s=0.7, **LOOSE),
    )
    assert [p["batch_size"] for p in s.points] == list(sizes)
    best = max(s.points, key=lambda p: p["throughput_ips"])
    assert s.optimal_batch_size == best["batch_size"]
    assert s.throughput_ips == best["throughput_ips"]
    for p in s.points:  # every query of every point stored (a noop stream: ~10^5 a point)
        stored = stored_count(noop_stack.settings, p["evaluation_id"])
        assert stored == p["queries"] > 0, (stored, p)
    # The job's figures are its best point's, and so is the batch size it is shown under.
    assert s.scenario["batch_size"] == s.optimal_batch_size
    assert s.scenario["batch_sizes"] == list(sizes)


def test_a_sweep_of_one_point_is_stored_under_that_points_batch_size(noop_stack: Stack) -> None:
    """One point is stored once, as the job's evaluation, with its rows: its summary
    names the batch size its rows have, not the spec's default of 1."""
    s = run(
        noop_stack.settings,
        ScenarioSpec(name="batched", batch_sizes=(16,), duration_s=0.5, **LOOSE),
    )
    assert s.scenario["batch_size"] == s.optimal_batch_size == 16

    async def sizes() -> list[list[object]]:
        async with busmod.connect(noop_stack.settings, name="test") as bus:
            return (
                await remote.sql(
                    bus,
                    "SELECT DISTINCT batch_size FROM queries FINAL "
                    "WHERE evaluation_id = {e:String}",
                    {"e": s.evaluation_id},
                )
            )[1]

    assert anyio.run(sizes, backend="asyncio") == [[16]]


def test_peak_search_tries_rates_and_reports_the_highest_passing(noop_stack: Stack) -> None:
    """A bound the noop agent meets at a few hundred QPS on a quiet machine and cannot
    at thousands (2 cores): the search doubles past the agent's capacity, then bisects.
    Which rates pass depends on the machine's speed and load; what is checked is that
    every step is the one the search rule gives for what was seen, and that the result
    is the highest passing rate (or INVALID with a reason when none passed)."""
    spec = ScenarioSpec(
        name="peak", qps=400, duration_s=2.0, latency_bound_ms=50, peak_trials=7, **LOOSE
    )
    floor = peak_floor_qps(spec, ValidityPolicy())
    assert floor < spec.qps  # 2 s at 400 QPS: enough queries to show p99
    s = run(noop_stack.settings, spec)
    rates = [p["qps"] for p in s.points]
    valid = [p["valid"] for p in s.points]
    assert rates[0] == 400 and len(rates) <= 7
    passed: float | None = None
    failed: float | None = None
    for k, (rate, ok) in enumerate(zip(rates, valid, strict=True)):
        if passed is not None and failed is not None:
            assert passed < rate < failed  # a bisection step
        if ok:
            passed = rate if passed is None else max(passed, rate)
        else:
            failed = rate if failed is None else min(failed, rate)
        following = next_rate(rate, passed, failed, floor)
        if k + 1 < len(rates):
            assert rates[k + 1] == following
        else:  # done: the bound is pinned down, the floor reached, or the trials spent
            assert following is None or len(rates) == spec.peak_trials
    passing = [r for r, ok in zip(rates, valid, strict=True) if ok]
    if not passing:  # a machine too loaded for the bound even at the floor
        assert not s.valid and s.peak_qps is None
        assert any("peak search: no rate tried" in r for r in s.invalid_reasons)
        return
    assert s.peak_qps == max(passing) == passed
    for p in s.points:
        if p["qps"] > s.peak_qps:  # nothing above the peak passed
            assert not p["valid"] and p["invalid_reasons"], p
    assert s.valid and s.requested_qps == s.peak_qps == s.scenario["qps"]
    best = next(p for p in s.points if p["qps"] == s.peak_qps)
    assert s.latency_ms.p99 == best["latency_ms"]["p99"] <= spec.latency_bound_ms
    for p in s.points:  # every trial stored with its own latencies
        stored = rows(noop_stack.settings, p["evaluation_id"])
        assert len(stored) == len(schedule.poisson(p["qps"], duration_s=2.0, seed=0))
        assert p["latency_ms"]["p99"] is not None


def test_a_peak_search_stopped_by_its_floor_says_how_to_go_lower(noop_stack: Stack) -> None:
    """A bound no rate meets (1 µs, below a trip over the bus): the first trial fails,
    halving would go below the rate at which a trial has the queries it needs, and the
    search ends saying so and what would let it go lower."""
    spec = ScenarioSpec(
        name="peak", qps=400, duration_s=2.0, latency_bound_ms=0.001, peak_trials=5, **LOOSE
    )
    floor = peak_floor_qps(spec, ValidityPolicy())
    assert 200 < floor < 400
    s = run(noop_stack.settings, spec)
    assert [p["qps"] for p in s.points] == [400] and not s.valid and s.peak_qps is None
    (why,) = [r for r in s.invalid_reasons if r.startswith("peak search: no rate tried")]
    assert f"it went no lower: below {floor:.1f} QPS a 2 s trial has fewer than" in why, why
    assert "a longer --duration lets it" in why


def test_a_peak_search_that_finds_no_rate_names_why_its_lowest_failed(
    noop_stack: Stack,
) -> None:
    """A bound no run meets: the evaluation shows the lowest rate tried, with its own
    reasons (here its latency), each given once, then that no rate passed."""
    spec = ScenarioSpec(name="peak", duration_s=1.0, latency_bound_ms=1e-6, peak_trials=3, **LOOSE)
    s = run(noop_stack.settings, spec)
    assert not s.valid and s.peak_qps is None
    (search,) = [r for r in s.invalid_reasons if r.startswith("peak search:")]
    lowest = min(s.points, key=lambda p: p["qps"])
    assert f"the lowest tried, {lowest['qps']:.1f} QPS, is the run shown" in search, search
    assert s.requested_qps == lowest["qps"]
    assert list(s.invalid_reasons) == [*lowest["invalid_reasons"], search]
    assert any("p99 latency" in r for r in lowest["invalid_reasons"])


def test_a_peak_search_no_rate_can_make_valid_fails_at_intake(noop_stack: Stack) -> None:
    """Submitted without the CLI (which refuses it first), the server refuses it
    before preparing an agent: a typed ConfigError naming the field, no trial run."""
    spec = ScenarioSpec(name="peak", duration_s=1.0, latency_bound_ms=20, peak_trials=3)
    began = time.monotonic()
    with pytest.raises(ConfigError, match="minimum run length of 10 s") as err:
        run(noop_stack.settings, spec)
    assert err.value.fields.get("field") == "duration_s"
    assert time.monotonic() - began < 5  # not one 1 s trial per rate


def test_a_cancelled_run_over_several_load_generators_stops_at_once(noop_stack: Stack) -> None:
    """A cancel reaches the load-generator processes: the run ends within seconds, not
    after its 60 s schedule, and keeps the rows of what the processes had issued, as a
    run on one load generator does."""
    spec = ScenarioSpec(name="online", qps=100, duration_s=60, seed=11, loadgens=2, **LOOSE)
    job = JobRequest(model="noop", framework="noop", scenario=spec, trace_level="none")
    cancelled: list[float] = []

    def seen(event: JobEvent) -> None:
        if event.event == "progress" and event.queries_done > 0 and not cancelled:
            cancelled.append(time.monotonic())
            threading.Thread(
                target=lambda: anyio.run(
                    lambda: cancel_job(noop_stack.settings, job.job_id, timeout=30),
                    backend="asyncio",
                )
            ).start()

    s = anyio.run(
        lambda: submit(noop_stack.settings, job, on_event=seen, timeout=180), backend="asyncio"
    )
    assert s.status == "cancelled" and cancelled
    assert time.monotonic() - cancelled[0] < 30, "the processes ran their schedule out"
    assert s.queries > 0 and stored_count(noop_stack.settings, s.evaluation_id) == s.queries
    sent = s.queries - s.not_issued
    answered = sent - s.lost
    assert answered > 0, s
    assert f"{answered} of {sent} issued queries answered" in s.invalid_reasons[0], s
    # both processes' slices are in the rows: queries dealt round-robin, i % 2
    indices = rows(noop_stack.settings, s.evaluation_id)[:, 0].tolist()
    assert indices == list(range(s.queries)), indices[:20]


def test_distributed_load_merges_one_global_schedule(noop_stack: Stack) -> None:
    spec = ScenarioSpec(name="online", qps=300, duration_s=2.5, seed=11, loadgens=2, **LOOSE)
    job = JobRequest(model="noop", framework="noop", scenario=spec, trace_level="none")
    progress: list[int] = []

    def seen(event: JobEvent) -> None:
        if event.event == "progress":
            progress.append(event.queries_done)

    s = anyio.run(
        lambda: submit(noop_stack.settings, job, on_event=seen, timeout=180), backend="asyncio"
    )
    whole = schedule.poisson(300, duration_s=2.5, seed=11)
    assert s.loadgens == 2 and s.queries == len(whole) and s.errors == 0, s.invalid_reasons
    assert "load generated in the server, by 2 processes" in format_summary(s)
    # the children's counts, summed while they run
    assert progress == sorted(progress) and 0 < max(progress) <= len(whole), progress
    assert any(0 < p < len(whole) for p in progress), progress
    got = rows(noop_stack.settings, s.evaluation_id)
    assert (got[:, 0] == np.arange(len(whole))).all()
    assert (got[:, 1] == whole.offsets_ns).all()
    assert (got[:, 2] >= got[:, 1]).all() and (got[:, 3] > 0).all()


def _stall(pid: int, after_s: float, for_s: float) -> float:
    time.sleep(after_s)
    os.kill(pid, signal.SIGSTOP)
    time.sleep(for_s)
    os.kill(pid, signal.SIGCONT)
    return for_s


def _run_with_stall(
    stack: Stack, spec: ScenarioSpec, target: str, stall_s: float
) -> EvaluationSummary:
    """Run ``spec`` and stop process ``target`` for ``stall_s`` once the run is going."""
    pid = stack.children[target].pid
    job = JobRequest(model="noop", framework="noop", scenario=spec, trace_level="none")

    async def go() -> EvaluationSummary:
        progressing = anyio.Event()

        def seen(event: JobEvent) -> None:
            if event.event == "progress":
                progressing.set()

        out: list[EvaluationSummary] = []
        async with anyio.create_task_group() as tg:

            async def job_task() -> None:
                out.append(await submit(stack.settings, job, on_event=seen, timeout=120))

            tg.start_soon(job_task)
            await progressing.wait()
            await anyio.to_thread.run_sync(_stall, pid, 0.2, stall_s)
        return out[0]

    return anyio.run(go, backend="asyncio")


def test_stalled_agent_makes_latency_grow_from_the_schedule(noop_stack: Stack) -> None:
    """Coordinated omission: an open loop keeps issuing on time while the agent stalls."""
    spec = ScenarioSpec(name="online", qps=200, duration_s=3.0, seed=5, **LOOSE)
    s = _run_with_stall(noop_stack, spec, "agent:noop", 0.6)
    assert s.errors == 0 and s.not_issued == 0
    got = rows(noop_stack.settings, s.evaluation_id)
    sched, issued, done = got[:, 1], got[:, 2], got[:, 3]
    lat = (done - sched) / 1e9
    first = int(np.argmax(lat))  # the first query of the stall waits longest
    assert lat[first] > 0.4
    # Every query scheduled in the next 0.3 s was issued on time and waited for the
    # agent to resume, completing with the first one: its latency is counted from its
    # scheduled time, so it falls as the scheduled time rises.
    window = (sched >= sched[first]) & (sched < sched[first] + 300_000_000)
    assert window.sum() >= 20  # all of them, not just one
    assert np.median((issued - sched)[window]) < 50e6
    assert (done[window] >= done[first] - 50_000_000).all()
    assert (lat[window] > lat[first] - 0.35).all()
    # The REPORTED latencies are these, from the scheduled time: the stall is in them.
    assert_reported_from_schedule(s, got)
    assert s.latency_ms.max is not None and s.latency_ms.max > 400
    assert s.latency_ms.p99 is not None and s.latency_ms.p99 > 300  # ~20% of queries waited

    # The same stall in a closed loop hides itself: one query sees it.
    closed = _run_with_stall(
        noop_stack, ScenarioSpec(name="single-stream", duration_s=2.0, **LOOSE), "agent:noop", 0.6
    )
    got = rows(noop_stack.settings, closed.evaluation_id)
    slow = ((got[:, 3] - got[:, 1]) / 1e9 > 0.25).sum()
    assert 1 <= slow <= 2  # the one in flight (a busy machine may add one more)
    assert_reported_from_schedule(closed, got)
    assert closed.latency_ms.max is not None and closed.latency_ms.max > 400


def assert_reported_from_schedule(s: EvaluationSummary, got: np.ndarray) -> None:
    """The summary's latency figures are those of completed - scheduled of the stored
    queries (mlscope.stats' percentile), not of completed - issued."""
    assert s.errors == 0 and s.not_issued == 0  # every stored query answered
    lat_ms = (got[:, 3] - got[:, 1]) / 1e6
    assert s.latency_ms.max == pytest.approx(lat_ms.max())
    for q, reported in ((50, s.latency_ms.p50), (90, s.latency_ms.p90), (99, s.latency_ms.p99)):
        assert reported == pytest.approx(percentile(lat_ms, q)), q


def test_stalled_load_generator_is_too_late(noop_stack: Stack) -> None:
    """A pacer that could not run issues late: the verdict says so."""
    spec = ScenarioSpec(
        name="online", qps=200, duration_s=2.5, seed=6, min_duration_s=0, min_queries=1
    )
    s = _run_with_stall(noop_stack, spec, "server", 0.4)
    assert not s.valid
    assert any("issue lag" in r for r in s.invalid_reasons), s.invalid_reasons
    assert s.issue_lag_us["max"] is not None and s.issue_lag_us["max"] > 100_000
    got = rows(noop_stack.settings, s.evaluation_id)
    assert (got[:, 2] >= got[:, 1]).all()  # late, never early
    # No coordinated omission in what is reported: a query issued late counts its lag.
    assert_reported_from_schedule(s, got)
    assert s.latency_ms.max is not None and s.latency_ms.max * 1e3 >= s.issue_lag_us["max"]
    from_issue_p99 = percentile((got[:, 3] - got[:, 2]) / 1e6, 99)
    assert s.latency_ms.p99 is not None and from_issue_p99 is not None
    assert s.latency_ms.p99 > from_issue_p99 + 100  # the stall would hide in issue-based times


def test_scenario_files_submit(noop_stack: Stack, tmp_path: Path) -> None:
    """--scenario-file with flags overriding it; the replay file is read by the submitter."""
    out = subprocess.run(
        [
            python(),
            "-m",
            "cli.submit",
            "noop",
            "--framework",
            "noop",
            "--scenario-file",
            str(REPO / "manifests" / "scenarios" / "replay.yaml"),
            "--max-queries",
            "40",
            "--min-duration",
            "0",
            "--min-queries",
            "1",
            "--json",
        ],
        env=child_env(noop_stack.settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["scenario"]["name"] == "replay" and doc["queries"] == 40


def test_an_oversized_job_is_refused_at_once_with_the_reason(settings: Settings) -> None:
    """A replay schedule too large for one message names itself; it is not reported as
    a missing server after retries, and a too-large message is never retried."""
    job = JobRequest(
        model="noop",
        framework="noop",
        scenario=ScenarioSpec(name="replay", arrivals_s=(0.001,) * 200_000),
    )

    async def main() -> None:
        async with provisioned(settings, name="test") as bus:
            t0 = time.monotonic()
            with pytest.raises(BusError, match="over the server's max payload"):
                await busmod.publish_persistent(
                    bus, names.JOBS_SUBJECT, b"x" * (2 << 20), msg_id="big"
                )
            assert time.monotonic() - t0 < 1.0  # no retries with back-off
        with pytest.raises(ConfigError, match="200000 arrivals"):
            await submit(settings, job, timeout=5)

    anyio.run(main, backend="asyncio")
