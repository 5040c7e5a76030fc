"""From a run's raw samples to its summary figures and validity verdict.

Every statistic comes from :mod:`mlscope.stats`; every verdict from
:func:`mlscope.validity.verdict`. Definitions:

* latency = completed - scheduled (so a late issue counts against the system);
* issue lag = issued - scheduled, over issued queries, where *issued* is when the
  query was handed on (written to the bus by the pacer thread in server placement;
  given to the executor in an agent's local run); its parts ``pacer`` (scheduled ->
  released by the pacer thread) and ``loop`` (released -> handed on; 0 where the
  pacer thread sends itself) are reported apart (``issue_lag_split_us``);
* offered (scheduled), issued (achieved) and completed rates = queries / last offset
  of their scheduled, issue and answer times (:func:`mlscope.validity.achieved_rate`);
  ``backlog_s``: queries arrived and unanswered at the end of an open loop's window,
  in seconds of offered load (:func:`mlscope.answering.backlog_s`); the window ends at
  the last reply when the agent stopped answering (:func:`stopped`: what it was sent
  after that is lost, not queued);
* failed / refused / lost / not issued: :mod:`mlscope.outcomes` (``errors`` is the
  first three);
* throughput = samples answered / (last completion - first issue);
* the first ``warmup_queries`` queries are left out of the latency, throughput,
  accuracy, issue-lag and failure figures and rules; the load's own rules and rates
  (duration, count, offered / issued / completed, overload) count every query.

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

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from mlscope.answering import Silence, answering_window_s, backlog_s, silence
from mlscope.contracts import LatencyStats, Placement, ScenarioSpec
from mlscope.outcomes import count, was_sent
from mlscope.record import RunRecord
from mlscope.stats import describe_ms, percentiles
from mlscope.validity import ValidityPolicy, Verdict, achieved_rate, verdict

__all__ = [
    "LOADGEN_BUSY_WARN",
    "Figures",
    "LoadgenCost",
    "cpu_us_per_query",
    "figures",
    "issue_lag_split",
    "judge",
    "latency_split",
    "policy_for",
    "process_cpu",
    "stopped",
    "stream_warnings",
    "tracing_warnings",
]


@dataclass(frozen=True, kw_only=True)
class Figures:
    queries: int
    """Every query of the run, warm-up included."""
    warmup_queries: int
    samples: int
    outcomes: dict[str, int]
    """:func:`mlscope.outcomes.count` of the measured (non-warm-up) queries."""
    duration_s: float
    scheduled_qps: float | None
    achieved_qps: float | None
    completed_qps: float | None
    backlog_s: float | None
    latency_ms: LatencyStats
    issue_lag_us: dict[str, float | None]
    issue_lag_split_us: dict[str, dict[str, float | None]]
    throughput_ips: float | None
    top1: float | None
    loadgen_cpu_us_per_query: float | None
    loadgen_cpu_s: float | None = None
    """The load generators' CPU time (``RunRecord.cpu_s``); None where they report none."""
    process_cpu: dict[str, float | None] = field(default_factory=dict)
    """An agent's local run: its process's CPU time (:func:`process_cpu`)."""

    @property
    def errors(self) -> int:
        return self.outcomes["errors"]

    @property
    def not_issued(self) -> int:
        return self.outcomes["not_issued"]


def _lag_stats(lag_ns: np.ndarray) -> dict[str, float | None]:
    us = lag_ns / 1e3
    p50, p90, p99, p999 = percentiles(us, [50, 90, 99, 99.9])
    return {
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "p99.9": p999,
        "min": float(us.min()) if us.size else None,
        "max": float(us.max()) if us.size else None,
    }


def issue_lag_split(rec: RunRecord) -> dict[str, dict[str, float | None]]:
    """Issue lag in its two parts (µs): ``pacer`` = scheduled -> released by the pacer
    thread, ``loop`` = released -> handed on (0 where the pacer thread sends itself)."""
    m = rec.measured() & (rec.paced > 0) & (rec.issued > 0)
    return {
        "pacer": _lag_stats((rec.paced - rec.scheduled)[m]),
        "loop": _lag_stats((rec.issued - rec.paced)[m]),
    }


def figures(rec: RunRecord, *, has_labels: bool, window_s: float | None = None) -> Figures:
    """The figures of one run; ``window_s`` is an open loop's load window (None for a
    closed loop, which has no backlog). Warm-up queries are left out of every figure but
    the rates (offered, issued, completed: the load generator's, over the whole run)."""
    meas = rec.measured()
    ok = rec.ok.astype(bool) & meas
    issued_mask = was_sent(rec.issued, rec.completed) & meas
    issued = rec.issued[issued_mask]
    lat_ns = (rec.completed - rec.scheduled)[ok]
    samples = int(ok.sum()) * rec.batch_size
    end = rec.completed[(rec.completed > 0) & meas]
    duration = float(end.max() - rec.scheduled[meas].min()) / 1e9 if end.size else 0.0
    first_issue = float(issued.min()) if issued.size else 0.0
    tput_span = (float(end.max()) - first_issue) / 1e9 if end.size else 0.0
    # Rates are the load generator's: every query counts, warm-up included.
    all_issued = rec.issued[was_sent(rec.issued, rec.completed)]
    sched_rate, ach_rate = achieved_rate(rec.scheduled), achieved_rate(all_issued)
    done_rate = achieved_rate(rec.completed[rec.ok.astype(bool)])
    counts = count(rec.outcomes()[meas])
    return Figures(
        queries=rec.n,
        warmup_queries=int(rec.n - meas.sum()),
        samples=samples,
        outcomes=counts,
        duration_s=duration,
        scheduled_qps=sched_rate or None,
        achieved_qps=ach_rate or None,
        completed_qps=done_rate or None,
        backlog_s=(
            backlog_s(rec.scheduled, rec.answered_ns(), answering_window_s(window_s, stopped(rec)))
            if window_s is not None
            else None
        ),
        latency_ms=LatencyStats(**describe_ms(lat_ns)),
        issue_lag_us=_lag_stats((rec.issued - rec.scheduled)[issued_mask]),
        issue_lag_split_us=issue_lag_split(rec),
        throughput_ips=samples / tput_span if tput_span > 0 else None,
        top1=float(rec.correct[ok].sum()) / samples if has_labels and samples else None,
        loadgen_cpu_us_per_query=cpu_us_per_query(rec),
        loadgen_cpu_s=rec.cpu_s if rec.cpu_s > 0 else None,
        process_cpu=process_cpu(rec),
    )


def errors(rec: RunRecord) -> int:
    """Measured queries issued and not answered with outputs: failed, refused or lost."""
    return count(rec.outcomes()[rec.measured()])["errors"]


LOADGEN_BUSY_WARN = 0.05
"""Fraction of one core the load generator may use on the agent's host unwarned."""


@dataclass(frozen=True, kw_only=True)
class LoadgenCost:
    """The load generator's own cost, and whether it shared the agent's cores.

    ``placement``: where it ran. Its CPU time is that of its own threads: in the
    server (or its processes, or services) its pacer's and its query link's reader's,
    whatever else the process does (an embedded database, other runs); in the agent (a
    local run), an open loop's pacer's (none for a closed loop or a stream, whose
    queries are issued on the model's predict thread), beside the agent process's
    (:func:`process_cpu`)."""

    agent_host: str
    placement: Placement = "server"
    loadgens: int = 1
    host: str = field(default_factory=socket.gethostname)
    """Where the load was generated (hosts of load-generator services: comma-separated)."""
    cores: int | None = field(default_factory=lambda: os.cpu_count() or 1)
    """That host's cores (None for services, which do not report theirs)."""

    def served_by(self, sources: Sequence[Mapping[str, Any]]) -> LoadgenCost:
        """The cost of a run whose slices ran in load-generator services (``sources``:
        ``RunRecord.sources``), not on this server's host; unchanged without any."""
        if not sources:
            return self
        hosts = sorted({str(s.get("host")) for s in sources})
        return replace(self, host=",".join(hosts), cores=None, loadgens=len(sources))

    @property
    def shared_host(self) -> bool:
        return self.agent_host in self.host.split(",")

    def busy(self, f: Figures) -> float | None:
        """Cores the load generator kept busy on average (CPU per query × issue rate)."""
        rate = f.achieved_qps or f.completed_qps
        if f.loadgen_cpu_us_per_query is None or not rate:
            return None
        return f.loadgen_cpu_us_per_query * rate / 1e6

    def facts(self, f: Figures) -> dict[str, Any]:
        """The summary's ``loadgen_cost``."""
        return {
            "cpu_s": f.loadgen_cpu_s,
            "cpu_us_per_query": f.loadgen_cpu_us_per_query,
            "busy_cores": self.busy(f),
            "host": self.host,
            "host_cores": self.cores,
            "loadgens": self.loadgens,
            "shared_host": self.shared_host,
            "placement": self.placement,
            **f.process_cpu,
        }

    def warnings(self, f: Figures, *, parallel: bool) -> tuple[str, ...]:
        """What may have disturbed the measurement (the summary's ``warnings``)."""
        out = []
        busy = self.busy(f)
        cores = f", {self.cores} cores" if self.cores else ""
        if self.placement == "agent" and busy is not None and busy >= LOADGEN_BUSY_WARN:
            out.append(  # the job chose to share the agent's process: what it cost
                f"the load was generated in the agent's process (placement agent, "
                f"{self.agent_host}{cores}): its load generator used "
                f"{f.loadgen_cpu_us_per_query:.0f} µs CPU per query ({busy:.0%} of a "
                "core), CPU time the model's threads did not have"
            )
        elif self.shared_host and busy is not None and busy >= LOADGEN_BUSY_WARN:
            out.append(
                f"the load generator shared the agent's host ({self.agent_host}{cores}) and "
                f"used {f.loadgen_cpu_us_per_query:.0f} µs CPU per query "
                f"({busy:.0%} of a core): it may have slowed the system under test"
            )
        if parallel:
            out.append(
                "run with --parallel: other evaluations may have shared its hosts while it ran"
            )
        return tuple(out)


def stream_warnings(rec: RunRecord) -> tuple[str, ...]:
    """A run answered in blocks says that its latencies include the block's wait."""
    if not rec.streamed:
        return ()
    return (
        "answered in blocks (a stream on the model's predict thread, for throughput): "
        "each query's latency includes the wait for its block's post-processing, a few "
        "ms at most (the split's 'reply'); measure latency with an online or "
        "single-stream run",
    )


def tracing_warnings(level: str) -> tuple[str, ...]:
    """A traced run says what its trace level does to what it measured."""
    if level in ("framework", "system", "full"):
        return (
            f"traced at level {level}: every predict ran under the framework's "
            "profiler, so latency and compute include its recording cost; compare "
            "only with runs at the same level (the profiler's start and stop are "
            "kept out of the predict span: its profiler_ns attribute)",
        )
    return ()


def latency_split(rec: RunRecord) -> dict[str, dict[str, float | None]]:
    """p50 / p99 / mean in ms of each stage of a completed query (see module doc)."""
    ok = rec.ok.astype(bool) & rec.measured()
    if not ok.any():
        return {}
    sched, issued, done = rec.scheduled[ok], rec.issued[ok], rec.completed[ok]
    recv, p0, p1, sent = (
        rec.agent_received[ok],
        rec.predict_start[ok],
        rec.predict_end[ok],
        rec.agent_replied[ok],
    )
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
    """``base`` with what the job's scenario spec asks for: its minimums and its latency
    bound (a scenario's own rules, such as its percentile, are its strategy's:
    :meth:`broker.scenario.Scenario.policy`)."""
    from dataclasses import replace

    bound = spec.latency_bound_ms
    return replace(
        base,
        min_duration_s=spec.min_duration_s
        if spec.min_duration_s is not None
        else base.min_duration_s,
        min_queries=spec.min_queries if spec.min_queries is not None else base.min_queries,
        latency_bound_ns=int(bound * 1e6) if bound is not None else base.latency_bound_ns,
        max_issue_lag_us=spec.max_issue_lag_us
        if spec.max_issue_lag_us is not None
        else base.max_issue_lag_us,
    )


def cpu_us_per_query(rec: RunRecord) -> float | None:
    """The load generators' CPU time (µs) per query they sent; None without one. Their
    CPU time covers every query sent, warm-up included, so every one counts."""
    sent = _sent(rec)
    return rec.cpu_s / sent * 1e6 if sent and rec.cpu_s > 0 else None


def process_cpu(rec: RunRecord) -> dict[str, float | None]:
    """An agent's local run (placement agent): ``process_cpu_s``, the agent process's
    CPU time during the run (model, load generator and the agent's own work together),
    and ``process_cpu_us_per_query``, per query sent (as :func:`cpu_us_per_query`);
    empty for a run whose load the agent did not generate."""
    if rec.process_cpu_s is None:
        return {}
    sent = _sent(rec)
    return {
        "process_cpu_s": rec.process_cpu_s,
        "process_cpu_us_per_query": rec.process_cpu_s / sent * 1e6 if sent else None,
    }


def _sent(rec: RunRecord) -> int:
    return int(np.count_nonzero(was_sent(rec.issued, rec.completed)))


def _issued(rec: RunRecord) -> np.ndarray:
    """Each query's issue offset, at least 1 for every query sent (a closed loop may
    issue at offset 0), 0 for the others: what the verdict reads as sent."""
    issued: np.ndarray = np.where(was_sent(rec.issued, rec.completed), np.maximum(rec.issued, 1), 0)
    return issued


def stopped(rec: RunRecord) -> Silence | None:
    """Whether the run's agent stopped answering (:func:`mlscope.answering.silence`):
    queries sent after its last reply of any kind got none."""
    return silence(_issued(rec), rec.completed)


def judge(
    rec: RunRecord,
    spec: ScenarioSpec,
    policy: ValidityPolicy,
    *,
    window_s: float,
    requested_rate: float | None,
    poisson: bool,
    open_loop: bool = True,
) -> Verdict:
    """The verdict on one run (:func:`mlscope.validity.verdict` over its raw arrays).

    ``window_s``: how long the load ran (the schedule's window for an open loop, the
    time to the last completion for a closed one, at least to when it found its time
    up: :func:`broker.scenario.closed_window`), held to ``min_duration_s``. Every
    run is also judged for gaps and a final silence in its answers (a closed loop's
    wait for its first reply only for the part not spent predicting), and an open loop
    for overload outside them. Warm-up queries are left out of the latency and failure
    rules; the load rules (duration, count, issue lag, rates, gaps, overload) are the
    load generator's and count every query.
    """
    meas = rec.measured()
    ok = rec.ok.astype(bool)
    return verdict(
        scheduled_ns=rec.scheduled,
        issued_ns=_issued(rec),
        latency_ns=(rec.completed - rec.scheduled)[ok & meas],
        outcomes=count(rec.outcomes()[meas]),
        completed_ns=rec.answered_ns() if open_loop else None,
        replied_ns=rec.completed,
        predict_ns=np.where(rec.ok != 0, rec.predict_end - rec.predict_start, 0),
        requested_rate=requested_rate,
        poisson=poisson,
        duration_s=window_s,
        policy=policy_for(spec, policy),
        warmup=int(rec.n - meas.sum()),
    )
