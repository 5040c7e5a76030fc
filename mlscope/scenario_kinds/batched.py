"""``batched``: a closed-loop sweep of batch sizes; the highest throughput wins (the
server's strategy: ``broker/scenario_kinds/batched.py``)."""

from __future__ import annotations

from typing import Any

from mlscope.scenario_traits import ScenarioTraits, register

__all__ = ["BATCHED", "LOCAL_DEPTH"]

LOCAL_DEPTH = 3
"""Batches kept in flight by a ``batched`` run in the agent whose samples are
pre-processed per query: one predicted, one pre-processed, one waiting, so the runtime
never waits for the next batch (MLPerf Offline's intent). On samples held
pre-processed it runs as a stream instead (``local_stream``)."""


def _points(spec: Any) -> int:
    return len(spec.batch_sizes or (1,))


BATCHED = register(
    ScenarioTraits(
        name="batched",
        summary="a sweep of batch_sizes, closed loop at each: max throughput and the "
        "optimal batch size",
        local_depth=LOCAL_DEPTH,
        local_stream=True,
        placement="agent",  # max throughput is the model's, not the bus's
        early_stopping=False,  # a throughput sweep (MLPerf offline) has no latency target
        fields=frozenset({"batch_sizes", "concurrency"}),
        runs=_points,
        position=3,
    )
)
