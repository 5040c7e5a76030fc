"""The scenario registry: every scenario declared once by its traits
(mlscope/scenario_kinds), found without a list, and run by the server's strategy
(broker/scenario_kinds) or, in the agent, from the same traits."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from broker.scenario import Scenario
from broker.scenario_kinds import STRATEGIES, get, registry
from broker.scenarios import build_schedule
from mlscope import scenario_traits, schedule
from mlscope.contracts import JobRequest, ScenarioSpec
from mlscope.errors import ConfigError
from mlscope.jobs import time_limit
from mlscope.scenario_traits import ScenarioTraits

BUILT_IN = (
    "online",
    "single-stream",
    "multi-stream",
    "batched",
    "concurrency",
    "constant",
    "replay",
    "piecewise",
    "peak",
    "cold-start",
)


def test_every_declared_scenario_has_its_strategy_in_listing_order() -> None:
    assert scenario_traits.names()[: len(BUILT_IN)] == BUILT_IN
    for name, scenario in registry().items():
        assert scenario.name == name and isinstance(scenario, Scenario)
    assert set(STRATEGIES) == {"batched", "peak", "cold-start"}  # the runs of several runs
    assert type(get("online")) is Scenario


def test_the_contract_and_its_schema_list_the_registry() -> None:
    schema = ScenarioSpec.model_json_schema()["properties"]["name"]
    assert tuple(schema["enum"]) == scenario_traits.names()
    with pytest.raises(ValueError, match=r"unknown scenario 'bogus' \(known: online, "):
        ScenarioSpec(name="bogus")
    with pytest.raises(ValueError, match="at most 64 characters"):
        ScenarioSpec(name="x" * 10_000)


@pytest.mark.parametrize("name", ["online", "constant", "multi-stream", "peak"])
def test_open_loops_build_their_schedule(name: str) -> None:
    spec = ScenarioSpec(name=name, qps=200, duration_s=2, batch_size=2)
    sched, window = build_schedule(spec)
    assert window == 2 and 300 < len(sched) < 500
    assert not get(name).closed_loop and get(name).requested_qps(spec) == 200


@pytest.mark.parametrize("name", ["single-stream", "concurrency", "batched", "cold-start"])
def test_closed_loops_and_multi_run_scenarios_have_no_schedule(name: str) -> None:
    with pytest.raises(ConfigError, match="no open-loop schedule"):
        build_schedule(ScenarioSpec(name=name))
    assert get(name).requested_qps(ScenarioSpec(name=name, qps=9)) is None


def test_single_stream_runs_one_outstanding() -> None:
    spec = ScenarioSpec(name="single-stream", concurrency=4)
    assert get("single-stream").adjust(spec).concurrency == 1
    assert scenario_traits.get("single-stream").depth(4, local=True) == 1


def test_a_batched_run_in_the_agent_keeps_batches_in_flight() -> None:
    traits = scenario_traits.get("batched")
    assert traits.depth(1) == 1 and traits.depth(1, local=True) == 3
    assert traits.depth(8, local=True) == 8


def test_max_queries_cuts_every_open_loop() -> None:
    spec = ScenarioSpec(name="constant", qps=100, duration_s=5, max_queries=7)
    sched, window = build_schedule(spec)
    assert len(sched) == 7 and window == sched.duration_s


def test_an_unknown_name_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown scenario 'bursty'.*online"):
        get("bursty")


def test_a_job_time_limit_counts_the_runs_a_scenario_makes() -> None:
    def limit(**scenario: Any) -> float:
        return time_limit(JobRequest(model="m", framework="f", scenario=ScenarioSpec(**scenario)))

    one = limit(name="online", duration_s=10)
    assert limit(name="peak", duration_s=10, peak_trials=4) - 360 == 4 * (one - 360)
    assert limit(name="batched", duration_s=10, batch_sizes=(1, 2, 4)) - 360 == 3 * (one - 360)


@pytest.mark.parametrize(
    ("spec", "seconds"),
    [
        (ScenarioSpec(name="online", qps=50, duration_s=7), 7.0),
        (ScenarioSpec(name="replay", arrivals_s=(0.5, 1.25, 2.0)), 3.75),
        (ScenarioSpec(name="piecewise", segments=((10, 50, 2.0), (50, 50, 3.5))), 5.5),
    ],
)
def test_an_open_loop_extent_is_its_schedule_window(spec: ScenarioSpec, seconds: float) -> None:
    extent = scenario_traits.get(spec.name).extent(spec)
    assert extent.seconds == seconds == build_schedule(spec)[1]
    assert extent.fraction(0, seconds / 2) == 0.5  # not against the default 10 s


def test_an_extent_ends_at_whichever_limit_comes_first() -> None:
    timed = scenario_traits.get("single-stream").extent(
        ScenarioSpec(name="single-stream", duration_s=20, max_queries=100)
    )
    assert timed.fraction(50, 1.0) == 0.5 and timed.fraction(10, 15.0) == 0.75
    assert timed.fraction(500, 99.0) == 1.0
    cold = scenario_traits.get("cold-start").extent(
        ScenarioSpec(name="cold-start", repetitions=3, warm_queries=40)
    )
    assert cold.seconds is None and cold.fraction(10, 55.0) == 0.25  # each reload's run
    assert scenario_traits.Extent().fraction(10, 1.0) is None


def test_a_cold_start_cannot_run_in_the_agent() -> None:
    spec = ScenarioSpec(name="cold-start")
    with pytest.raises(ValueError, match="'cold-start' cannot run with placement agent"):
        JobRequest(model="m", framework="f", scenario=spec, placement="agent")


def _surge(spec: ScenarioSpec) -> tuple[schedule.Schedule, float]:
    return schedule.constant(2 * spec.qps, duration_s=spec.duration_s), spec.duration_s


SURGE = ScenarioTraits(
    name="surge", summary="twice qps, periodic", arrivals=_surge, rate_driven=True
)


def test_a_scenario_registered_at_run_time_is_known_everywhere_until_removed() -> None:
    with scenario_traits.registered(SURGE):
        spec = ScenarioSpec(name="surge", qps=50, duration_s=2)
        sched, window = build_schedule(spec)
        assert len(sched) == 200 and window == 2
        assert get("surge").requested_qps(spec) == 50 and type(get("surge")) is Scenario
        assert "surge" in ScenarioSpec.model_json_schema()["properties"]["name"]["enum"]
        with pytest.raises(ConfigError, match="registered twice"):
            scenario_traits.register(ScenarioTraits(name="surge", summary="another"))
    with pytest.raises(ValueError, match="unknown scenario 'surge'"):
        ScenarioSpec(name="surge")


def test_a_module_that_cannot_be_imported_is_named() -> None:
    with pytest.raises(ConfigError, match="'no_such_scenarios' cannot be imported"):
        scenario_traits.load_modules(["no_such_scenarios"])


@pytest.mark.parametrize(
    "spec",
    [
        ScenarioSpec(name="online", qps=200, duration_s=2, seed=5),
        ScenarioSpec(name="peak", qps=150, duration_s=2, seed=1),
        ScenarioSpec(name="constant", qps=100, duration_s=2, max_queries=30),
        ScenarioSpec(name="multi-stream", qps=50, duration_s=2, batch_size=4),
        ScenarioSpec(name="replay", arrivals_s=(0.0, 0.01, 0.02)),
        ScenarioSpec(name="piecewise", segments=((10.0, 100.0, 1.0), (100.0, 10.0, 1.0))),
    ],
    ids=lambda s: s.name,
)
def test_the_agent_and_the_server_share_one_definition_of_arrivals(
    spec: ScenarioSpec,
) -> None:
    """An agent's local run (placement agent) cannot import the broker: it reads a
    spec's arrivals from the traits, as the server's strategy does."""
    from mlscope import schedule as shared

    ours, window = build_schedule(spec)
    theirs, their_window = shared.build_schedule(spec)
    np.testing.assert_array_equal(ours.offsets_ns, theirs.offsets_ns)
    assert ours.samples_per_query == theirs.samples_per_query and window == their_window
