"""What every scenario is made of: the :class:`Scenario` strategy, one run of it
(:func:`run_once`), and what a scenario returns (:class:`Run`, :class:`Outcome`).

A scenario is declared by its traits (:mod:`mlscope.scenario_traits`: its arrivals or
closed-loop depth, its validity rules) and run by a strategy found by name
(:mod:`broker.scenario_kinds`). The base class runs one open- or closed-loop run as the
traits say and judges it; a scenario of more than one run (a sweep, a search, reloads)
subclasses it and overrides ``execute``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import anyio
import numpy as np

from broker import agentrun
from broker.context import Context
from broker.loadgen import Driver
from broker.run import Run
from broker.summary import figures, judge, latency_split
from mlscope import schedule
from mlscope.contracts import ScenarioSpec, run_evaluation_id
from mlscope.errors import ConfigError, EvaluationError
from mlscope.record import RunRecord
from mlscope.scenario_traits import ScenarioTraits
from mlscope.schedule import Schedule
from mlscope.validity import ValidityPolicy, Verdict

__all__ = ["Outcome", "Scenario", "closed_window", "driver", "run_once"]


@dataclass
class Outcome:
    """What a scenario hands the evaluator: its main run and, for several runs, all
    of them (``points``) with what the search or sweep found."""

    main: Run
    points: list[Run] = field(default_factory=list)
    peak_qps: float | None = None
    optimal_batch_size: int | None = None
    extra_reasons: tuple[str, ...] = ()
    cold_start: dict[str, Any] | None = None

    def separate(self, evaluation_id: str) -> list[Run]:
        """The runs stored on their own, each under its own id: those the scenario gave
        one (:meth:`Scenario.run_id`; their queries named it, so their spans are kept
        under it). A scenario of one run, a sweep of one point included, is that run,
        stored once as the evaluation ``evaluation_id``."""
        return [r for r in self.points if r.evaluation_id != evaluation_id]


class Scenario:
    """The server's strategy for one scenario: one open- or closed-loop run, judged,
    as its :class:`~mlscope.scenario_traits.ScenarioTraits` declare. A scenario of
    several runs subclasses it, sets ``kind``, declares how many it makes at most (its
    traits' ``runs``: the agent is prepared for that many) and overrides
    :meth:`execute`, naming each run by :meth:`run_id`."""

    kind: ClassVar[str] = ""
    """The scenario a subclass runs (``broker.scenario_kinds`` finds it by this)."""

    def __init__(self, traits: ScenarioTraits) -> None:
        self.traits = traits

    @property
    def name(self) -> str:
        return self.traits.name

    @property
    def closed_loop(self) -> bool:
        """Keep ``concurrency`` queries outstanding instead of following a schedule."""
        return self.traits.closed_loop

    @property
    def poisson(self) -> bool:
        """Arrivals are Poisson: the verdict allows for the rate's sampling noise."""
        return self.traits.poisson

    def policy(self, base: ValidityPolicy) -> ValidityPolicy:
        """``base`` with this scenario's own validity rules."""
        t = self.traits
        return replace(
            base,
            early_stopping=base.early_stopping and t.early_stopping,
            percentile=t.percentile if t.percentile is not None else base.percentile,
        )

    def refuse(self, spec: ScenarioSpec, base: ValidityPolicy) -> None:
        """Refuse at intake, before an agent is prepared, a ``spec`` this scenario
        cannot give a result for: a :class:`ConfigError` whose ``field`` names what to
        change. One rule for every scenario: a search whose steps follow its runs'
        verdicts (peak) refuses runs that no step could make VALID; a single run, and
        a sweep ranked by throughput (batched), runs and is reported INVALID with its
        reasons (a short run's figures are still figures). The default refuses
        nothing."""

    def requested_qps(self, spec: ScenarioSpec) -> float | None:
        return spec.qps if self.traits.rate_driven else None

    def schedule(self, spec: ScenarioSpec) -> tuple[Schedule, float]:
        """The open-loop schedule of ``spec`` (cut to ``max_queries``) and the window
        (s) the load covers."""
        arrivals = self.traits.arrivals
        if arrivals is None:
            raise ConfigError(f"scenario {self.name!r} has no open-loop schedule")
        sched, window = arrivals(spec)
        return schedule.cut(sched, window, spec.max_queries)

    def adjust(self, spec: ScenarioSpec) -> ScenarioSpec:
        """The spec as this scenario runs it (a fixed depth: single-stream's one)."""
        depth = self.traits.concurrency
        return spec if depth is None else spec.model_copy(update={"concurrency": depth})

    def run_id(self, ctx: Context, spec: ScenarioSpec, k: int) -> str:
        """The id of run ``k`` of ``spec``: ``<evaluation_id>-<k>`` when the spec makes
        more than one run (its traits' ``runs``: what the agent was prepared for,
        :attr:`~mlscope.contracts.PrepareOp.runs`), else the evaluation's own."""
        if self.traits.runs(spec) > 1:
            return run_evaluation_id(ctx.evaluation_id, k)
        return ctx.evaluation_id

    async def execute(self, ctx: Context, spec: ScenarioSpec) -> Outcome:
        """Run ``spec``: one run by default; sweeps, searches and reloads override."""
        return Outcome(await run_once(ctx, self, self.adjust(spec), ctx.evaluation_id))


def driver(
    ctx: Context,
    spec: ScenarioSpec,
    inputs: Callable[[int], np.ndarray],
    labels: Callable[[int], np.ndarray] | None,
    schedule: Schedule | None = None,
) -> Driver:
    """A load-generator Driver for ``spec`` against the context's agent (a closed loop
    without ``schedule``)."""
    return Driver(
        ctx.bus,
        evaluation_id=ctx.query_id,
        subject=ctx.subject,
        spec=spec,
        inputs=inputs,
        labels=labels,
        trace_level=ctx.trace_level,
        offset_ns=ctx.offset_ns,
        on_progress=ctx.on_progress,
        tuning=ctx.tuning,
        schedule=schedule,
    )


async def run_once(ctx: Context, scenario: Scenario, spec: ScenarioSpec, evaluation_id: str) -> Run:
    """One run of an open- or closed-loop scenario (no sweep, no search), judged;
    ``evaluation_id``: the run's (its queries name it; a sweep's point or a search's
    trial has its own, :meth:`Scenario.run_id`)."""
    ctx = ctx.for_run(evaluation_id)
    # A run of several under its own id is tracked, for what a cancel stores.
    tracked = ctx.runs if ctx.run_id is not None else None
    if tracked is not None:
        tracked.begin(evaluation_id, spec, scenario.requested_qps(spec))
    inputs, labels = ctx.feeders(spec.batch_size)
    why: tuple[str, ...] = ()
    closed = scenario.closed_loop
    if ctx.placement == "agent":  # the agent generates the load itself
        if ctx.agent is None:
            raise EvaluationError("a placement-agent run needs its agent's description")
        # How long the load lasts: a replay's or a ramp's own window, not duration_s
        # (drawn off the event loop: a long schedule takes seconds).
        load_s = (
            spec.duration_s
            if closed
            else (await anyio.to_thread.run_sync(scenario.schedule, spec))[1]
        )
        rec, why = await agentrun.drive(
            ctx.bus,
            agent=ctx.agent,
            evaluation_id=ctx.evaluation_id,
            run_id=ctx.run_id,
            spec=spec,
            load_s=load_s,
            trace_level=ctx.trace_level,
            offset_ns=ctx.offset_ns,
            labels=labels,
            on_progress=ctx.on_progress,
        )
        window = closed_window(rec, spec) if closed else load_s
    elif closed:
        rec = await driver(ctx, spec, inputs, labels).run()
        window = closed_window(rec, spec)
    else:
        # Off the event loop: a long schedule takes seconds to draw.
        sched, window = await anyio.to_thread.run_sync(scenario.schedule, spec)
        if spec.loadgen_hosts:
            from broker.multihost import run_on_services  # load generators on the bus

            rec = await run_on_services(ctx, spec, sched, inputs, labels)
        elif spec.loadgens > 1:
            from broker.distributed import run_dealt  # starts processes: loaded on use

            rec = await run_dealt(ctx, spec, sched, inputs, labels)
        else:
            rec = await driver(ctx, spec, inputs, labels, sched).run()
    rec.warmup = min(spec.warmup_queries, rec.n)
    requested = scenario.requested_qps(spec)
    verdict = judge(
        rec,
        spec,
        scenario.policy(ctx.policy),
        window_s=window,
        requested_rate=requested,
        poisson=scenario.poisson,
        open_loop=not closed,
    )
    if why:  # the agent's own account of a local run that went wrong
        verdict = Verdict(valid=False, reasons=(*verdict.reasons, *why))
    fig = figures(rec, has_labels=labels is not None, window_s=None if closed else window)
    run = Run(evaluation_id, spec, rec, fig, verdict, latency_split(rec), requested)
    if tracked is not None:
        tracked.end(run)
    return run


def closed_window(rec: RunRecord, spec: ScenarioSpec) -> float:
    """A closed loop's window (s): until its last completion, and at least until it
    found its duration up. Its last answer can come just before that: a stream whose
    last block was answered then, a single stream whose last answer was stamped a few
    µs before the next query found the time up. Such a run lasted its duration and is
    not too short. The time-up moment counts at most up to the duration (an agent's
    claim of a later one proves no more)."""
    done = rec.completed[rec.completed > 0]
    last = int(done.max()) if done.size else 0
    return max(last, min(rec.time_up_ns, int(spec.duration_s * 1e9))) / 1e9
