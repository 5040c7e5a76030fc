"""The job that reproduces a stored evaluation (:mod:`mlscope.reproduce`), as
``mlscope rerun`` builds it (:func:`cli.rerun_cmd.rerun_job`) and the dashboard's Run
page prefills it: a job's own evaluation runs that job again; one run of a sweep or
search runs that run's point alone."""

from __future__ import annotations

from typing import Any

import pytest

from cli.rerun_cmd import rerun_job
from mlscope import scenario_traits
from mlscope.contracts import JobRequest, ScenarioSpec, evaluation_id_for, run_evaluation_id
from mlscope.errors import EvaluationError
from mlscope.reproduce import evaluation_job, is_run_of

SWEEP = ScenarioSpec(name="batched", batch_sizes=(1, 8, 32), duration_s=0.3, seed=7)
PEAK = ScenarioSpec(name="peak", qps=50, latency_bound_ms=20, peak_trials=6, seed=3)


def _job(scenario: ScenarioSpec) -> JobRequest:
    return JobRequest(model="digits_cnn", framework="onnxruntime", scenario=scenario)


def _stored(job: JobRequest) -> dict[str, Any]:
    return {"job": job.dump(), "manifest": {"name": "digits_cnn", "version": "1"}}


def test_a_sweeps_run_is_its_own_point_alone() -> None:
    job = _job(SWEEP)
    parent = evaluation_id_for(job.job_id)
    assert evaluation_job(job, parent, None) == job  # the sweep itself: the whole job
    run = run_evaluation_id(parent, 1)
    point = SWEEP.model_copy(update={"batch_size": 8}).model_dump()  # what the run ran
    one = evaluation_job(job, run, point).scenario
    assert one.name == "batched" and one.batch_size == 8 and one.batch_sizes is None
    assert scenario_traits.get(one.name).runs(one) == 1
    assert (one.duration_s, one.seed) == (0.3, 7)  # the rest of the job's scenario kept


def test_rerun_of_a_sweeps_run_runs_that_run_alone() -> None:
    job = _job(SWEEP)
    run = run_evaluation_id(evaluation_id_for(job.job_id), 2)
    point = SWEEP.model_copy(update={"batch_size": 32}).model_dump()
    again = rerun_job(_stored(job), run, point=point)
    assert again.scenario.batch_size == 32 and again.scenario.batch_sizes is None
    assert again.rerun_of == run and again.job_id != job.job_id
    whole = rerun_job(_stored(job), evaluation_id_for(job.job_id), point=point)
    assert whole.scenario == SWEEP  # the sweep's own id: the whole sweep again


def test_a_search_trial_is_the_poisson_run_it_was() -> None:
    job = _job(PEAK)
    run = run_evaluation_id(evaluation_id_for(job.job_id), 3)
    trial = PEAK.model_copy(update={"qps": 137.5}).model_dump()
    one = evaluation_job(job, run, trial).scenario
    assert one.name == "online" and one.qps == 137.5 and one.latency_bound_ms == 20
    assert scenario_traits.get(one.name).runs(one) == 1 and one.seed == 3


def test_only_the_jobs_own_runs_are_runs() -> None:
    job = _job(SWEEP)
    parent = evaluation_id_for(job.job_id)
    assert is_run_of(job, f"{parent}-0") and is_run_of(job, f"{parent}-12")
    for other in (parent, f"{parent}-x", f"{parent}-", "ev-other-1", f"x{parent}-1"):
        assert not is_run_of(job, other), other
        assert evaluation_job(job, other, None) == job


@pytest.mark.parametrize("ran", [None, {}, {"name": "no-such"}, {"batch_size": 0}])
def test_a_run_whose_summary_names_no_scenario_is_a_typed_error(ran: Any) -> None:
    job = _job(SWEEP)
    run = run_evaluation_id(evaluation_id_for(job.job_id), 0)
    with pytest.raises(EvaluationError, match=f"{run} is one run of"):
        evaluation_job(job, run, ran)
