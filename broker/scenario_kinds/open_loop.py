"""Open-loop scenarios: queries follow a schedule fixed before the clock starts, and a
late query counts against the system (latency runs from its scheduled time). Their
arrivals are defined in :mod:`mlscope.schedule` (the agent's local run uses them too)."""

from __future__ import annotations

from broker.scenario import Scenario
from mlscope import schedule
from mlscope.contracts import ScenarioSpec
from mlscope.schedule import Schedule

__all__ = ["Constant", "MultiStream", "Online", "Piecewise", "Replay"]


class Online(Scenario):
    """Poisson arrivals at ``qps`` (seeded): MLPerf's server scenario."""

    name = "online"
    poisson = True
    rate_driven = True

    def arrivals(self, spec: ScenarioSpec) -> tuple[Schedule, float]:
        return schedule.poisson_arrivals(spec)


class Constant(Scenario):
    """One query every ``1/qps`` s."""

    name = "constant"
    rate_driven = True

    def arrivals(self, spec: ScenarioSpec) -> tuple[Schedule, float]:
        return schedule.constant_arrivals(spec)


class MultiStream(Scenario):
    """``batch_size`` samples per query, one query every ``1/qps`` s."""

    name = "multi-stream"
    rate_driven = True

    def arrivals(self, spec: ScenarioSpec) -> tuple[Schedule, float]:
        return schedule.multi_stream_arrivals(spec)


class Replay(Scenario):
    """Recorded inter-arrival times (``arrivals_s``, from ``--schedule FILE``)."""

    name = "replay"

    def arrivals(self, spec: ScenarioSpec) -> tuple[Schedule, float]:
        return schedule.replay_arrivals(spec)


class Piecewise(Scenario):
    """Poisson with a rate that ramps and bursts (``segments``)."""

    name = "piecewise"
    poisson = True

    def arrivals(self, spec: ScenarioSpec) -> tuple[Schedule, float]:
        return schedule.piecewise_arrivals(spec)
