"""Every benchmarking scenario: its schedule, its runs, its verdict (called by Evaluator.run).

=============== ============================================================== ========
scenario        load                                                           loop
=============== ============================================================== ========
online          Poisson arrivals at ``qps`` (seeded)                           open
constant        one query every ``1/qps`` s                                    open
multi-stream    ``batch_size`` samples per query, one query every ``1/qps`` s  open
replay          recorded inter-arrival times (``arrivals_s``)                  open
piecewise       Poisson with a rate that ramps / bursts (``segments``)         open
single-stream   one query outstanding                                          closed
concurrency     ``concurrency`` queries outstanding                            closed
batched         a sweep of ``batch_sizes``, closed loop at each: max
                throughput and the optimal batch size                          closed
peak            binary search of the highest Poisson rate whose p99 meets
                ``latency_bound_ms`` (MLPerf's find-peak-performance)          open
cold-start      ``repetitions`` x (reload the model, ``warm_queries``):
                load + first inference apart from warm (broker/coldstart.py)   closed
=============== ============================================================== ========

Open loops run on one pacer, or with ``loadgens = K > 1`` on K load-generator
processes that share one seeded global schedule (:mod:`broker.distributed`). A
``batched`` sweep and a ``peak`` search make several runs: each is a :class:`Run`
with its own evaluation id (``<parent>-<k>``), stored on its own, and listed in the
parent summary's ``points``; the parent's own figures are those of the best run.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from broker import agentrun, coldstart, schedule
from broker.loadgen import CLOSED_LOOPS, Driver, RunRecord
from broker.summary import Figures, figures, judge, latency_split
from mlscope.bus import Bus
from mlscope.contracts import Placement, ScenarioSpec, TraceLevel
from mlscope.errors import ConfigError
from mlscope.manifest import ScenarioFile, load_manifest
from mlscope.schedule import Schedule, build_schedule
from mlscope.validity import ValidityPolicy, Verdict, early_stopping_queries_needed

__all__ = [
    "PEAK_PRECISION",
    "SCENARIOS",
    "Context",
    "Outcome",
    "Run",
    "build_schedule",
    "execute",
    "next_rate",
    "peak_floor_qps",
    "read_arrivals",
    "scenario_spec",
]

PEAK_PRECISION = 0.05
"""A peak search stops when the failing rate is within 5% of the passing one."""
POISSON = frozenset({"online", "piecewise", "peak"})
Feeders = Callable[[int], tuple[Callable[[int], np.ndarray], Callable[[int], np.ndarray] | None]]
"""``feeders(batch_size)`` -> (inputs(i), labels(i) or None) for queries of that size."""


@dataclass
class Context:
    """What a scenario needs to drive one prepared agent."""

    bus: Bus
    evaluation_id: str
    """The id the agent was prepared for (every query carries it)."""
    subject: str
    trace_level: TraceLevel
    offset_ns: int
    feeders: Feeders
    policy: ValidityPolicy
    on_progress: Callable[[RunRecord, float], Awaitable[Any]] | None = None
    nats_url: str | None = None
    """For load-generator processes (distributed load)."""
    agent_id: str = ""
    prepare: dict[str, Any] = field(default_factory=dict)
    """The agent and its prepare request (cold-start prepares again, with reload)."""
    placement: Placement = "server"
    """Where the load is generated: by this server's Driver, or by the agent
    (:mod:`broker.agentrun`)."""


@dataclass
class Run:
    """One run: its raw record, figures, latency split and verdict."""

    evaluation_id: str
    spec: ScenarioSpec
    record: RunRecord
    figures: Figures
    verdict: Verdict
    split: dict[str, dict[str, float | None]]
    requested_qps: float | None

    def point(self) -> dict[str, Any]:
        """This run as one entry of a summary's ``points``."""
        f = self.figures
        return {
            "evaluation_id": self.evaluation_id,
            "qps": self.requested_qps,
            "batch_size": self.spec.batch_size,
            "scheduled_qps": f.scheduled_qps,
            "achieved_qps": f.achieved_qps,
            "completed_qps": f.completed_qps,
            "backlog_s": f.backlog_s,
            "throughput_ips": f.throughput_ips,
            "latency_ms": f.latency_ms.model_dump(),
            "issue_lag_us": f.issue_lag_us,
            "valid": self.verdict.valid,
            "invalid_reasons": list(self.verdict.reasons),
        }


@dataclass
class Outcome:
    main: Run
    points: list[Run] = field(default_factory=list)
    peak_qps: float | None = None
    optimal_batch_size: int | None = None
    extra_reasons: tuple[str, ...] = ()
    cold_start: dict[str, Any] | None = None


def _requested(spec: ScenarioSpec) -> float | None:
    return spec.qps if spec.name in ("online", "peak", "constant", "multi-stream") else None


async def run_once(ctx: Context, spec: ScenarioSpec, evaluation_id: str) -> Run:
    """One run of an open- or closed-loop scenario (no sweep, no search)."""
    inputs, labels = ctx.feeders(spec.batch_size)
    why: tuple[str, ...] = ()
    closed = spec.name in CLOSED_LOOPS
    if ctx.placement == "agent":
        rec, why = await agentrun.drive(
            ctx.bus,
            agent_id=ctx.agent_id,
            evaluation_id=ctx.evaluation_id,
            spec=spec,
            trace_level=ctx.trace_level,
            offset_ns=ctx.offset_ns,
            labels=labels,
            on_progress=ctx.on_progress,
        )
        window = _closed_window(rec) if closed else build_schedule(spec)[1]
    elif closed:
        rec = await _driver(ctx, spec, inputs, labels).run()
        window = _closed_window(rec)
    else:
        sched, window = build_schedule(spec)
        if spec.loadgens > 1:
            from broker.distributed import run_dealt

            rec = await run_dealt(ctx, spec, sched, inputs, labels)
        else:
            rec = await _driver(ctx, spec, inputs, labels, sched).run()
    rec.warmup = min(spec.warmup_queries, rec.n)
    requested = _requested(spec)
    verdict = judge(
        rec,
        spec,
        ctx.policy,
        window_s=window,
        requested_rate=requested,
        poisson=spec.name in POISSON,
        open_loop=not closed,
    )
    if why:  # the agent's own account of a local run that went wrong
        verdict = Verdict(valid=False, reasons=(*verdict.reasons, *why))
    fig = figures(rec, has_labels=labels is not None, window_s=None if closed else window)
    return Run(evaluation_id, spec, rec, fig, verdict, latency_split(rec), requested)


def _closed_window(rec: RunRecord) -> float:
    done = rec.completed[rec.completed > 0]
    return float(done.max()) / 1e9 if done.size else 0.0


def _driver(
    ctx: Context,
    spec: ScenarioSpec,
    inputs: Callable[[int], np.ndarray],
    labels: Callable[[int], np.ndarray] | None,
    sched: Schedule | None = None,
) -> Driver:
    """The server's load generator for one run against the prepared agent."""
    return Driver(
        ctx.bus,
        evaluation_id=ctx.evaluation_id,
        subject=ctx.subject,
        spec=spec,
        inputs=inputs,
        labels=labels,
        trace_level=ctx.trace_level,
        offset_ns=ctx.offset_ns,
        on_progress=ctx.on_progress,
        schedule=sched,
    )


async def execute(ctx: Context, spec: ScenarioSpec) -> Outcome:
    """Run ``spec``: one run, or a sweep / search of several."""
    if spec.name == "batched":
        return await _sweep(ctx, spec)
    if spec.name == "peak":
        return await _peak(ctx, spec)
    if spec.name == "cold-start":
        return await _cold_start(ctx, spec)
    if spec.name == "single-stream":
        spec = spec.model_copy(update={"concurrency": 1})
    return Outcome(await run_once(ctx, spec, ctx.evaluation_id))


async def _cold_start(ctx: Context, spec: ScenarioSpec) -> Outcome:
    """Loads measured apart from warm inference; valid when every load really happened
    and no query failed (the load-rate rules do not apply to a handful of queries)."""

    async def drive(warm: ScenarioSpec) -> RunRecord:
        inputs, labels = ctx.feeders(warm.batch_size)
        return await _driver(ctx, warm, inputs, labels).run()

    rec, cold = await coldstart.run(ctx.bus, ctx.agent_id, ctx.prepare, spec, drive)
    failed = int(rec.n - int(rec.ok.sum()))
    why = (*coldstart.reasons(cold), *((f"{failed} warm queries failed",) if failed else ()))
    f = figures(rec, has_labels=False)
    run = Run(
        ctx.evaluation_id,
        spec,
        rec,
        f,
        Verdict(valid=not why, reasons=why),
        latency_split(rec),
        None,
    )
    return Outcome(run, cold_start=cold)


async def _sweep(ctx: Context, spec: ScenarioSpec) -> Outcome:
    """Closed loop at each batch size: the point with the highest throughput wins."""
    sizes = spec.batch_sizes or (spec.batch_size,)
    runs = []
    for k, b in enumerate(sizes):
        point = spec.model_copy(update={"batch_size": b})
        runs.append(await run_once(ctx, point, f"{ctx.evaluation_id}-{k}"))
    best = max(runs, key=lambda r: r.figures.throughput_ips or 0.0)
    return Outcome(best, runs, optimal_batch_size=best.spec.batch_size)


def next_rate(
    rate: float, passed: float | None, failed: float | None, floor_qps: float
) -> float | None:
    """The next rate a peak search tries, or None when it is done.

    Double while nothing failed; halve while nothing passed (down to ``floor_qps``,
    below which a run has too few queries to show its percentile); then bisect until
    the failing rate is within :data:`PEAK_PRECISION` of the passing one.
    """
    if failed is None:
        return rate * 2
    if passed is None:
        return rate / 2 if rate / 2 >= floor_qps else None
    if failed / passed - 1 <= PEAK_PRECISION:
        return None
    return (passed + failed) / 2


def peak_floor_qps(spec: ScenarioSpec, policy: ValidityPolicy) -> float:
    """The lowest rate a peak search tries: below it a run of ``spec.duration_s`` has
    too few queries to show its percentile under the bound by early stopping (459 for
    p99 at 99% confidence, none over), so it would fail for its length, not its
    latency. 10% above the bare count, so that a Poisson run's count (sd sqrt(n),
    under 5% of 459) reaches it."""
    need = early_stopping_queries_needed(
        [], 0.0, policy.percentile, policy.confidence, policy.tolerance
    )
    return 1.1 * max(need, spec.min_queries or 0) / spec.duration_s


async def _peak(ctx: Context, spec: ScenarioSpec) -> Outcome:
    """Binary search of the highest Poisson rate whose run is VALID under the bound.

    From ``qps`` (raised to :func:`peak_floor_qps`), double until a rate fails (or
    halve until one passes), then bisect until the failing rate is within
    :data:`PEAK_PRECISION` of the passing one or ``peak_trials`` runs were made. Every
    trial uses the same seed, so rates are compared on the same arrival pattern
    (common random numbers). The peak is the highest rate whose run was VALID.
    """
    if spec.latency_bound_ms is None:
        raise ConfigError("scenario 'peak' needs a latency bound (--latency-bound-ms B)")
    floor_qps = peak_floor_qps(spec, ctx.policy)
    rate: float | None = max(spec.qps, floor_qps)
    passed: float | None = None
    failed: float | None = None
    runs: list[Run] = []
    best: Run | None = None
    while rate is not None and len(runs) < spec.peak_trials:
        trial = spec.model_copy(update={"name": "peak", "qps": rate})
        run = await run_once(ctx, trial, f"{ctx.evaluation_id}-{len(runs)}")
        runs.append(run)
        if run.verdict.valid:
            if passed is None or rate > passed:
                passed, best = rate, run
        elif failed is None or rate < failed:
            failed = rate
        rate = next_rate(rate, passed, failed, floor_qps)
    if best is None:
        return Outcome(
            runs[-1],
            runs,
            extra_reasons=(
                f"peak search: no rate tried gave a VALID run under the "
                f"{spec.latency_bound_ms:g} ms bound "
                f"(lowest tried {min(r.requested_qps or 0 for r in runs):.1f} QPS)",
            ),
        )
    return Outcome(best, runs, peak_qps=passed)


SCENARIOS = (
    "online",
    "single-stream",
    "multi-stream",
    "batched",
    "concurrency",
    "constant",
    "replay",
    "piecewise",
    "peak",
    "cold-start",
)


def read_arrivals(path: Path) -> tuple[float, ...]:
    """Inter-arrival times (s) from a replay file (:func:`broker.schedule.replay`)."""
    offsets = schedule.replay(path).offsets_ns
    gaps = np.diff(offsets, prepend=np.int64(0))
    return tuple(float(g) / 1e9 for g in gaps.tolist())


def scenario_spec(path: Path | None, flags: dict[str, Any]) -> ScenarioSpec:
    """A :class:`ScenarioSpec` from a scenario YAML (if any), overridden by ``flags``.

    ``flags`` holds command-line values, None where not given. In the YAML,
    ``concurrency`` means the samples per query for multi-stream and ``schedule_file``
    is read here, relative to the YAML (the job carries the arrivals themselves).
    """
    values: dict[str, Any] = {}
    if path is not None:
        doc = load_manifest(path)
        if not isinstance(doc, ScenarioFile):
            raise ConfigError(f"{path} is a {type(doc).__name__}, not a scenario", file=str(path))
        for key in (
            "qps",
            "duration_s",
            "batch_size",
            "batch_sizes",
            "seed",
            "latency_bound_ms",
            "segments",
            "loadgens",
            "concurrency",
            "repetitions",
            "warm_queries",
        ):
            if getattr(doc, key) is not None:
                values[key] = getattr(doc, key)
        values["name"] = doc.name
        if doc.name == "multi-stream" and doc.concurrency is not None:
            values.setdefault("batch_size", values.pop("concurrency"))
        if doc.schedule_file is not None:
            values["arrivals_s"] = read_arrivals(path.parent / doc.schedule_file)
    values.update({k: v for k, v in flags.items() if v is not None})
    return ScenarioSpec(**values)
