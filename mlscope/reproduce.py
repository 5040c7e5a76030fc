"""The job that runs a stored evaluation again: ``mlscope rerun`` resubmits it (pinned to
what ran), the dashboard's Run page starts its form from it.

An evaluation is one job's, or one run of a job of several runs: a sweep's point or a
search's trial (``<evaluation_id>-<k>``, :func:`~mlscope.contracts.run_evaluation_id`),
whose stored specification is its whole job's. Such a run is reproduced by that run
alone, the point its stored summary's ``scenario`` says it ran, not by the whole sweep.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from mlscope import scenario_traits
from mlscope.contracts import JobRequest, ScenarioSpec, evaluation_id_for
from mlscope.errors import EvaluationError

__all__ = ["evaluation_job", "is_run_of", "one_run"]


def is_run_of(job: JobRequest, evaluation_id: str) -> bool:
    """Whether ``evaluation_id`` is one run of ``job``'s several (``<its id>-<k>``)."""
    parent = evaluation_id_for(job.job_id)
    k = evaluation_id.removeprefix(f"{parent}-")
    return k != evaluation_id and k.isdigit()


def evaluation_job(
    job: JobRequest, evaluation_id: str, ran: Mapping[str, Any] | None
) -> JobRequest:
    """The job that reproduces evaluation ``evaluation_id``, from the job its stored
    specification holds (``job``) and the scenario its stored summary says it ran
    (``ran``): ``job`` itself, or of one run of a sweep or search, that run alone
    (:func:`one_run`). An EvaluationError when a run's summary names no scenario this
    version reads."""
    if not is_run_of(job, evaluation_id):
        return job
    try:
        point = ScenarioSpec.model_validate(ran) if ran else None
    except ValidationError:
        point = None
    if point is None:
        raise EvaluationError(
            f"evaluation {evaluation_id} is one run of {evaluation_id_for(job.job_id)}, and "
            "its stored summary says no scenario this version reads: rerun the whole job "
            "by its id",
            evaluation_id=evaluation_id,
        )
    return job.model_copy(update={"scenario": one_run(job.scenario, point)})


def one_run(sweep: ScenarioSpec, point: ScenarioSpec) -> ScenarioSpec:
    """The scenario that makes only ``point``, one run of ``sweep``: its batch size and
    rate, no other sizes (a sweep of one size is that run). A search's trial
    (``peak``: one Poisson run at a rate, judged against the bound) becomes the
    Poisson run it was (``online``): a search cannot be made to run one given rate."""
    one = {**sweep.model_dump(), "batch_size": point.batch_size, "batch_sizes": None}
    one["qps"] = point.qps
    if scenario_traits.get(sweep.name).runs(ScenarioSpec.model_validate(one)) > 1:
        one["name"] = "online"
    return ScenarioSpec.model_validate(one)
