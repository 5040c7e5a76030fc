"""``cold-start``: the model unloaded and loaded again ``repetitions`` times, each load
followed by ``warm_queries`` closed-loop queries (the server's strategy:
``broker/scenario_kinds/cold_start.py``)."""

from __future__ import annotations

from mlscope.scenario_traits import ScenarioTraits, register

__all__ = ["COLD_START"]

COLD_START = register(
    ScenarioTraits(
        name="cold-start",
        summary="repetitions x (reload the model, warm_queries): load and first inference "
        "apart from warm inference",
        local=False,  # the server reloads the model between its runs
        fields=frozenset({"repetitions", "warm_queries"}),
        length="repetitions x warm_queries",
        position=9,
    )
)
