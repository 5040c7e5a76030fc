"""``cold-start``: the model unloaded and loaded again ``repetitions`` times, each load
followed by ``warm_queries`` closed-loop queries (the server's strategy:
``broker/scenario_kinds/cold_start.py``)."""

from __future__ import annotations

from mlscope.scenario_traits import Extent, ScenarioTraits, register

__all__ = ["COLD_START"]

COLD_START = register(
    ScenarioTraits(
        name="cold-start",
        summary="repetitions x (reload the model, warm_queries): load and first inference "
        "apart from warm inference",
        local=False,  # the server reloads the model between its runs
        fields=frozenset({"repetitions", "warm_queries"}),
        length="repetitions x warm_queries",
        extent=lambda spec: Extent(queries=spec.warm_queries),  # each reload's run
        ignores=(
            ("max_queries", "each load is followed by warm_queries queries"),
            ("warmup_queries", "each load's first inference is measured apart"),
            *(
                (f, "its verdict is whether every load happened and no query failed")
                for f in ("min_duration_s", "min_queries", "latency_bound_ms", "max_issue_lag_us")
            ),
        ),
        position=9,
    )
)
