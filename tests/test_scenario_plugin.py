"""A scenario added without touching mlscope: ``tests/scenario_burst.py`` is the whole
of it (docs/ARCHITECTURE.md, "Adding a scenario"). Named in MLSCOPE_SCENARIO_MODULES,
it runs end to end on a real stack (nats-server, server and noop agent as child
processes), from the Python API, from ``mlscope-submit`` and in the agent."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import remote, scenario_traits
from mlscope.contracts import EvaluationSummary, JobRequest, ScenarioSpec
from mlscope.jobs import submit
from mlscope.schedule import build_schedule
from mlscope.settings import Settings
from tests.conftest import LOOSE, child_env, python, running_stack

pytestmark = pytest.mark.timeout(240)

MODULE = "tests.scenario_burst"


@pytest.fixture(scope="module")
def burst_stack(
    tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path
) -> Iterator[tuple[Stack, Settings]]:
    """A noop stack whose processes import the burst module, and this process too
    (the submitter's side); the registry forgets it afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLSCOPE_SCENARIO_MODULES", MODULE)
        try:
            scenario_traits.load_modules(Settings.from_env().scenario_modules)
            with running_stack(tmp_path_factory.mktemp("burst"), zoo_dir, ["noop"]) as s:
                yield s, s.settings.with_(scenario_modules=(MODULE,))
        finally:
            scenario_traits.unregister("burst")
            sys.modules.pop(MODULE, None)


def run(settings: Settings, job: JobRequest) -> EvaluationSummary:
    return anyio.run(lambda: submit(settings, job, timeout=180), backend="asyncio")


def scheduled(settings: Settings, evaluation_id: str) -> np.ndarray:
    """The stored scheduled offsets (ns) of a run, in query order."""

    async def go() -> list[list[Any]]:
        async with busmod.connect(settings, name="test") as bus:
            return (
                await remote.sql(
                    bus,
                    "SELECT scheduled_ns FROM queries FINAL WHERE evaluation_id = {e:String} "
                    "ORDER BY query_index",
                    {"e": evaluation_id},
                )
            )[1]

    return np.asarray(anyio.run(go, backend="asyncio"), dtype=np.int64).ravel()


def burst(**placement: Any) -> JobRequest:
    spec = ScenarioSpec(name="burst", qps=250, duration_s=3, seed=4, **LOOSE)
    return JobRequest(
        model="noop", framework="noop", scenario=spec, trace_level="none", **placement
    )


@pytest.mark.parametrize("placement", ["server", "agent"])
def test_a_plugged_in_scenario_runs_on_the_stack(
    burst_stack: tuple[Stack, Settings], placement: str
) -> None:
    """The server runs it with the generic strategy and the agent builds its schedule
    locally: each from the one declaration, in its own process."""
    _, settings = burst_stack
    job = burst(placement=placement)
    s = run(settings, job)
    expected, window = build_schedule(job.scenario)
    assert s.valid, s.invalid_reasons
    assert s.scenario["name"] == "burst" and s.placement == placement
    assert s.queries == len(expected) and s.errors == 0 and s.not_issued == 0
    assert s.requested_qps is None  # not rate-driven, as declared
    offsets = scheduled(settings, s.evaluation_id)
    np.testing.assert_array_equal(offsets, expected.offsets_ns)
    thirds = np.histogram(offsets / 1e9, bins=[0, window / 3, 2 * window / 3, window])[0]
    assert thirds[1] > 1.5 * thirds[0] and thirds[1] > 1.5 * thirds[2], thirds


def test_mlscope_submit_offers_and_runs_it(burst_stack: tuple[Stack, Settings]) -> None:
    _, settings = burst_stack
    env = child_env(settings)
    usage = subprocess.run(
        [python(), "-m", "cli.submit", "--help"], env=env, capture_output=True, text=True
    )
    assert "burst" in usage.stdout and "twice qps" in usage.stdout
    out = subprocess.run(
        [
            *(python(), "-m", "cli.submit", "noop", "--framework", "noop"),
            *("--scenario", "burst", "--qps", "300", "--duration", "2", "--json"),
            *("--min-duration", "0", "--min-queries", "1", "--trace-level", "none"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["scenario"]["name"] == "burst" and doc["queries"] > 0


def test_an_unregistered_name_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown scenario 'bursty' \(known: online, "):
        ScenarioSpec(name="bursty")
