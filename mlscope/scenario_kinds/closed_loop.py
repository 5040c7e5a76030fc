"""Closed loops: a fixed number of queries outstanding, the next one sent when one is
answered."""

from __future__ import annotations

from mlscope.scenario_traits import ScenarioTraits, register

__all__ = ["CONCURRENCY", "SINGLE_STREAM"]

SINGLE_STREAM = register(
    ScenarioTraits(
        name="single-stream",
        summary="one query outstanding (MLPerf single-stream; its verdict targets p90)",
        concurrency=1,
        percentile=90.0,  # MLPerf single-stream's target
        position=1,
    )
)
CONCURRENCY = register(
    ScenarioTraits(
        name="concurrency",
        summary="concurrency queries outstanding",
        fields=frozenset({"concurrency"}),
        requires=("concurrency",),
        position=4,
    )
)
