"""``peak``: the highest Poisson rate whose runs meet the latency bound (MLPerf's
find-peak-performance), by a binary search of runs."""

from __future__ import annotations

from broker.context import Context
from broker.run import Run
from broker.scenario import Outcome, Scenario, run_once
from broker.summary import policy_for
from mlscope.contracts import MAX_QPS, ScenarioSpec
from mlscope.early_stopping import early_stopping_queries_needed
from mlscope.errors import ConfigError
from mlscope.validity import ValidityPolicy

__all__ = ["PEAK_PRECISION", "Peak", "next_rate", "peak_floor_qps", "trial_min_queries"]

PEAK_PRECISION = 0.05
"""A peak search stops when the failing rate is within 5% of the passing one."""


def next_rate(
    rate: float, passed: float | None, failed: float | None, floor_qps: float
) -> float | None:
    """The next rate a peak search tries, or None when it is done.

    Double while nothing failed, up to :data:`~mlscope.contracts.MAX_QPS` (a run's
    highest rate: its peak is then at least that); halve while nothing passed (down to
    ``floor_qps``, below which a run has too few queries to show its percentile); then
    bisect until the failing rate is within :data:`PEAK_PRECISION` of the passing one.
    """
    if failed is None:
        return min(rate * 2, MAX_QPS) if rate < MAX_QPS else None
    if passed is None:
        return rate / 2 if rate / 2 >= floor_qps else None
    if failed / passed - 1 <= PEAK_PRECISION:
        return None
    return (passed + failed) / 2


def trial_min_queries(spec: ScenarioSpec, policy: ValidityPolicy) -> int:
    """Queries a trial needs whatever its latencies: enough to show its percentile
    under the bound by early stopping (459 for p99 at 99% confidence, none over) and
    the minimum count (``policy`` with the spec's own minimums: :func:`policy_for`)."""
    pol = policy_for(spec, policy)
    need = early_stopping_queries_needed([], 0.0, pol.percentile, pol.confidence, pol.tolerance)
    return max(need, pol.min_queries)


def peak_floor_qps(spec: ScenarioSpec, policy: ValidityPolicy) -> float:
    """The lowest rate a peak search tries: below it a run of ``spec.duration_s`` has
    fewer than :func:`trial_min_queries`, so it would fail for its length, not its
    latency. 10% above the bare count, so that a Poisson run's count (sd sqrt(n),
    under 5% of 459) reaches it."""
    return 1.1 * trial_min_queries(spec, policy) / spec.duration_s


class Peak(Scenario):
    """Each trial is an online run (Poisson at the trial's rate) with its own
    evaluation id (``<parent>-<k>``: its queries and spans), stored on its own (even
    when the search ends after one) and listed in the parent summary's ``points``."""

    kind = "peak"

    def refuse(self, spec: ScenarioSpec, base: ValidityPolicy) -> None:
        """A search needs a bound, and trials that some rate could make VALID: a trial
        shorter than the minimum run length, or cut by ``max_queries`` below the
        queries it needs, is INVALID at every rate, so the search could only end
        saying that no rate met the bound, whatever the system's latency."""
        if spec.latency_bound_ms is None:
            raise ConfigError(
                "scenario 'peak' needs a latency bound (--latency-bound-ms B)",
                field="latency_bound_ms",
            )
        pol = policy_for(spec, self.policy(base))
        cannot = "peak search: no trial could be VALID at any rate"
        if spec.duration_s < pol.min_duration_s:
            raise ConfigError(
                f"{cannot}: each runs {spec.duration_s:g} s, under the minimum run length "
                f"of {pol.min_duration_s:g} s (a longer --duration, or a lower --min-duration)",
                field="duration_s",
            )
        need = trial_min_queries(spec, pol)
        if peak_floor_qps(spec, self.policy(base)) > MAX_QPS:
            raise ConfigError(
                f"{cannot}: a run of {spec.duration_s:g} s needs {need} queries to show "
                f"p{pol.percentile:g} under the bound, a rate over the {MAX_QPS:g} QPS a "
                "run may have (a longer --duration)",
                field="duration_s",
            )
        if spec.max_queries is not None and spec.max_queries < need:
            raise ConfigError(
                f"{cannot}: each stops after {spec.max_queries} queries, under the {need} "
                f"a run needs to show p{pol.percentile:g} under the bound",
                field="max_queries",
            )

    async def execute(self, ctx: Context, spec: ScenarioSpec) -> Outcome:
        """Binary search of the highest Poisson rate whose run is VALID under the bound.

        From ``qps`` (raised to :func:`peak_floor_qps`), double until a rate fails (or
        halve until one passes), then bisect until the failing rate is within
        :data:`PEAK_PRECISION` of the passing one or ``peak_trials`` runs were made. Every
        trial uses the same seed, so rates are compared on the same arrival pattern
        (common random numbers). The peak is the highest rate whose run was VALID.
        """
        self.refuse(spec, ctx.policy)
        floor_qps = peak_floor_qps(spec, self.policy(ctx.policy))
        rate: float | None = max(spec.qps, floor_qps)
        passed: float | None = None
        failed: float | None = None
        runs: list[Run] = []
        best: Run | None = None
        while rate is not None and len(runs) < spec.peak_trials:
            trial = spec.model_copy(update={"name": "peak", "qps": rate})
            run = await run_once(ctx, self, trial, self.run_id(ctx, spec, len(runs)))
            runs.append(run)
            if run.verdict.valid:
                if passed is None or rate > passed:
                    passed, best = rate, run
            elif failed is None or rate < failed:
                failed = rate
            rate = next_rate(rate, passed, failed, floor_qps)
        if best is None:
            lowest = min(runs, key=lambda r: r.requested_qps or 0)
            low = lowest.requested_qps or 0.0
            floored = len(runs) < spec.peak_trials and low / 2 < floor_qps
            return Outcome(  # its own reasons are the evaluation's, given once
                lowest,
                runs,
                extra_reasons=(
                    f"peak search: no rate tried gave a VALID run under the "
                    f"{spec.latency_bound_ms:g} ms bound; the lowest tried, {low:.1f} QPS, "
                    "is the run shown"
                    + (_floor_hint(spec, self.policy(ctx.policy)) if floored else ""),
                ),
            )
        return Outcome(best, runs, peak_qps=passed)


def _floor_hint(spec: ScenarioSpec, policy: ValidityPolicy) -> str:
    """Why a search that found no VALID rate went no lower, and how to let it."""
    return (
        f"; it went no lower: below {peak_floor_qps(spec, policy):.1f} QPS a "
        f"{spec.duration_s:g} s trial has fewer than the {trial_min_queries(spec, policy)} "
        "queries that show its percentile under the bound (a longer --duration lets it)"
    )
