"""Open-loop scenarios: queries follow a schedule fixed before the clock starts, and a
late query counts against the system (latency runs from its scheduled time)."""

from __future__ import annotations

import math

import numpy as np

from broker import schedule
from broker.scenario import Scenario
from broker.schedule import Schedule
from mlscope.contracts import ScenarioSpec
from mlscope.errors import ConfigError

__all__ = ["Constant", "MultiStream", "Online", "Piecewise", "Replay"]


class Online(Scenario):
    """Poisson arrivals at ``qps`` (seeded): MLPerf's server scenario."""

    name = "online"
    poisson = True
    rate_driven = True

    def arrivals(self, spec: ScenarioSpec) -> tuple[Schedule, float]:
        sched = schedule.poisson(spec.qps, duration_s=spec.duration_s, seed=spec.seed)
        return sched, spec.duration_s


class Constant(Scenario):
    """One query every ``1/qps`` s."""

    name = "constant"
    rate_driven = True

    def arrivals(self, spec: ScenarioSpec) -> tuple[Schedule, float]:
        return schedule.constant(spec.qps, duration_s=spec.duration_s), spec.duration_s


class MultiStream(Scenario):
    """``batch_size`` samples per query, one query every ``1/qps`` s."""

    name = "multi-stream"
    rate_driven = True

    def arrivals(self, spec: ScenarioSpec) -> tuple[Schedule, float]:
        count = math.floor(spec.duration_s * spec.qps + 1e-9)
        return schedule.multi_stream(1.0 / spec.qps, spec.batch_size, count), spec.duration_s


class Replay(Scenario):
    """Recorded inter-arrival times (``arrivals_s``, from ``--schedule FILE``)."""

    name = "replay"

    def arrivals(self, spec: ScenarioSpec) -> tuple[Schedule, float]:
        if not spec.arrivals_s:
            raise ConfigError("scenario 'replay' needs arrivals (mlscope-submit --schedule FILE)")
        gaps = np.rint(np.asarray(spec.arrivals_s, dtype=np.float64) * 1e9).astype(np.int64)
        if gaps.size and gaps.min() < 0:
            raise ConfigError("replay inter-arrival times must be >= 0")
        sched = Schedule(np.cumsum(gaps))
        return sched, sched.duration_s


class Piecewise(Scenario):
    """Poisson with a rate that ramps and bursts (``segments``)."""

    name = "piecewise"
    poisson = True

    def arrivals(self, spec: ScenarioSpec) -> tuple[Schedule, float]:
        if not spec.segments:
            raise ConfigError("scenario 'piecewise' needs segments (rate_start, rate_end, s)")
        sched = schedule.piecewise(spec.segments, seed=spec.seed)
        return sched, float(sum(s[2] for s in spec.segments))
