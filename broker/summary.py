"""From a run's raw samples to its summary and validity verdict.

Every statistic comes from :mod:`mlscope.stats`. Definitions:

* latency = completed - scheduled (so a late issue counts against the system);
* issue lag = issued - scheduled, over issued queries;
* achieved rate = (issued - 1) / (last issue - first issue); the schedule's own rate
  is computed the same way over scheduled times, and the verdict compares the two
  (a Poisson schedule's realized rate differs from the requested one by chance);
* throughput = samples answered / (last completion - first issue).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from broker.loadgen import RunRecord
from mlscope.contracts import LatencyStats, ScenarioSpec
from mlscope.stats import describe_ms, percentiles

__all__ = ["Figures", "Rules", "figures", "judge"]


@dataclass(frozen=True, kw_only=True)
class Rules:
    """Validity rules; a run breaking any of them is INVALID with the reason."""

    min_queries: int = 64
    min_duration_s: float = 0.0
    max_issue_lag_p99_us: float = 1_000.0
    rate_tolerance: float = 0.01


@dataclass(frozen=True, kw_only=True)
class Figures:
    queries: int
    samples: int
    errors: int
    not_issued: int
    duration_s: float
    scheduled_qps: float | None
    achieved_qps: float | None
    latency_ms: LatencyStats
    issue_lag_us: dict[str, float | None]
    throughput_ips: float | None
    top1: float | None


def _rate(times_ns: np.ndarray) -> float | None:
    if times_ns.size < 2:
        return None
    span = float(times_ns.max() - times_ns.min())
    return (times_ns.size - 1) / (span / 1e9) if span > 0 else None


def figures(rec: RunRecord, *, has_labels: bool) -> Figures:
    ok = rec.ok.astype(bool)
    issued_mask = (rec.issued > 0) | (rec.completed > 0)
    issued = rec.issued[issued_mask]
    lat_ns = (rec.completed - rec.scheduled)[ok]
    lag_ns = (rec.issued - rec.scheduled)[issued_mask]
    lag50, lag99 = percentiles(lag_ns / 1e3, [50, 99])
    samples = int(ok.sum()) * rec.batch_size
    end = rec.completed[rec.completed > 0]
    duration = float(end.max() - rec.scheduled.min()) / 1e9 if end.size else 0.0
    first_issue = float(issued.min()) if issued.size else 0.0
    tput_span = (float(end.max()) - first_issue) / 1e9 if end.size else 0.0
    lost = int(np.count_nonzero(issued_mask & (rec.completed == 0)))
    return Figures(
        queries=rec.n, samples=samples, errors=len(rec.errors) + lost,
        not_issued=rec.not_issued,
        duration_s=duration,
        scheduled_qps=_rate(rec.scheduled), achieved_qps=_rate(rec.issued[issued_mask]),
        latency_ms=LatencyStats(**describe_ms(lat_ns)),
        issue_lag_us={"p50": lag50, "p99": lag99,
                      "max": float(lag_ns.max() / 1e3) if lag_ns.size else None},
        throughput_ips=samples / tput_span if tput_span > 0 else None,
        top1=float(rec.correct.sum()) / samples if has_labels and samples else None,
    )


def judge(f: Figures, spec: ScenarioSpec, rules: Rules) -> tuple[str, ...]:
    """The reasons a run is INVALID (empty when it is valid)."""
    reasons = []
    min_q = spec.min_queries or rules.min_queries
    min_d = spec.min_duration_s if spec.min_duration_s is not None else rules.min_duration_s
    if f.queries < min_q:
        reasons.append(f"ran {f.queries} queries < minimum {min_q}")
    if f.duration_s < min_d:
        reasons.append(f"ran {f.duration_s:.2f} s < minimum {min_d:g} s")
    if f.errors:
        reasons.append(f"{f.errors} queries failed or got no reply")
    if f.not_issued:
        reasons.append(f"{f.not_issued} queries could not be issued "
                       f"(more than {spec.max_outstanding} outstanding)")
    if spec.name == "online":
        lag99 = f.issue_lag_us.get("p99")
        if lag99 is not None and lag99 > rules.max_issue_lag_p99_us:
            reasons.append(f"p99 issue lag {lag99:.0f} µs > {rules.max_issue_lag_p99_us:.0f} µs")
        if f.achieved_qps and f.scheduled_qps:
            short = 1 - f.achieved_qps / f.scheduled_qps
            if abs(short) > rules.rate_tolerance:
                reasons.append(f"achieved {f.achieved_qps:.1f} QPS vs scheduled "
                               f"{f.scheduled_qps:.1f} QPS ({short:+.1%})")
    return tuple(reasons)
