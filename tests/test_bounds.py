"""Bounds on what a message may ask for, checked where it is read: ids short enough to
be subject tokens, rates, durations and depths a run can hold, schedules refused
before anything is drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agent.service import Agent, AgentConfig
from broker.lgservice import LoadgenService, default_id
from mlscope import names
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.contracts import (
    MAX_ID_CHARS,
    MAX_SCHEDULED_QUERIES,
    JobRequest,
    LoadgenLoadOp,
    LoadgenStartOp,
    MLPerfFetchOp,
    MLPerfSpec,
    PrepareOp,
    RunOp,
    SamplesLoadOp,
    SamplesUnloadOp,
    ScenarioSpec,
)
from mlscope.errors import ConfigError
from mlscope.replay_file import replay
from mlscope.schedule import build_schedule, constant, poisson
from mlscope.settings import Settings


def test_a_long_value_is_a_bounded_token_and_distinct_ones_stay_distinct() -> None:
    assert names.token("ev-1f3a9c2b7d4e") == "ev-1f3a9c2b7d4e"  # short ids unchanged
    assert names.token("a.b*c>") == "a_b_c_"
    a, b = "x" * 5000 + "a", "x" * 5000 + "b"
    assert len(names.token(a)) == names.TOKEN_MAX_CHARS
    assert names.token(a) != names.token(b)
    assert names.token(a) == names.token(a)
    assert len(names.job_events("j" * 100_000)) < 200
    assert names.token("\ud800" * 200)  # a lone surrogate hashes too


@pytest.mark.parametrize(
    ("model", "fields"),
    [
        (JobRequest, {"model": "m", "framework": "f", "job_id": "j" * (MAX_ID_CHARS + 1)}),
        (JobRequest, {"model": "m", "framework": "f", "agent_id": "a" * 5000}),
        (PrepareOp, {"evaluation_id": "e" * 8000, "model": "m", "model_version": "1"}),
        (RunOp, {"evaluation_id": "ev", "scenario": ScenarioSpec(), "max_bytes": 1 << 40}),
        (ScenarioSpec, {"qps": float("inf")}),
        (ScenarioSpec, {"qps": float("nan")}),
        (ScenarioSpec, {"qps": 1e9}),
        (ScenarioSpec, {"duration_s": 1e300}),
        (ScenarioSpec, {"concurrency": 2**31 - 1}),
        (ScenarioSpec, {"batch_size": 10**9}),
        (ScenarioSpec, {"batch_sizes": [1, 10**9]}),
        (ScenarioSpec, {"batch_sizes": list(range(1, 1000))}),
        (ScenarioSpec, {"loadgens": 100_000}),
        (ScenarioSpec, {"max_outstanding": 10**12}),
        # the verdict holds a bound in whole ns: an infinite one failed the job once run
        (ScenarioSpec, {"latency_bound_ms": float("inf")}),
        (ScenarioSpec, {"latency_bound_ms": float("nan")}),
        (ScenarioSpec, {"max_issue_lag_us": float("inf")}),
        (MLPerfSpec, {"scenario": "Server", "target_qps": 1e12}),
        (MLPerfSpec, {"scenario": "Offline", "window": 10**9}),
        # an agent indexes its data set with int64: a larger index failed as a service error
        (SamplesLoadOp, {"evaluation_id": "e", "indices": [2**64 - 1]}),
        (SamplesUnloadOp, {"evaluation_id": "e", "indices": [2**63]}),
        (
            PrepareOp,
            {"evaluation_id": "e", "model": "m", "model_version": "1", "batch_size": 2**40},
        ),
        (PrepareOp, {"evaluation_id": "e", "model": "m", "model_version": "1", "max_batch": 2**40}),
        (MLPerfFetchOp, {"evaluation_id": "e", "name": "log", "offset": 2**64 - 1}),
    ],
)
def test_what_no_run_could_hold_is_refused_by_the_contract(
    model: Any, fields: dict[str, Any]
) -> None:
    with pytest.raises(ValidationError):
        model(**fields)


def test_the_largest_ids_the_contract_takes_still_make_short_subjects() -> None:
    job = JobRequest(model="m", framework="f", job_id="j" * MAX_ID_CHARS)
    assert len(names.job_events(job.job_id)) <= names.TOKEN_MAX_CHARS + 20


def test_a_schedule_too_long_for_a_run_is_refused_before_it_is_drawn() -> None:
    with pytest.raises(ValidationError, match="queries"):  # 6e11 arrivals, cut only after
        ScenarioSpec(name="online", qps=1e6, duration_s=7 * 24 * 3600, max_queries=10)
    closed = ScenarioSpec(name="concurrency", qps=1e6, duration_s=7 * 24 * 3600)
    assert closed.duration_s == 7 * 24 * 3600  # a closed loop's qps is not its rate
    spec = ScenarioSpec.model_construct(  # past the contract (a spec built in code)
        **{**ScenarioSpec().model_dump(), "qps": 1e6, "duration_s": 1e5, "max_queries": 10}
    )
    with pytest.raises(ConfigError, match="queries"):
        build_schedule(spec)  # the builder's own bound holds too
    with pytest.raises(ConfigError):
        poisson(1e6, n=MAX_SCHEDULED_QUERIES + 1)
    with pytest.raises(ConfigError):
        constant(1e6, duration_s=1e5)
    # the bound is not below what runs are made of: a 30-minute soak at 10,000 QPS
    assert MAX_SCHEDULED_QUERIES > 10_000 * 1800
    assert len(build_schedule(ScenarioSpec(name="online", qps=1000, duration_s=2))[0]) > 1500


@pytest.mark.parametrize("agent_id", ["bad.id", "a" * 300, "", "wild*card"])
def test_an_agent_id_that_is_not_its_own_subject_token_is_refused_at_start(
    agent_id: str, tmp_path: Path
) -> None:
    catalog = Catalog.load(default_manifest_dirs())
    settings = Settings(nats_url="nats://127.0.0.1:1", data_dir=tmp_path)
    with pytest.raises(ConfigError, match="agent id"):
        Agent(settings, AgentConfig(framework="noop", agent_id=agent_id), catalog)
    ok = Agent(settings, AgentConfig(framework="noop", agent_id="edge-7_b"), catalog)
    assert ok.agent_id == "edge-7_b"


@pytest.mark.parametrize("loadgen_id", ["bad.id", "a" * 300, "", "wild*card"])
def test_a_load_generator_id_that_is_not_its_own_subject_token_is_refused(
    loadgen_id: str, tmp_path: Path
) -> None:
    settings = Settings(nats_url="nats://127.0.0.1:1", data_dir=tmp_path)
    with pytest.raises(ConfigError, match="load generator id"):
        LoadgenService(settings, loadgen_id=loadgen_id)
    assert LoadgenService(settings, loadgen_id="lg-7_b").loadgen_id == "lg-7_b"
    assert names.token(default_id(settings)) == default_id(settings)


@pytest.mark.parametrize(
    "fields",
    [
        {"arrivals_s": (9e9, 9e9)},
        {"arrivals_s": (1e6,)},
        {"arrivals_s": (0.1, float("nan"))},
        {"arrivals_s": (0.1, -0.1)},
        {"segments": ((1e-6, 1e-6, 1e12),)},
        {"segments": ((1e9, 1.0, 1.0),)},
        {"segments": ((1.0, 1.0, float("inf")),)},
        {"segments": tuple((1.0, 1.0, 1.0) for _ in range(20_000))},
    ],
)
def test_replayed_and_piecewise_schedules_stay_within_a_run(fields: dict[str, Any]) -> None:
    """A job on the bus is checked as a file is: no schedule past the longest run."""
    with pytest.raises(ValidationError):
        ScenarioSpec(name="replay" if "arrivals_s" in fields else "piecewise", **fields)


@pytest.mark.parametrize("text", ["0.1\n1e300\n", "0.1\n1e12\n", "inf\n", "9e5\n" * 1000])
def test_a_replay_file_past_the_longest_run_is_refused_with_its_line(
    tmp_path: Path, text: str
) -> None:
    path = tmp_path / "arrivals.txt"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"arrivals\.txt:\d+"):
        replay(path)


@pytest.mark.parametrize(
    "subject", ["mlscope.agent.a.query\r\nPUB x 1", "a b", "", "t\u00e9", "a" * 300]
)
def test_a_subject_a_message_names_is_one_protocol_token(subject: str) -> None:
    """A load generator writes the subject into its own protocol lines: a space or a
    line break would inject commands on its connection."""
    spec = ScenarioSpec(name="online", qps=10, duration_s=1).model_dump()
    fields = {"run_id": "r", "evaluation_id": "e", "spec": spec, "offset_ns": 0}
    fields |= {"trace_level": 0, "has_labels": False, "slice_object": "o"}
    assert LoadgenLoadOp.model_validate({**fields, "subject": "mlscope.agent.a-1_b.query"})
    with pytest.raises(ValidationError):
        LoadgenLoadOp.model_validate({**fields, "subject": subject})
    with pytest.raises(ValidationError):
        LoadgenStartOp(run_id="r", start_ns=0, result_object="o", progress_subject=subject)


def test_a_query_over_the_payload_is_refused_without_building_it() -> None:
    """A manifest's input shape sets a query's size: one whose raw inputs alone are over
    the bus's max payload is refused by arithmetic (3M floats per sample, 64 fill rows:
    the old measurement built 2.3 GB to refuse it); one that may fit is measured."""
    import tracemalloc

    import numpy as np

    from broker.evalprep import check_query_size

    spec = ScenarioSpec(batch_size=4)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match="is at least 48000000 bytes, over") as err:
            check_query_size(None, (3_000_000,), spec, 1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20 and err.value.fields["bytes"] == 48_000_000
    assert "the largest batch size that fits is about 0" in err.value.message
    rows = (np.zeros((10, 28, 28), np.float32), np.zeros(10, np.int64))
    check_query_size(rows, (28, 28), ScenarioSpec(batch_size=300), 1 << 20)  # measured: fits
    with pytest.raises(ConfigError, match=r"batch size 300 is at least 940800 bytes") as err:
        check_query_size(rows, (28, 28), ScenarioSpec(batch_size=300), 1 << 19)
    assert "the largest batch size that fits is about 166" in err.value.message
