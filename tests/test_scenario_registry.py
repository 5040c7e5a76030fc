"""The scenario registry (broker/scenario_kinds): one strategy per name a job may ask
for, and a new scenario is one small class (the documented example, built here)."""

from __future__ import annotations

from typing import get_args

import numpy as np
import pytest

from broker import schedule
from broker.scenario import Scenario
from broker.scenario_kinds import REGISTRY, get
from broker.scenarios import SCENARIOS, build_schedule
from broker.schedule import Schedule
from mlscope.contracts import ScenarioName, ScenarioSpec
from mlscope.errors import ConfigError


def test_every_name_a_job_may_ask_for_has_its_strategy() -> None:
    assert set(REGISTRY) == set(get_args(ScenarioName))
    assert tuple(REGISTRY) == SCENARIOS
    for name, scenario in REGISTRY.items():
        assert scenario.name == name and isinstance(scenario, Scenario)


@pytest.mark.parametrize("name", ["online", "constant", "multi-stream", "peak"])
def test_open_loops_build_their_schedule(name: ScenarioName) -> None:
    spec = ScenarioSpec(name=name, qps=200, duration_s=2, batch_size=2)
    sched, window = build_schedule(spec)
    assert window == 2 and 300 < len(sched) < 500
    assert not REGISTRY[name].closed_loop and REGISTRY[name].requested_qps(spec) == 200


@pytest.mark.parametrize("name", ["single-stream", "concurrency", "batched", "cold-start"])
def test_closed_loops_and_multi_run_scenarios_have_no_schedule(name: ScenarioName) -> None:
    with pytest.raises(ConfigError, match="no open-loop schedule"):
        build_schedule(ScenarioSpec(name=name))
    assert REGISTRY[name].requested_qps(ScenarioSpec(name=name, qps=9)) is None


def test_single_stream_runs_one_outstanding() -> None:
    spec = ScenarioSpec(name="single-stream", concurrency=4)
    assert REGISTRY["single-stream"].adjust(spec).concurrency == 1


def test_max_queries_cuts_every_open_loop() -> None:
    spec = ScenarioSpec(name="constant", qps=100, duration_s=5, max_queries=7)
    sched, window = build_schedule(spec)
    assert len(sched) == 7 and window == sched.duration_s


def test_an_unknown_name_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown scenario 'burst'.*online"):
        get("burst")


class Burst(Scenario):
    """The example of broker/scenario_kinds/__init__.py, as written there."""

    name = "burst"
    poisson = True
    rate_driven = True

    def arrivals(self, spec: ScenarioSpec) -> tuple[Schedule, float]:
        third = spec.duration_s / 3
        segments = (
            (spec.qps, spec.qps, third),
            (2 * spec.qps, 2 * spec.qps, third),
            (spec.qps, spec.qps, third),
        )
        return schedule.piecewise(segments, seed=spec.seed), spec.duration_s


def test_a_new_scenario_is_one_small_class() -> None:
    spec = ScenarioSpec(name="online", qps=300, duration_s=6, seed=3)
    sched, window = Burst().schedule(spec)
    assert window == 6
    t = sched.offsets_ns / 1e9
    per_third = np.histogram(t, bins=[0, 2, 4, 6])[0]
    assert per_third[1] > 1.6 * per_third[0] and per_third[1] > 1.6 * per_third[2]


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
def test_the_agent_and_the_registry_share_one_definition_of_arrivals(
    spec: ScenarioSpec,
) -> None:
    """An agent's local run (placement agent) cannot import the broker: it reads a
    spec's arrivals from mlscope.schedule, which the registry's open loops call."""
    from mlscope import schedule as shared

    assert set(shared.ARRIVALS) == {n for n, s in REGISTRY.items() if not s.closed_loop} - {
        "cold-start"
    }
    ours, window = build_schedule(spec)
    theirs, their_window = shared.build_schedule(spec)
    np.testing.assert_array_equal(ours.offsets_ns, theirs.offsets_ns)
    assert ours.samples_per_query == theirs.samples_per_query and window == their_window
