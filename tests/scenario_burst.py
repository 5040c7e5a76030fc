"""A scenario declared outside mlscope, as docs/ARCHITECTURE.md's example adds one:
``burst``, Poisson at ``qps`` with the middle third of the run at twice the rate.

Nothing else names it: the processes of a stack learn it from
``MLSCOPE_SCENARIO_MODULES=tests.scenario_burst`` (tests/test_scenario_plugin.py).
"""

from __future__ import annotations

from mlscope import schedule
from mlscope.contracts import ScenarioSpec
from mlscope.scenario_traits import ScenarioTraits, register

__all__ = ["BURST"]


def burst_arrivals(spec: ScenarioSpec) -> tuple[schedule.Schedule, float]:
    """``qps`` Poisson, doubled for the middle third of ``duration_s``."""
    third = spec.duration_s / 3
    rates = (spec.qps, 2 * spec.qps, spec.qps)
    segments = tuple((r, r, third) for r in rates)
    return schedule.piecewise(segments, seed=spec.seed), spec.duration_s


BURST = register(
    ScenarioTraits(
        name="burst",
        summary="Poisson at qps, twice qps for the middle third of the run",
        arrivals=burst_arrivals,
        poisson=True,  # not rate-driven: its mean rate is 4/3 qps, by design
        fields=frozenset({"qps", "latency_bound_ms", "loadgens"}),
        requires=("qps",),
    )
)
