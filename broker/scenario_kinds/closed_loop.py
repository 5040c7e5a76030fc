"""Closed-loop scenarios: a fixed number of queries outstanding, the next one sent when
one is answered."""

from __future__ import annotations

from broker.scenario import Scenario
from mlscope.contracts import ScenarioSpec

__all__ = ["Concurrency", "SingleStream"]


class SingleStream(Scenario):
    """One query outstanding (MLPerf single-stream; its verdict targets p90)."""

    name = "single-stream"
    closed_loop = True
    percentile = 90.0  # MLPerf single-stream's target

    def adjust(self, spec: ScenarioSpec) -> ScenarioSpec:
        return spec.model_copy(update={"concurrency": 1})


class Concurrency(Scenario):
    """``concurrency`` queries outstanding."""

    name = "concurrency"
    closed_loop = True
