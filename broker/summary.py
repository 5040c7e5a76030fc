"""From a run's raw samples to its summary figures and validity verdict.

Every statistic comes from :mod:`mlscope.stats`; every verdict from
:func:`mlscope.validity.verdict`. Definitions:

* latency = completed - scheduled (so a late issue counts against the system);
* issue lag = issued - scheduled, over issued queries;
* achieved rate = issued queries / last issue offset, scheduled rate the same over
  scheduled offsets (:func:`mlscope.validity.achieved_rate`); the verdict compares them;
* throughput = samples answered / (last completion - first issue).

Latency split (per completed query, ms), from the agent's timestamps converted to the
load-generator clock with the stored clock offset:

* ``issue_lag``: scheduled -> issued (the load generator);
* ``transport``: (completed - issued) - (agent replied - agent received): both bus
  hops together. The clock offset cancels out of this difference, so it is exact
  even across hosts;
* ``to_agent`` / ``from_agent``: the two hops separately (each uncertain by the
  offset's error, at most half the ping round trip);
* ``queueing``: agent received -> predict start (the agent's queue + pre-processing);
* ``compute``: the predict span;
* ``reply``: predict end -> reply sent (post-processing + encoding);
* ``overhead``: (completed - issued) - compute, what the platform adds to the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from broker.loadgen import RunRecord
from mlscope.contracts import LatencyStats, ScenarioSpec
from mlscope.stats import describe_ms, percentiles
from mlscope.validity import ValidityPolicy, Verdict, achieved_rate, verdict

__all__ = ["Figures", "figures", "judge", "latency_split", "policy_for"]


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


def _issued_mask(rec: RunRecord) -> np.ndarray:
    mask: np.ndarray = (rec.issued > 0) | (rec.completed > 0)
    return mask


def figures(rec: RunRecord, *, has_labels: bool) -> Figures:
    ok = rec.ok.astype(bool)
    issued_mask = _issued_mask(rec)
    issued = rec.issued[issued_mask]
    lat_ns = (rec.completed - rec.scheduled)[ok]
    lag_ns = (rec.issued - rec.scheduled)[issued_mask]
    lag50, lag90, lag99, lag999 = percentiles(lag_ns / 1e3, [50, 90, 99, 99.9])
    samples = int(ok.sum()) * rec.batch_size
    end = rec.completed[rec.completed > 0]
    duration = float(end.max() - rec.scheduled.min()) / 1e9 if end.size else 0.0
    first_issue = float(issued.min()) if issued.size else 0.0
    tput_span = (float(end.max()) - first_issue) / 1e9 if end.size else 0.0
    sched_rate, ach_rate = achieved_rate(rec.scheduled), achieved_rate(issued)
    return Figures(
        queries=rec.n, samples=samples, errors=errors(rec),
        not_issued=rec.not_issued,
        duration_s=duration,
        scheduled_qps=sched_rate or None, achieved_qps=ach_rate or None,
        latency_ms=LatencyStats(**describe_ms(lat_ns)),
        issue_lag_us={"p50": lag50, "p90": lag90, "p99": lag99, "p99.9": lag999,
                      "min": float(lag_ns.min() / 1e3) if lag_ns.size else None,
                      "max": float(lag_ns.max() / 1e3) if lag_ns.size else None},
        throughput_ips=samples / tput_span if tput_span > 0 else None,
        top1=float(rec.correct.sum()) / samples if has_labels and samples else None,
    )


def errors(rec: RunRecord) -> int:
    """Queries that failed, plus those issued that never got an answer."""
    lost = int(np.count_nonzero(_issued_mask(rec) & (rec.completed == 0)))
    return len(rec.errors) + lost


def latency_split(rec: RunRecord) -> dict[str, dict[str, float | None]]:
    """p50 / p99 / mean in ms of each stage of a completed query (see module doc)."""
    ok = rec.ok.astype(bool)
    if not ok.any():
        return {}
    sched, issued, done = rec.scheduled[ok], rec.issued[ok], rec.completed[ok]
    recv, p0, p1, sent = (rec.agent_received[ok], rec.predict_start[ok], rec.predict_end[ok],
                          rec.agent_replied[ok])
    compute = p1 - p0
    stages = {
        "issue_lag": issued - sched,
        "transport": (done - issued) - (sent - recv),
        "to_agent": recv - issued,
        "from_agent": done - sent,
        "queueing": p0 - recv,
        "compute": compute,
        "reply": sent - p1,
        "overhead": (done - issued) - compute,
    }
    out: dict[str, dict[str, float | None]] = {}
    for name, ns in stages.items():
        ms = ns.astype(np.float64) / 1e6
        p50, p99 = percentiles(ms, [50, 99])
        out[name] = {"p50": p50, "p99": p99, "mean": float(ms.mean())}
    return out


def policy_for(spec: ScenarioSpec, base: ValidityPolicy) -> ValidityPolicy:
    """``base`` with what the scenario asks for: its minimums and its latency bound.

    As MLPerf: a throughput sweep (``batched``, MLPerf offline) has no latency target,
    so no early-stopping requirement; ``single-stream`` targets p90.
    """
    from dataclasses import replace

    bound = spec.latency_bound_ms
    return replace(
        base,
        early_stopping=base.early_stopping and spec.name != "batched",
        percentile=90.0 if spec.name == "single-stream" else base.percentile,
        min_duration_s=spec.min_duration_s if spec.min_duration_s is not None
        else base.min_duration_s,
        min_queries=spec.min_queries if spec.min_queries is not None else base.min_queries,
        latency_bound_ns=int(bound * 1e6) if bound is not None else base.latency_bound_ns,
        max_issue_lag_us=spec.max_issue_lag_us if spec.max_issue_lag_us is not None
        else base.max_issue_lag_us,
    )


def judge(rec: RunRecord, spec: ScenarioSpec, policy: ValidityPolicy, *, window_s: float,
          requested_rate: float | None, poisson: bool) -> Verdict:
    """The verdict on one run (:func:`mlscope.validity.verdict` over its raw arrays).

    ``window_s``: how long the load ran (the schedule's window for an open loop, the
    time to the last completion for a closed one), held to ``min_duration_s``.
    """
    ok = rec.ok.astype(bool)
    issued = np.where(_issued_mask(rec), np.maximum(rec.issued, 1), 0)
    return verdict(
        scheduled_ns=rec.scheduled, issued_ns=issued,
        latency_ns=(rec.completed - rec.scheduled)[ok], errors=errors(rec),
        requested_rate=requested_rate, poisson=poisson, duration_s=window_s,
        policy=policy_for(spec, policy))
