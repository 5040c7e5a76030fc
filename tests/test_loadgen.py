"""Load-generator pieces without a stack: verdicts on raw records, the latency split,
the peak search's steps, scenario files, the merge of dealt slices, and the clock
offset's arguments."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import anyio
import numpy as np
import pytest

from broker.lgclock import estimate_offset
from broker.lgresults import merge_results
from broker.loadgen import running_p50_ms
from broker.scenario_kinds import get
from broker.scenario_kinds.peak import PEAK_PRECISION, next_rate, peak_floor_qps
from broker.scenarios import build_schedule, scenario_spec
from broker.summary import figures, judge, latency_split, policy_for
from mlscope import schedule
from mlscope.bus import Bus
from mlscope.contracts import MAX_QPS, ScenarioSpec
from mlscope.errors import ConfigError
from mlscope.record import ARRAYS, RunRecord
from mlscope.validity import ValidityPolicy, Verdict

REPO = Path(__file__).resolve().parent.parent
MS = 1_000_000


def record(
    offsets_ns: np.ndarray,
    *,
    lag_ns: np.ndarray | int = 2_000,
    latency_ns: np.ndarray | int = 2 * MS,
) -> RunRecord:
    """A run where every query was issued ``lag`` late and answered ``latency`` later."""
    rec = RunRecord(n=len(offsets_ns), batch_size=1, t0_ns=10**12)
    rec.scheduled[:] = offsets_ns
    rec.issued[:] = offsets_ns + lag_ns
    rec.completed[:] = offsets_ns + latency_ns
    rec.agent_received[:] = rec.issued + 300_000
    rec.predict_start[:] = rec.agent_received + 100_000
    rec.predict_end[:] = rec.predict_start + 500_000
    rec.agent_replied[:] = rec.predict_end + 50_000
    rec.ok[:] = 1
    rec.done = rec.n
    return rec


def verdict_of(rec: RunRecord, spec: ScenarioSpec, window: float | None = None) -> tuple[str, ...]:
    v = judge(
        rec,
        spec,
        ValidityPolicy(),
        window_s=window or spec.duration_s,
        requested_rate=spec.qps,
        poisson=True,
    )
    assert v.valid == (not v.reasons)
    return v.reasons


def test_a_good_run_is_valid() -> None:
    spec = ScenarioSpec(name="online", qps=200, duration_s=10, seed=1)
    sched, window = build_schedule(spec)
    assert verdict_of(record(sched.offsets_ns), spec, window) == ()


def test_too_short_too_few_too_late_and_early_are_invalid() -> None:
    spec = ScenarioSpec(name="online", qps=200, duration_s=10, seed=1)
    sched = build_schedule(spec)[0].offsets_ns
    (short,) = verdict_of(record(sched), spec, window=4.0)
    assert "ran 4 s < minimum 10 s" in short
    few = ScenarioSpec(name="online", qps=200, duration_s=10, seed=1, min_queries=5000)
    assert any("queries < minimum 5000" in r for r in verdict_of(record(sched), few))
    lag = np.where(np.arange(len(sched)) % 20 == 0, 3 * MS, 1_000)  # 5% issued 3 ms late
    late = verdict_of(record(sched, lag_ns=lag, latency_ns=lag + MS), spec)
    assert any("p99 issue lag 3000 µs > 500 µs" in r for r in late)
    early = record(sched)
    early.issued[7] = early.scheduled[7] - 10
    assert any("issued before their scheduled time" in r for r in verdict_of(early, spec))


def test_latency_bound_and_early_stopping() -> None:
    spec = ScenarioSpec(name="online", qps=200, duration_s=10, seed=1, latency_bound_ms=5)
    sched = build_schedule(spec)[0].offsets_ns
    assert verdict_of(record(sched, latency_ns=4 * MS), spec) == ()
    slow = np.where(np.arange(len(sched)) % 50 == 0, 9 * MS, 2 * MS)  # 2% over the bound
    assert any(
        "p99 latency 9 ms > bound 5 ms" in r
        for r in verdict_of(record(sched, latency_ns=slow), spec)
    )
    tiny = ScenarioSpec(name="online", qps=20, duration_s=10, seed=1, min_queries=1)
    assert any(
        r.startswith("early stopping")
        for r in verdict_of(record(build_schedule(tiny)[0].offsets_ns), tiny)
    )


def test_scenario_targets_follow_mlperf() -> None:
    """Throughput sweeps have no latency target; single-stream estimates p90."""
    closed = record(np.arange(1, 201, dtype=np.int64) * 50 * MS)  # 200 queries over 10 s

    def ten_s(spec: ScenarioSpec) -> Verdict:
        policy = get(spec.name).policy(ValidityPolicy())  # the scenario's own rules
        return judge(closed, spec, policy, window_s=10.0, requested_rate=None, poisson=False)

    online = ten_s(ScenarioSpec(name="online"))
    assert any(r.startswith("early stopping") for r in online.reasons)
    assert ten_s(ScenarioSpec(name="batched")).valid
    assert ten_s(ScenarioSpec(name="single-stream")).valid
    assert get("single-stream").policy(ValidityPolicy()).percentile == 90
    assert get("online").policy(ValidityPolicy()) == ValidityPolicy()


def test_failed_and_unanswered_queries_are_errors() -> None:
    spec = ScenarioSpec(name="online", qps=200, duration_s=10, seed=1)
    rec = record(build_schedule(spec)[0].offsets_ns)
    rec.completed[3] = 0
    rec.ok[3] = 0
    rec.errors[5] = "boom"
    rec.ok[5] = 0
    f = figures(rec, has_labels=False)
    assert f.errors == 2 and (f.outcomes["failed"], f.outcomes["lost"]) == (1, 1)
    reasons = verdict_of(rec, spec)
    assert any(r.startswith("1 queries failed") for r in reasons)
    assert any(r.startswith("1 queries lost") for r in reasons)


def test_policy_for_takes_the_scenario_s_rules() -> None:
    spec = ScenarioSpec(min_duration_s=2, min_queries=7, latency_bound_ms=3.5, max_issue_lag_us=900)
    pol = policy_for(spec, ValidityPolicy())
    assert (pol.min_duration_s, pol.min_queries, pol.latency_bound_ns, pol.max_issue_lag_us) == (
        2,
        7,
        3_500_000,
        900,
    )
    assert policy_for(ScenarioSpec(), ValidityPolicy()) == ValidityPolicy()


def test_latency_split_adds_up_and_transport_ignores_the_clock_offset() -> None:
    sched = schedule.constant(100, n=50).offsets_ns
    rec = record(sched, lag_ns=1_000, latency_ns=2 * MS)
    split = latency_split(rec)
    assert split["compute"]["p50"] == pytest.approx(0.5)
    assert split["queueing"]["p50"] == pytest.approx(0.1)
    assert split["issue_lag"]["p50"] == pytest.approx(0.001)
    # transport = end-to-end from issue minus the agent's time, both hops together
    assert split["transport"]["p50"] == pytest.approx(2 - 0.001 - 0.65)
    assert split["overhead"]["p50"] == pytest.approx(2 - 0.001 - 0.5)
    shifted = record(sched, lag_ns=1_000, latency_ns=2 * MS)
    for name in ("agent_received", "predict_start", "predict_end", "agent_replied"):
        getattr(shifted, name)[:] += 40_000  # a wrong offset moves every agent time
    moved = latency_split(shifted)
    assert moved["transport"] == split["transport"] and moved["compute"] == split["compute"]
    before = split["to_agent"]["p50"]
    assert before is not None
    assert moved["to_agent"]["p50"] == pytest.approx(before + 0.04)


def test_peak_search_steps() -> None:
    assert next_rate(100, 100, None, 10) == 200  # nothing failed yet: double
    assert next_rate(100, None, 100, 10) == 50  # nothing passed yet: halve
    assert next_rate(15, None, 15, 10) is None  # below the rate that has enough queries
    assert next_rate(200, 100, 200, 10) == 150  # bisect
    assert next_rate(104, 100, 104, 10) is None  # within PEAK_PRECISION: done
    assert next_rate(600_000, 600_000, None, 10) == MAX_QPS  # no rate past a run's highest
    assert next_rate(MAX_QPS, MAX_QPS, None, 10) is None  # passed at the highest: done

    # Simulated system whose true peak is 730 QPS: the search closes in on it.
    rate: float | None = 100.0
    passed: float | None = None
    failed: float | None = None
    tried: list[float] = []
    while rate is not None and len(tried) < 20:
        tried.append(rate)
        if rate <= 730:
            passed = max(passed or 0, rate)
        else:
            failed = min(failed or 1e9, rate)
        rate = next_rate(rate, passed, failed, 10)
    assert passed is not None and failed is not None
    assert passed <= 730 < failed and failed / passed - 1 <= PEAK_PRECISION
    assert tried[:4] == [100, 200, 400, 800]


def test_peak_search_starts_where_a_run_can_show_p99() -> None:
    """Under a bound, a run needs 459 queries to show p99 at 99% confidence with none
    over it (0.99^459 < 0.01); one with fewer can never be VALID, so a search starts
    no lower than that count over its duration (+10%)."""
    policy = ValidityPolicy()
    one_s = ScenarioSpec(name="peak", duration_s=1.0, latency_bound_ms=5)
    assert peak_floor_qps(one_s, policy) == pytest.approx(1.1 * 459)
    ten_s = one_s.model_copy(update={"duration_s": 10.0})
    assert peak_floor_qps(ten_s, policy) == pytest.approx(1.1 * 45.9)
    more = one_s.model_copy(update={"min_queries": 2000})  # a stricter minimum wins
    assert peak_floor_qps(more, policy) == pytest.approx(1.1 * 2000)


def test_a_peak_search_whose_trials_are_too_short_for_any_rate_is_refused() -> None:
    """Trials of 1 µs would need 459 queries at 5e8 QPS, past the highest rate a run may
    have: refused before any trial (the first trial's run request was refused by its
    agent as an invalid request)."""
    from broker import scenario_kinds

    peak = scenario_kinds.get("peak")
    spec = ScenarioSpec(name="peak", duration_s=1e-6, min_duration_s=0, latency_bound_ms=5)
    with pytest.raises(ConfigError, match=r"a rate over the 1e\+06 QPS a run may have"):
        peak.refuse(spec, ValidityPolicy())
    peak.refuse(spec.model_copy(update={"duration_s": 1.0}), ValidityPolicy())


@pytest.mark.parametrize(
    "path", sorted((REPO / "manifests" / "scenarios").glob("*.yaml")), ids=lambda p: p.stem
)
def test_every_scenario_file_makes_a_spec(path: Path) -> None:
    spec = scenario_spec(path, {})
    assert spec.name == path.stem
    if spec.name not in ("batched", "single-stream", "concurrency", "cold-start"):
        sched, window = build_schedule(spec)
        assert len(sched) > 0 and window > 0


def test_flags_override_a_scenario_file() -> None:
    f = REPO / "manifests" / "scenarios" / "multi-stream.yaml"
    spec = scenario_spec(f, {"qps": 5.0, "duration_s": None})
    assert spec.qps == 5 and spec.batch_size == 8 and spec.duration_s == 30
    replay = scenario_spec(REPO / "manifests" / "scenarios" / "replay.yaml", {})
    assert len(replay.arrivals_s or ()) == 200
    assert build_schedule(replay)[0].offsets_ns[-1] == 11_291_879_000
    with pytest.raises(ConfigError, match=r"needs arrivals"):
        build_schedule(ScenarioSpec(name="replay"))


def test_merge_of_dealt_records_restores_global_order() -> None:
    whole = schedule.poisson(500, n=101, seed=3)
    parts = schedule.deal(whole, 3)
    results = []
    for part in parts:
        rec = record(part.offsets_ns)
        rec.prediction[:] = part.index  # tag each query with its global index
        results.append((rec, {0: f"err {int(part.index[0])}"}))
    merged = merge_results(parts, results)
    assert merged.n == 101 and (merged.scheduled == whole.offsets_ns).all()
    assert (merged.prediction == np.arange(101)).all()
    assert merged.errors == {0: "err 0", 1: "err 1", 2: "err 2"}
    assert set(ARRAYS) <= set(vars(merged))


def test_clock_offset_needs_at_least_one_ping() -> None:
    """Zero rounds is a ConfigError, raised before anything is sent (no bus is used)."""
    with pytest.raises(ConfigError, match="rounds must be at least 1, got 0"):
        anyio.run(lambda: estimate_offset(cast(Bus, None), "agent-x", rounds=0))


@pytest.mark.parametrize("first", ["completed", "scheduled"])
def test_the_running_p50_reads_a_record_that_another_thread_is_growing(first: str) -> None:
    """A closed loop's reader thread grows the record (array after array, under the
    run's lock) while the event loop reports progress without that lock: the progress
    figure is read from whatever state the record is in, and never fails the run."""
    rec = RunRecord(n=4, batch_size=1)
    rec.scheduled[:] = [0, 10_000_000, 20_000_000, 30_000_000]
    rec.completed[:] = [1_000_000, 12_000_000, 23_000_000, 0]  # 1, 2, 3 ms; one in flight
    # Half-way through a growth: one array already doubled, the other not yet.
    grown = np.zeros(8, np.int64)
    grown[:4] = getattr(rec, first)
    setattr(rec, first, grown)
    assert running_p50_ms(rec) == 2.0
