"""Run validity: MLPerf early-stopping figures and verdicts for good and bad runs."""

from __future__ import annotations

from typing import TypedDict

import numpy as np
import pytest
from scipy import special
from scipy import stats as sps

from mlscope import early_stopping as es
from mlscope import schedule as sch
from mlscope import validity as v
from mlscope.stats import percentile


def test_mlperf_published_minimum_query_counts() -> None:
    # "Processed at least 64 queries" (p90) and 662 (p99), none above the estimate
    assert es.early_stopping_min_queries(90) == 64
    assert es.early_stopping_min_queries(99) == 662


@pytest.mark.parametrize(("n", "discarded"), [(2048, 172), (2116, 178), (7469, 685)])
def test_discard_counts_match_mlperf_single_stream_logs(n: int, discarded: int) -> None:
    # MLPerf single-stream summaries: "Would discard 172 highest latency queries" at n=2048
    est = es.early_stopping_percentile_bound(np.arange(n, dtype=float), 90)
    assert est is not None
    assert est.discarded == discarded and est.estimate == n - 1 - discarded
    assert est.min_queries == 64 and est.queries == n


@pytest.mark.parametrize("over", [0, 1, 2, 7, 40])
@pytest.mark.parametrize("pct", [90.0, 99.0])
def test_min_passing_queries_is_the_least_passing_binomial_count(over: int, pct: float) -> None:
    h = es.min_passing_queries(over, pct)
    q = pct / 100
    assert sps.binom.cdf(over, h + over, 1 - q) < 0.01
    assert sps.binom.cdf(over, h - 1 + over, 1 - q) >= 0.01


@pytest.mark.parametrize(
    ("h", "t", "q"),
    [(63, 1, 0.9), (661, 1, 0.99), (100_000, 899, 0.99), (3, 999, 1e-3), (7, 6, 0.5)],
)
def test_odds_are_the_incomplete_beta_of_the_docstring(h: int, t: int, q: float) -> None:
    # P[Binomial(h + t, 1 - q) <= t] = I_q(h, t + 1)
    assert es._odds(h, t, q) == pytest.approx(special.betainc(h, t + 1, q), rel=1e-9)


def test_percentile_bound_is_conservative_and_none_when_too_few() -> None:
    assert es.early_stopping_percentile_bound(np.ones(661), 99) is None
    lat = np.random.default_rng(0).lognormal(size=20_000)
    est = es.early_stopping_percentile_bound(lat, 99)
    assert est is not None
    p99 = percentile(lat, 99)
    assert p99 is not None and est.estimate >= p99
    assert est.estimate == np.sort(lat)[est.rank - 1]


def test_queries_needed_for_a_bound() -> None:
    lat = np.full(1000, 1.0)
    assert es.early_stopping_queries_needed(lat, 2.0, 99) == 459  # none over: h(0)
    lat[:5] = 3.0
    assert es.early_stopping_queries_needed(lat, 2.0, 99) == es.min_passing_queries(5, 99) + 5


# --- verdicts --------------------------------------------------------------------------

MS = 1_000_000


class Timings(TypedDict):
    """The per-query arrays of :func:`mlscope.validity.verdict`."""

    scheduled_ns: np.ndarray
    issued_ns: np.ndarray
    latency_ns: np.ndarray


def _run(
    rate: float = 1000.0, duration_s: float = 12.0, lag_ns: int = 20_000, seed: int = 1
) -> Timings:
    s = sch.poisson(rate, duration_s=duration_s, seed=seed)
    issued = s.offsets_ns + lag_ns
    latency = np.full(len(s), 2 * MS, dtype=np.int64) + lag_ns
    return Timings(scheduled_ns=s.offsets_ns, issued_ns=issued, latency_ns=latency)


def test_good_run_is_valid() -> None:
    got = v.verdict(
        **_run(), requested_rate=1000.0, policy=v.ValidityPolicy(latency_bound_ns=10 * MS)
    )
    assert got == v.Verdict(True, ())


def test_too_short() -> None:
    got = v.verdict(**_run(duration_s=4.2), requested_rate=1000.0)
    assert not got.valid
    assert any(r.startswith("ran 4.") and "< minimum 10 s" in r for r in got.reasons)


def test_too_few_queries_and_no_early_stopping_estimate() -> None:
    run = _run(rate=5.0, duration_s=12.0)
    got = v.verdict(**run, requested_rate=5.0)
    n = len(run["scheduled_ns"])
    assert f"issued {n} queries < minimum 100" in got.reasons
    assert any(r.startswith(f"early stopping: {n} completed queries < 662") for r in got.reasons)


def test_too_late_issue_lag() -> None:
    got = v.verdict(**_run(lag_ns=812_000), policy=v.ValidityPolicy(max_issue_lag_us=500))
    assert got.reasons == ("p99 issue lag 812 µs > 500 µs",)


def test_issued_early_is_invalid() -> None:
    run = _run()
    run["issued_ns"] = run["issued_ns"].copy()
    run["issued_ns"][10] = run["scheduled_ns"][10] - 3_000
    got = v.verdict(**run)
    assert "1 queries issued before their scheduled time (earliest by 3 µs)" in got.reasons


def test_rate_shortfall() -> None:
    run = _run()
    # the generator fell 3% behind: issue times stretch out
    run["issued_ns"] = (run["scheduled_ns"] * 1.03).astype(np.int64)
    got = v.verdict(**run, policy=v.ValidityPolicy(max_issue_lag_us=1e9))
    assert len(got.reasons) == 1 and "below the scheduled" in got.reasons[0]
    assert "2.9% below" in got.reasons[0]


def test_requested_rate_allows_poisson_noise_but_not_a_wrong_rate() -> None:
    run = _run()
    assert v.verdict(**run, requested_rate=1000.0).valid
    got = v.verdict(**run, requested_rate=1100.0)
    assert any("off the requested 1100 q/s" in r for r in got.reasons)
    periodic = sch.constant(1000.0, duration_s=11.0).offsets_ns
    ok = v.verdict(
        scheduled_ns=periodic,
        issued_ns=periodic + 1,
        latency_ns=np.full(periodic.size, MS),
        requested_rate=1000.0,
        poisson=False,
    )
    assert ok.valid


def test_latency_bound_and_early_stopping_for_a_bound() -> None:
    run = _run()
    run["latency_ns"] = run["latency_ns"].copy()
    run["latency_ns"][::50] = 30 * MS  # 2% over 10 ms: p99 fails the bound
    got = v.verdict(**run, policy=v.ValidityPolicy(latency_bound_ns=10 * MS))
    assert any(r.startswith("p99 latency 30 ms > bound 10 ms") for r in got.reasons)
    assert any(r.startswith("early stopping:") and "over the 10 ms bound" in r for r in got.reasons)


def test_errors_and_not_issued_are_counted() -> None:
    run = _run()
    run["issued_ns"] = run["issued_ns"].copy()
    run["issued_ns"][100:137] = 0
    got = v.verdict(**run, errors=12, policy=v.ValidityPolicy(rate_tolerance=0.05))
    assert "12 queries failed (allowed 0)" in got.reasons
    assert any(r.startswith("37 queries not issued") for r in got.reasons)
    lenient = v.ValidityPolicy(rate_tolerance=0.05, max_errors=12, max_not_issued=37)
    assert v.verdict(**run, errors=12, policy=lenient).valid


def test_nothing_completed() -> None:
    run = _run()
    got = v.verdict(scheduled_ns=run["scheduled_ns"], issued_ns=run["issued_ns"], latency_ns=[])
    assert "no query completed" in got.reasons
    # Every answer a warm-up one: the reason says so, not that nothing was answered.
    warm = v.verdict(
        scheduled_ns=run["scheduled_ns"], issued_ns=run["issued_ns"], latency_ns=[], warmup=97
    )
    assert "no query completed after the 97 warm-up queries" in warm.reasons


def test_achieved_rate() -> None:
    assert v.achieved_rate(np.array([1, 2, 3, 4]) * 250 * MS) == pytest.approx(4.0)
    assert v.achieved_rate(np.empty(0, np.int64)) == 0.0
