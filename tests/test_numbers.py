"""Known answers for the reported numbers, without a stack: overload and backlog, the
outcome of every query, warm-up, duration on un-rounded times, the issue lag's parts,
run-level comparison and the load generator's cost."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import numpy as np
import pandas as pd
import pytest

from analysis.compare import mismatches
from analysis.difference import SLOWER, run_level_difference
from analysis.figures import max_throughput, speedup_heatmap
from broker import coldstart
from broker.scenario_kinds import cold_start
from broker.scenarios import build_schedule
from broker.summary import LoadgenCost, figures, judge
from cli.submit_repeat import measured_runs, run_level
from mlscope.answering import backlog_s, completion_rates
from mlscope.contracts import EvaluationSummary, LatencyStats, PrepareReply, ScenarioSpec
from mlscope.outcomes import Outcome, classify, count
from mlscope.record import RunRecord
from mlscope.scenario_kinds.cold_start import COLD_START
from mlscope.stats import mean_ci
from mlscope.validity import ValidityPolicy

MS = 1_000_000


def queue(offsets: np.ndarray, service_s: float) -> np.ndarray:
    """Completion times of one FIFO server taking ``service_s`` per query."""
    done = np.zeros_like(offsets)
    free = 0
    for i, t in enumerate(offsets):
        free = max(int(t), free) + int(service_s * 1e9)
        done[i] = free
    return done


def open_record(spec: ScenarioSpec, service_s: float) -> RunRecord:
    sched = build_schedule(spec)[0].offsets_ns
    rec = RunRecord(n=len(sched), batch_size=1, t0_ns=10**12)
    rec.scheduled[:] = sched
    rec.paced[:] = sched + 1_000
    rec.issued[:] = sched + 2_000
    rec.completed[:] = queue(sched + 2_000, service_s)
    rec.ok[:] = 1
    return rec


def verdict(rec: RunRecord, spec: ScenarioSpec) -> tuple[str, ...]:
    return judge(
        rec, spec, ValidityPolicy(), window_s=spec.duration_s, requested_rate=spec.qps, poisson=True
    ).reasons


def test_an_overloaded_run_is_invalid_with_the_overload_reason() -> None:
    """75 QPS offered to a system that serves 61.6/s: it falls behind by ~13.6/s."""
    spec = ScenarioSpec(name="online", qps=75, duration_s=10, seed=3)
    rec = open_record(spec, 1 / 61.6)
    reasons = verdict(rec, spec)
    over = [r for r in reasons if r.startswith("overloaded")]
    assert len(over) == 1, reasons
    offered, answered = completion_rates(rec.scheduled, rec.completed, 10.0)
    assert answered == pytest.approx(61.6, abs=1.0)  # the service rate, not the issue rate
    assert offered == pytest.approx(75, rel=0.15)
    assert f"completed {answered:.1f}/s of {offered:.1f}/s offered" in over[0]
    f = figures(rec, has_labels=False, window_s=10.0)
    # Backlog at the window's end: ~(75 - 61.6) x 10 s of queries, at 75/s.
    assert f.backlog_s == pytest.approx(backlog_s(rec.scheduled, rec.completed, 10.0))
    assert 1.0 < (f.backlog_s or 0) < 3.0
    assert not any(r.startswith("stopped answering") for r in reasons)  # it kept answering
    assert f.completed_qps is not None and f.achieved_qps is not None
    assert f.completed_qps < 0.9 * f.achieved_qps  # issued and completed told apart


def stop_answering(rec: RunRecord, at_s: float) -> int:
    """No reply after ``at_s``: every query not answered by then is lost (the agent was
    killed, paused or cut off); the queries sent after its last reply."""
    gone = rec.completed > int(at_s * 1e9)
    rec.completed[gone] = 0
    rec.ok[gone] = 0
    return int(np.count_nonzero(rec.issued > rec.completed.max()))


def test_an_agent_that_stopped_answering_is_not_called_overloaded() -> None:
    """A system that kept up until it went silent at t=6 s: its queries sent after its
    last answer are lost, not a backlog; the reason says when it stopped and how many
    got no answer, and the backlog is that of the answering part of the run."""
    spec = ScenarioSpec(name="online", qps=75, duration_s=10, seed=3)
    rec = open_record(spec, 1 / 400)
    after = stop_answering(rec, 6.0)
    last = rec.completed.max() / 1e9
    reasons = verdict(rec, spec)
    assert not any(r.startswith("overloaded") for r in reasons), reasons
    stopped = [r for r in reasons if r.startswith("stopped answering")]
    assert stopped == [
        f"stopped answering at t={last:.3f} s (its last answer): {after} queries sent after "
        "it got no answer (the agent or its link went silent: lost, not a backlog)"
    ], reasons
    assert 5.9 < last <= 6.0 and after > 200
    assert any(r.startswith(f"{count(rec.outcomes())['lost']} queries lost") for r in reasons)
    f = figures(rec, has_labels=False, window_s=10.0)
    assert f.backlog_s is not None and f.backlog_s < 0.05


def test_an_overloaded_agent_that_then_stopped_answering_is_both() -> None:
    """Behind by ~13.6/s until it went silent at t=8 s: overloaded up to its last
    answer, and stopped answering after it."""
    spec = ScenarioSpec(name="online", qps=75, duration_s=10, seed=3)
    rec = open_record(spec, 1 / 61.6)
    stop_answering(rec, 8.0)
    reasons = verdict(rec, spec)
    assert any(r.startswith("stopped answering at t=") for r in reasons), reasons
    over = [r for r in reasons if r.startswith("overloaded")]
    assert len(over) == 1 and "(up to its last answer)" in over[0], reasons


def test_an_agent_that_answered_nothing_stopped_answering() -> None:
    spec = ScenarioSpec(name="online", qps=75, duration_s=10, seed=3)
    rec = open_record(spec, 1 / 400)
    stop_answering(rec, 0.0)
    reasons = verdict(rec, spec)
    assert f"stopped answering: no query was answered; {rec.n} sent got no answer" in " ".join(
        reasons
    )
    assert not any(r.startswith("overloaded") for r in reasons), reasons


def test_a_system_that_keeps_up_is_not_overloaded() -> None:
    spec = ScenarioSpec(name="online", qps=75, duration_s=10, seed=3)
    rec = open_record(spec, 1 / 400)  # 2.5 ms per query: utilization ~19 %
    assert not any(r.startswith("overloaded") for r in verdict(rec, spec))
    f = figures(rec, has_labels=False, window_s=10.0)
    assert f.backlog_s is not None and f.backlog_s < 0.05


def test_a_system_that_answers_every_query_with_an_error_is_not_overloaded() -> None:
    """Failed answers are answers: a model that fails every query at once keeps up with
    its arrivals (INVALID for its failures, with no overload reason and no backlog); a
    refusal is not an answer (the query never ran), so refusals still show a backlog."""
    spec = ScenarioSpec(name="online", qps=75, duration_s=10, seed=3)
    rec = open_record(spec, 1 / 1000)
    rec.ok[:] = 0
    reasons = verdict(rec, spec)
    assert any("failed" in r for r in reasons), reasons
    assert not any(r.startswith("overloaded") for r in reasons), reasons
    f = figures(rec, has_labels=False, window_s=10.0)
    assert f.backlog_s is not None and f.backlog_s < 0.05
    rec.refused[:] = 1
    refusing = verdict(rec, spec)
    assert any(r.startswith("overloaded") for r in refusing)
    assert not any(r.startswith("stopped answering") for r in refusing)  # refusals are replies
    refused = figures(rec, has_labels=False, window_s=10.0)
    assert refused.backlog_s is not None and refused.backlog_s > 9


def test_a_run_of_warm_up_queries_only_says_so() -> None:
    spec = ScenarioSpec(name="online", qps=75, duration_s=10, seed=3)
    rec = open_record(spec, 1 / 400)
    rec.warmup = rec.n
    reasons = verdict(rec, spec)
    assert f"no query completed after the {rec.n} warm-up queries" in reasons, reasons


def test_each_query_has_one_outcome() -> None:
    issued = [5, 5, 5, 5, 0, 0]
    completed = [9, 9, 9, 0, 0, 7]  # the last: a closed loop's first query at offset 0
    ok = [1, 0, 0, 0, 0, 1]
    refused = [0, 0, 1, 0, 0, 0]
    got = classify(issued=issued, completed=completed, ok=ok, refused=refused)
    assert list(got) == [
        Outcome.OK,
        Outcome.FAILED,
        Outcome.REFUSED,
        Outcome.LOST,
        Outcome.NOT_ISSUED,
        Outcome.OK,
    ]
    assert count(got) == {
        "ok": 2,
        "failed": 1,
        "refused": 1,
        "lost": 1,
        "not_issued": 1,
        "errors": 3,
    }
    # Without refusals known (old rows), a refusal is a failure.
    assert count(classify(issued=issued, completed=completed, ok=ok))["failed"] == 2


def test_refused_queries_are_named_and_not_issued_are_not_errors() -> None:
    spec = ScenarioSpec(name="online", qps=200, duration_s=10, seed=1)
    rec = open_record(spec, 0.001)
    rec.ok[:30] = 0
    rec.refused[:30] = 1
    rec.issued[40:50] = 0
    rec.completed[40:50] = 0
    rec.ok[40:50] = 0
    f = figures(rec, has_labels=False)
    assert (f.outcomes["refused"], f.errors, f.not_issued) == (30, 30, 10)
    reasons = verdict(rec, spec)
    assert any(r.startswith("30 queries refused by the agent (overloaded)") for r in reasons)
    assert any(r.startswith("10 queries not issued") for r in reasons)
    assert not any("failed" in r for r in reasons)


def test_warmup_queries_are_left_out_of_every_figure() -> None:
    spec = ScenarioSpec(name="online", qps=200, duration_s=10, seed=1)
    rec = open_record(spec, 0.0005)
    rec.completed[:20] = rec.scheduled[:20] + 400 * MS  # a slow start
    rec.ok[5] = 0  # a warm-up failure is not an error of the run
    cold = figures(rec, has_labels=False)
    rec.warmup = 20
    warm = figures(rec, has_labels=False)
    assert cold.latency_ms.max is not None and cold.latency_ms.max >= 400
    assert warm.latency_ms.max is not None and warm.latency_ms.max < 5
    assert (warm.warmup_queries, warm.errors, cold.errors) == (20, 0, 1)
    assert list(np.flatnonzero(~rec.measured())) == list(range(20))
    # The load itself is judged whole: warm-up does not make the rate look short.
    assert warm.scheduled_qps == cold.scheduled_qps
    assert not any("q/s" in r for r in verdict(rec, spec)), verdict(rec, spec)


def test_duration_is_judged_unrounded_and_said_so() -> None:
    spec = ScenarioSpec(name="single-stream", duration_s=10)
    rec = open_record(ScenarioSpec(name="constant", qps=100, duration_s=10), 0.001)
    reasons = judge(
        rec,
        spec,
        ValidityPolicy(),
        window_s=9.9996,
        requested_rate=None,
        poisson=False,
        open_loop=False,
    ).reasons
    assert "ran 9.9996 s < minimum 10 s" in reasons


def test_closed_loop_record_grows_instead_of_stopping() -> None:
    rec = RunRecord(n=2, batch_size=1)
    rec.scheduled[:] = [1, 2]
    rec.prediction[:] = [7, 8]
    rec.grow()
    assert rec.n == 4 and list(rec.scheduled) == [1, 2, 0, 0]
    assert list(rec.prediction) == [7, 8, -1, -1]


def test_issue_lag_has_its_pacer_and_loop_parts() -> None:
    spec = ScenarioSpec(name="constant", qps=100, duration_s=2)
    rec = open_record(spec, 0.001)
    rec.paced[:] = rec.scheduled + 10_000  # 10 µs in the pacer
    rec.issued[:] = rec.paced + 200_000  # 200 µs waiting for the event loop
    f = figures(rec, has_labels=False)
    assert f.issue_lag_split_us["pacer"]["p99"] == pytest.approx(10)
    assert f.issue_lag_split_us["loop"]["p99"] == pytest.approx(200)
    assert f.issue_lag_us["p99"] == pytest.approx(210)


def test_loadgen_cpu_per_query_counts_the_warm_up_queries_it_sent() -> None:
    """The load's CPU time covers every query it sent, warm-up included: per query it is
    that time over all of them, and busy cores are that rate times the issue rate."""
    spec = ScenarioSpec(name="constant", qps=1000, duration_s=2)
    rec = open_record(spec, 0.0001)
    rec.warmup = rec.n // 2
    rec.cpu_s = 0.51e-3 * rec.n  # 0.51 ms of CPU per query sent
    f = figures(rec, has_labels=False)
    assert f.loadgen_cpu_us_per_query == pytest.approx(510)
    facts = LoadgenCost(agent_host="box", host="box", cores=2).facts(f)
    assert facts["busy_cores"] == pytest.approx(0.51, rel=0.02)


def test_loadgen_cost_is_recorded_and_warned_on_a_shared_host() -> None:
    spec = ScenarioSpec(name="constant", qps=1000, duration_s=2)
    rec = open_record(spec, 0.0001)
    rec.cpu_s = 0.51e-3 * rec.n  # 0.51 ms of CPU per query
    f = figures(rec, has_labels=False)
    assert f.loadgen_cpu_us_per_query == pytest.approx(510)
    shared = LoadgenCost(agent_host="box", host="box", cores=2)
    facts = shared.facts(f)
    assert facts["shared_host"] and facts["busy_cores"] == pytest.approx(0.51, rel=0.02)
    assert any("shared the agent's host" in w for w in shared.warnings(f, parallel=False))
    apart = LoadgenCost(agent_host="edge", host="box", cores=2)
    assert apart.warnings(f, parallel=False) == ()
    assert any("--parallel" in w for w in apart.warnings(f, parallel=True))
    # Load-generator services: their hosts, not the server's, and whether one is the agent's
    server = LoadgenCost(agent_host="edge", host="server-box", cores=8)
    assert server.served_by(()) is server
    services = [{"host": "lg-2", "loadgen_id": "b"}, {"host": "edge", "loadgen_id": "a"}]
    served = server.served_by(services).facts(f)
    assert (served["host"], served["host_cores"], served["loadgens"]) == ("edge,lg-2", None, 2)
    assert served["shared_host"]  # one slice ran on the agent's host
    away = server.served_by([{"host": "lg-2"}])
    assert not away.shared_host and away.warnings(f, parallel=False) == ()


def test_an_agents_local_run_reports_its_load_generator_and_its_process_apart() -> None:
    """Placement agent: the load generator's own CPU time (``cpu_s``, per query as in
    server placement) beside the agent process's, and a warning that says what the
    load generator took from the model rather than that it shared a host by mistake."""
    spec = ScenarioSpec(name="constant", qps=1000, duration_s=2)
    rec = open_record(spec, 0.0001)
    rec.cpu_s, rec.process_cpu_s = 0.2e-3 * rec.n, 1.5e-3 * rec.n
    f = figures(rec, has_labels=False)
    cost = LoadgenCost(agent_host="box", placement="agent", host="box", cores=2)
    facts = cost.facts(f)
    assert facts["placement"] == "agent" and facts["shared_host"]
    assert facts["cpu_s"] == pytest.approx(rec.cpu_s)
    assert facts["cpu_us_per_query"] == pytest.approx(200)
    assert facts["process_cpu_s"] == pytest.approx(rec.process_cpu_s)
    assert facts["process_cpu_us_per_query"] == pytest.approx(1500)
    (warning,) = cost.warnings(f, parallel=False)
    assert warning.startswith("the load was generated in the agent's process"), warning
    # A closed loop's load is issued on the model's thread: only the process's time.
    rec.cpu_s = 0.0
    facts = cost.facts(figures(rec, has_labels=False))
    assert facts["cpu_s"] is None and facts["cpu_us_per_query"] is None
    assert facts["process_cpu_us_per_query"] == pytest.approx(1500)
    assert cost.warnings(figures(rec, has_labels=False), parallel=False) == ()
    # A server-placed run has no process figure of an agent.
    rec.cpu_s, rec.process_cpu_s = 0.2e-3 * rec.n, None
    served = LoadgenCost(agent_host="box", host="box", cores=2).facts(
        figures(rec, has_labels=False)
    )
    assert served["placement"] == "server" and "process_cpu_s" not in served


def test_an_identical_rerun_is_not_called_different_at_run_level() -> None:
    """Run-to-run noise (±4 % between runs) is what a single-run bootstrap misses; over
    repeats the interval holds it and the verdict is no change."""
    a = [10.0, 10.4, 9.7, 10.2, 9.9]
    b = [10.3, 9.6, 10.1, 9.8, 10.4]
    d = run_level_difference(a, b, statistic="median")
    assert d.verdict == "no significant change" and d.ci_low < 0 < d.ci_high
    slower = run_level_difference(a, [x * 1.3 for x in b], statistic="median")
    assert slower.verdict == SLOWER
    with pytest.raises(ValueError):
        run_level_difference([1.0], [1.0, 2.0], statistic="median")


def test_mean_ci_matches_student_t() -> None:
    mean, lo, hi = mean_ci([1.0, 2.0, 3.0, 4.0])
    # t(0.975, 3) = 3.1824, sd = 1.2910, n = 4
    assert mean == 2.5 and hi is not None and lo is not None
    assert hi - mean == pytest.approx(3.182446 * 1.290994 / 2, rel=1e-5)
    assert mean_ci([5.0]) == (5.0, None, None)


def test_comparisons_name_what_differs() -> None:
    rows = pd.DataFrame(
        {
            "model": ["m", "m"],
            "scenario": ["online", "online"],
            "requested_qps": [100.0, 200.0],
            "batch_size": [1, 1],
            "parallel": [False, True],
            "placement": ["server", "agent"],
            "preprocess": ["timed", "ahead"],
        }
    )
    why = mismatches(rows)
    assert any("requested qps (100.0, 200.0)" in w for w in why)
    # the model served over the bus and the model itself are different measurements
    assert any("placement (server, agent)" in w for w in why)
    # pre-processing inside each query's time or before the clock: not the same latency
    assert any("preprocess (timed, ahead)" in w for w in why)
    assert any("--parallel" in w for w in why)
    assert mismatches(rows.iloc[[0, 0]]) == []
    # the baseline's values first, whatever order the rows were read in
    rows["evaluation_id"] = ["ev-old", "ev-new"]
    why = mismatches(rows, "ev-new")
    assert any("requested qps (200.0, 100.0)" in w for w in why), why
    assert any("placement (agent, server)" in w for w in why), why


def test_sweep_parents_are_not_counted_as_a_batch_size() -> None:
    """The parent of a sweep carries the best run's figures; counting it as batch 1
    gave two points at batch 1 and "optimal batch 1"."""
    base = {
        "model": "m",
        "model_version": "1",
        "framework": "f",
        "framework_version": "1",
        "system": "s",
        "scenario": "batched",
        "valid": True,
    }
    summ = pd.DataFrame(
        [
            {
                **base,
                "evaluation_id": "p",
                "batch_size": 1,
                "throughput_ips": 800.0,
                "role": "sweep",
            },
            {
                **base,
                "evaluation_id": "p-0",
                "batch_size": 1,
                "throughput_ips": 100.0,
                "role": "run",
            },
            {
                **base,
                "evaluation_id": "p-1",
                "batch_size": 8,
                "throughput_ips": 800.0,
                "role": "run",
            },
        ]
    )
    best = max_throughput(summ).iloc[0]
    assert best["optimal_batch_size"] == 8 and best["batch_sizes"] == [1, 8]
    assert speedup_heatmap(summ).loc["m/f@s", 8] == pytest.approx(8.0)


def _summary(latency: LatencyStats, **fields: Any) -> EvaluationSummary:
    """A completed run's summary with ``latency`` and the ``fields`` given."""
    base: dict[str, Any] = {
        "evaluation_id": "e",
        "job_id": "j",
        "status": "completed",
        "valid": True,
        "model": {"name": "m", "version": "1"},
        "framework": {"name": "f", "version": "1"},
        "agent_id": "a",
        "scenario": {"name": "constant", "batch_size": 1, "seed": 0},
        "trace_level": "none",
        "queries": 1,
        "samples": 1,
        "errors": 0,
        "not_issued": 0,
        "duration_s": 1.0,
        "requested_qps": None,
        "achieved_qps": None,
        "issue_lag_us": {},
        "throughput_ips": None,
        "started_at": 0.0,
        "finished_at": 1.0,
    }
    return EvaluationSummary(**{**base, **fields, "latency_ms": latency})


def test_run_level_summary_of_repeats() -> None:
    def one(p50: float, *, valid: bool = True, status: str = "completed") -> EvaluationSummary:
        lat = LatencyStats(trimmed_mean=p50, p50=p50, p90=p50, p99=p50, max=p50)
        return _summary(lat, evaluation_id=f"e-{p50:g}", status=status, valid=valid)

    got = run_level([one(1.0), one(2.0), one(3.0), one(4.0)])
    assert got["p50_ms"]["mean"] == 2.5
    assert got["p50_ms"]["ci_low"] == pytest.approx(mean_ci([1, 2, 3, 4])[1])
    assert got["throughput_ips"]["mean"] is None
    # Only completed VALID runs count: an overloaded run's p50 describes another load.
    runs = [one(1.0), one(90.0, valid=False), one(3.0), one(5.0, status="cancelled")]
    kept = measured_runs(runs)
    assert [s.evaluation_id for s in kept] == ["e-1", "e-3"]
    assert run_level(kept)["p50_ms"]["mean"] == 2.0


def test_a_figure_that_is_not_zero_is_never_printed_as_zero() -> None:
    """A rate of one query in 1,000 s, a sub-microsecond latency: printed with the
    decimals of their line they read as 0, a figure the run did not have."""
    from cli.summary_text import format_summary

    lat = LatencyStats(trimmed_mean=0.0004, p50=0.0004, p90=0.0, p99=1.5, max=2.0)
    text = format_summary(
        _summary(lat, valid=False, duration_s=1000.0, requested_qps=0.001, achieved_qps=0.001)
    )
    assert "requested 0.001 / " in text and "issued 0.001 / " in text, text
    assert "p50 0.0004  p90 0.000  p99 1.500" in text, text  # a true zero stays one


def test_only_models_scored_by_top_k_get_labels() -> None:
    """A detector scored by AUC, or a model without a data set, shows no top-1 (it was a
    meaningless 0)."""
    from mlscope.samples import scored as _scored

    def feeders() -> tuple[Any, Any]:
        return (lambda i: np.zeros(1)), (lambda i: np.zeros(1))

    def manifest(metric: str | None) -> Any:
        return SimpleNamespace(dataset=None if metric is None else SimpleNamespace(metric=metric))

    assert _scored(feeders(), manifest("top1"))[1] is not None
    assert _scored(feeders(), manifest("top5"))[1] is not None
    assert _scored(feeders(), manifest("binary_auc"))[1] is None
    assert _scored(feeders(), manifest(None))[1] is None
    rec = open_record(ScenarioSpec(name="constant", qps=100, duration_s=1), 0.001)
    assert figures(rec, has_labels=False).top1 is None


def test_run_level_interval_of_a_positive_figure_is_never_negative() -> None:
    """Two noisy runs (p99 5 and 20 ms) give a Student's t half-width of 95 ms: the
    interval of a latency or a throughput is cut at 0 instead of reaching -83 ms."""

    def one(p99: float) -> Any:
        lat = SimpleNamespace(p50=p99 / 4, p99=p99)
        return SimpleNamespace(latency_ms=lat, throughput_ips=1000.0 / p99)

    got = run_level([one(5.0), one(20.0)])
    for name in ("p50_ms", "p99_ms", "throughput_ips"):
        low, mean, high = got[name]["ci_low"], got[name]["mean"], got[name]["ci_high"]
        assert low is not None and mean is not None and high is not None
        assert 0.0 <= low <= mean <= high
    assert got["p99_ms"]["ci_low"] == 0.0
    assert got["p99_ms"]["ci_high"] == pytest.approx(mean_ci([5.0, 20.0])[2])
    bare_low = mean_ci([5.0, 20.0])[1]
    assert bare_low is not None and bare_low < 0  # the bare t interval, unbounded
    assert mean_ci([5.0, 20.0], floor=0.0)[1] == 0.0
    assert mean_ci([1.0, 2.0, 3.0, 4.0], floor=0.0) == mean_ci([1.0, 2.0, 3.0, 4.0])


def test_cold_start_throughput_leaves_out_the_reloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two repetitions of 10 warm queries, 1 ms apart, with a 1 s reload between them:
    20 samples in 20 ms of warm inference are 1000 inputs/s, not 20 / 1.01 s."""

    async def prepared(*_a: Any, **_k: Any) -> PrepareReply:
        return PrepareReply(cold=True, load_ns=5 * MS, first_inference_ns=MS, t_agent=0)

    def record(t0: int) -> RunRecord:
        rec = RunRecord(n=10, batch_size=1, t0_ns=t0)
        starts = np.arange(10, dtype=np.int64) * MS + 1
        rec.scheduled[:] = rec.paced[:] = rec.issued[:] = starts
        rec.agent_received[:] = rec.predict_start[:] = starts + 100
        rec.predict_end[:] = rec.agent_replied[:] = starts + MS // 2
        rec.completed[:] = starts + MS - 1
        rec.ok[:] = 1
        return rec

    records = iter([record(10**12), record(10**12 + 10**9)])

    class FakeDriver:
        async def run(self) -> RunRecord:
            return next(records)

    monkeypatch.setattr(coldstart, "request_model", prepared)
    monkeypatch.setattr(cold_start, "driver", lambda *_a, **_k: FakeDriver())
    ctx: Any = SimpleNamespace(
        bus=None, agent_id="a", prepare={}, feeders=lambda _b: (None, None), evaluation_id="ev-1"
    )
    spec = ScenarioSpec(name="cold-start", repetitions=2, warm_queries=10, batch_size=1)
    strategy = cold_start.ColdStart(COLD_START)
    out = anyio.run(strategy.execute, ctx, spec)
    assert out.main.record.n == 20 and out.main.verdict.valid
    assert out.main.figures.throughput_ips == pytest.approx(20 / 0.02, rel=1e-6)
    assert out.cold_start is not None
    assert out.cold_start["warm_throughput_ips"] == out.main.figures.throughput_ips
