"""Open loops: queries follow a schedule fixed before the clock starts, and a late
query counts against the system (latency runs from its scheduled time)."""

from __future__ import annotations

import math

from mlscope import schedule
from mlscope.scenario_traits import Extent, ScenarioTraits, register

__all__ = ["CONSTANT", "MULTI_STREAM", "ONLINE", "PIECEWISE", "REPLAY"]

ONLINE = register(
    ScenarioTraits(
        name="online",
        summary="Poisson arrivals at qps (seeded): MLPerf's server scenario",
        arrivals=schedule.poisson_arrivals,
        poisson=True,
        rate_driven=True,
        fields=frozenset({"qps", "latency_bound_ms", "loadgens"}),
        requires=("qps",),
        position=0,
    )
)
CONSTANT = register(
    ScenarioTraits(
        name="constant",
        summary="one query every 1/qps s",
        arrivals=schedule.constant_arrivals,
        rate_driven=True,
        fields=frozenset({"qps", "latency_bound_ms", "loadgens"}),
        requires=("qps",),
        position=5,
    )
)
MULTI_STREAM = register(
    ScenarioTraits(
        name="multi-stream",
        summary="batch_size samples per query, one query every 1/qps s",
        arrivals=schedule.multi_stream_arrivals,
        rate_driven=True,
        fields=frozenset({"qps", "batch_size", "latency_bound_ms", "loadgens"}),
        file_aliases=(("concurrency", "batch_size"),),
        position=2,
    )
)
REPLAY = register(
    ScenarioTraits(
        name="replay",
        summary="recorded inter-arrival times (arrivals_s, from --schedule FILE)",
        arrivals=schedule.replay_arrivals,
        fields=frozenset({"arrivals_s", "latency_bound_ms", "loadgens"}),
        requires=("schedule_file",),
        length="its recorded arrivals",
        extent=lambda spec: Extent(math.fsum(spec.arrivals_s or ()), spec.max_queries),
        position=6,
    )
)
PIECEWISE = register(
    ScenarioTraits(
        name="piecewise",
        summary="Poisson with a rate that ramps and bursts (segments)",
        arrivals=schedule.piecewise_arrivals,
        poisson=True,
        fields=frozenset({"segments", "latency_bound_ms", "loadgens"}),
        requires=("segments",),
        length="its segments' seconds",
        extent=lambda spec: Extent(
            math.fsum(seconds for _, _, seconds in spec.segments or ()), spec.max_queries
        ),
        position=7,
    )
)
