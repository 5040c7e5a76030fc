"""The Run page's form started from a stored evaluation (``/run?eval=EV_ID``): every box
from the job that reproduces it (:mod:`mlscope.reproduce`, as ``mlscope rerun`` runs it:
of one run of a sweep, that run's point alone), and a warning for what no box can hold."""

from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from analysis.data import stored_spec, stored_summary
from dashboard import common  # common.source() at each call, as the pages read it
from mlscope.contracts import JobRequest
from mlscope.errors import MLScopeError
from mlscope.reproduce import evaluation_job, is_run_of

__all__ = ["LEVELS", "form_values", "listed_values", "notes", "prefill"]

LEVELS = ["none", "model", "framework", "system", "full"]
"""The trace levels, as the form's slider offers them."""


def prefill(evaluation_id: str) -> None:
    """Start the form from a stored evaluation's job (``?eval=EV_ID``: run it again, or
    change one thing), box by box; once per evaluation, so that edits stick. What the
    form cannot hold (an MLPerf run, a setting it has no box for) is said on every run
    of the page (:func:`notes`), not dropped."""
    if st.session_state.get("run_prefilled") == evaluation_id:
        return
    st.session_state["run_prefilled"] = evaluation_id
    st.session_state["run_prefill_notes"] = _fill(evaluation_id)


def notes() -> tuple[str | None, str | None]:
    """What the page says of the evaluation its form started from: a caption (started
    from it) and a warning (what it could not take), each None when there is none."""
    got = st.session_state.get("run_prefill_notes")
    return got if isinstance(got, tuple) else (None, None)


def _fill(evaluation_id: str) -> tuple[str | None, str | None]:
    """Fill the form's session state from ``evaluation_id``; its :func:`notes`."""
    ev = common.recent_evaluations()
    rows = ev[ev["evaluation_id"] == evaluation_id]
    if rows.empty:
        return (
            None,
            f"No evaluation {common.shown(evaluation_id)} (from the address) to start from.",
        )
    try:
        spec = stored_spec(common.source(), evaluation_id)
        raw = spec.get("job")
        # An MLPerf job is LoadGen's, not a scenario (an import keeps its files' names only).
        mlperf = isinstance(raw, dict) and bool(raw.get("mlperf") or raw.get("mlperf_import"))
        job = None if raw is None or mlperf else _job(evaluation_id, raw)
    except (MLScopeError, ValueError) as exc:
        return None, f"{evaluation_id}: its stored job cannot be read, not started from ({exc})."
    if mlperf or "imported" in spec:
        return None, (
            f"{evaluation_id} is an MLPerf LoadGen run (imported or `mlscope mlperf`), "
            "not a scenario of this page: not started from it."
        )
    row = rows.iloc[0]
    values, left = form_values(job, row) if job is not None else listed_values(row)
    model = values.get("run_model")
    tasks = common.catalog().tasks().items()
    task = next((t for t, es in tasks if any(e.manifest.name == model for e in es)), None)
    st.session_state.update({"run_task": task, **values} if task else values)
    warning = (
        f"{evaluation_id} ran with settings the form does not take from it (a run from "
        f"here uses its own): {'; '.join(left)}. `mlscope rerun {evaluation_id}` keeps them."
        if left
        else None
    )
    return f"Settings from {evaluation_id}.", warning


def _job(evaluation_id: str, raw: object) -> JobRequest:
    """The job that reproduces ``evaluation_id`` (:func:`mlscope.reproduce.evaluation_job`,
    as ``mlscope rerun`` runs it): of one run of a sweep or search, that run alone."""
    job = JobRequest.model_validate(raw)
    if not is_run_of(job, evaluation_id):
        return job
    ran = stored_summary(common.source(), evaluation_id).get("scenario")
    return evaluation_job(job, evaluation_id, ran if isinstance(ran, dict) else None)


def listed_values(r: Any) -> tuple[dict[str, Any], list[str]]:
    """The boxes a listing row (:func:`analysis.data.evaluations`) fills, for a stored
    evaluation whose specification holds no job."""
    values: dict[str, Any] = {
        "run_model": r.model,
        "run_version": r.model_version,
        "run_frameworks": [r.framework],
        "run_scenario": r.scenario,
        "run_batch": int(r.batch_size),
        "run_level": r.trace_level if r.trace_level in LEVELS else "model",
    }
    # The rate box takes at least 1 query/s: a stored rate below that is not prefilled.
    if r.requested_qps is not None and not pd.isna(r.requested_qps) and r.requested_qps >= 1:
        values["run_qps"] = float(r.requested_qps)
    return values, ["its stored specification holds no job: the other settings are defaults"]


def form_values(job: JobRequest, row: Any) -> tuple[dict[str, Any], list[str]]:
    """The form's boxes (session-state keys) holding ``job`` (``row``: its evaluation's
    listing row, for the model version that ran where the job named none), and what of
    it no box can hold: a value below a box's minimum, or a setting the form lacks."""
    sc = job.scenario
    boxes: dict[str, tuple[Any, float | None]] = {  # key: (value, the box's minimum)
        "run_qps": (sc.qps, 1.0),
        "run_batch": (sc.batch_size, 1),
        "run_duration": (sc.duration_s, 0.1),
        "run_concurrency": (sc.concurrency, 1),
        "run_bound": (sc.latency_bound_ms or 0.0, 0.0),
        "run_trials": (sc.peak_trials, 2),
        "run_reps": (sc.repetitions, 1),
        "run_warm": (sc.warm_queries, 1),
        "run_loadgens": (sc.loadgens, 1),
        "run_seed": (sc.seed, None),
        "run_min_duration": (sc.min_duration_s or 0.0, 0.0),
        "run_min_q": (sc.min_queries or 0, 0),
        "run_max_lag": (sc.max_issue_lag_us or 0.0, 0.0),
        "run_max_q": (sc.max_queries or 0, 0),
        "run_warmup": (sc.warmup_queries, 0),
    }
    values: dict[str, Any] = {
        "run_model": job.model,
        "run_version": job.model_version or row.model_version,
        "run_frameworks": [job.framework],
        "run_device": job.device,
        "run_scenario": sc.name,
        "run_level": job.trace_level,
        "run_accuracy": job.accuracy,
        "run_parallel": job.parallel,
    }
    left = []
    for key, (value, low) in boxes.items():
        if low is None or value >= low:
            values[key] = value
        else:
            left.append(f"{key.removeprefix('run_')} {value:g}")
    # No sweep: the batch size alone (an empty box), not the box's default sizes.
    values["run_sweep"] = ", ".join(map(str, sc.batch_sizes or ()))
    if sc.segments:
        values["run_segments"] = "; ".join(",".join(map(str, s)) for s in sc.segments)
    if sc.arrivals_s:
        values["run_arrivals"] = " ".join(map(str, sc.arrivals_s))  # exact: repr's digits
    unboxed = {
        "framework version": job.framework_version,
        "agent": job.agent_id,
        "system": job.system,
        "accuracy samples": job.accuracy_samples,
        "load generator hosts": sc.loadgen_hosts,
        "preprocess": sc.preprocess,
        "max outstanding": None if sc.max_outstanding == 1024 else sc.max_outstanding,
        # The form has no placement box: its jobs run where their scenario places them.
        "placement": None if job.placement == _own_placement(job) else job.placement,
    }
    left += [f"{k} {v}" for k, v in unboxed.items() if v is not None]
    return {k: v for k, v in values.items() if v is not None}, left


def _own_placement(job: JobRequest) -> str:
    """Where the form's job of ``job``'s scenario runs (it names no placement)."""
    return JobRequest(model=job.model, framework=job.framework, scenario=job.scenario).placement
