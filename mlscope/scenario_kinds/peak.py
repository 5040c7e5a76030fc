"""``peak``: the highest Poisson rate whose runs meet the latency bound (MLPerf's
find-peak-performance; the server's search: ``broker/scenario_kinds/peak.py``)."""

from __future__ import annotations

from typing import Any

from mlscope import schedule
from mlscope.scenario_traits import ScenarioTraits, register

__all__ = ["PEAK"]


def _trials(spec: Any) -> int:
    return int(spec.peak_trials)


PEAK = register(
    ScenarioTraits(
        name="peak",
        summary="binary search of the highest Poisson rate whose p99 meets latency_bound_ms",
        arrivals=schedule.poisson_arrivals,
        poisson=True,
        rate_driven=True,
        fields=frozenset({"qps", "latency_bound_ms", "peak_trials", "loadgens"}),
        runs=_trials,
        position=8,
    )
)
