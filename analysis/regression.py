"""Regression flags across versions: each step between consecutive versions of a
model or a framework, all else equal, judged by :func:`analysis.compare.compare_runs`
on the median latency (:func:`regressions`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
from packaging.version import InvalidVersion, Version

from analysis.compare import compare_runs
from analysis.data import MEASURED_AS
from analysis.difference import SLOWER
from analysis.figures import measured_runs, prefer_valid
from analysis.rows import latencies_ms
from analysis.source import Source

__all__ = ["NOT_COMPARED", "REGRESSION_KEYS", "STEP_COLUMNS", "VERSION_AXES", "regressions"]


def _version_key(v: str) -> tuple[int, Version | str]:
    try:
        return (0, Version(v))
    except InvalidVersion:
        return (1, v)


VERSION_AXES = ("model_version", "framework_version")
"""What :func:`regressions` steps along."""
REGRESSION_KEYS = (
    "model",
    "model_version",
    "framework",
    "framework_version",
    "system",
    "scenario",
    "batch_size",
    *MEASURED_AS,
)
"""What the runs of one step share, its axis aside (and the requested rate): a step
never crosses a change of placement or preprocessing (:data:`analysis.compare.COMPARED_FIELDS`)."""
STEP_COLUMNS = (
    "from_version",
    "to_version",
    "baseline",
    "candidate",
    "median_a_ms",
    "median_b_ms",
    "rel",
    "ci_low",
    "ci_high",
    "verdict",
    "regression",
    "skipped",
)
"""The columns of :func:`regressions` after the keys of the step."""
NOT_COMPARED = "not compared"
"""The verdict of a step :func:`regressions` could not judge (``skipped`` says why)."""


def regressions(
    source: Source,
    summ: pd.DataFrame,
    *,
    axis: str = "framework_version",
    n_boot: int = 1000,
    min_effect: float = 0.05,
    seed: int = 0,
) -> pd.DataFrame:
    """Consecutive versions along ``axis`` ("model_version" or "framework_version"),
    all else equal: the median-latency verdict of each step; ``regression`` is True
    where the newer version is slower. The newest valid run of each version counts
    (an invalid one where none is valid); only runs at the same requested rate are
    compared, and a sweep's parent never (its runs are). A step with a run that
    answered no query has no latency to compare: its verdict is :data:`NOT_COMPARED`,
    ``skipped`` names the run (``""`` in a step that was compared)."""
    if axis not in VERSION_AXES:
        raise ValueError(f"axis must be model_version or framework_version, not {axis!r}")
    fixed = [c for c in REGRESSION_KEYS if c != axis]
    runs = _run_per_version(summ, fixed, axis)
    lat = latencies_ms(source, [str(e) for e in runs["evaluation_id"]])
    rows = [
        {
            **dict(zip(fixed, key, strict=True)),
            **_step(
                source, summ, old, new, axis, lat, n_boot=n_boot, min_effect=min_effect, seed=seed
            ),
        }
        for key, old, new in _version_steps(runs, fixed, axis)
    ]
    return pd.DataFrame(rows, columns=[*fixed, *STEP_COLUMNS])


def _run_per_version(summ: pd.DataFrame, fixed: list[str], axis: str) -> pd.DataFrame:
    """The run that counts for each version along ``axis`` of each group equal in
    ``fixed`` and in requested rate (``_rate``; -1: none): the newest valid one, else
    the newest; a sweep's parent never (:func:`~analysis.figures.measured_runs`)."""
    # Runs at different requested rates are different measurements.
    rate = summ["requested_qps"].fillna(-1.0) if "requested_qps" in summ else -1.0
    return prefer_valid(measured_runs(summ).assign(_rate=rate)).drop_duplicates(
        [*fixed, "_rate", axis], keep="first"
    )


def _version_steps(
    runs: pd.DataFrame, fixed: list[str], axis: str
) -> Iterator[tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]]]:
    """(the group's ``fixed`` values, older run, newer run) of each two consecutive
    versions (in version order, :func:`_version_key`) of each group of ``runs``."""
    for group, g in runs.groupby([*fixed, "_rate"], sort=True):
        if g[axis].nunique() < 2:  # one version (or none named): no step
            continue
        recs = g.sort_values(axis, key=lambda s: s.map(_version_key)).to_dict("records")
        for old, new in itertools.pairwise(recs):
            yield group[: len(fixed)], old, new


def _step(
    source: Source,
    summ: pd.DataFrame,
    old: dict[str, Any],
    new: dict[str, Any],
    axis: str,
    lat: Mapping[str, np.ndarray],
    *,
    n_boot: int,
    min_effect: float,
    seed: int,
) -> dict[str, Any]:
    """The :data:`STEP_COLUMNS` of the step from run ``old`` to run ``new``: the
    median-latency verdict, or :data:`NOT_COMPARED` and why."""
    pair = (old["evaluation_id"], new["evaluation_id"])
    step = {
        "from_version": old[axis],
        "to_version": new[axis],
        "baseline": pair[0],
        "candidate": pair[1],
    }
    silent = [e for e in pair if e not in lat]
    if silent:
        return {
            **step,
            "verdict": NOT_COMPARED,
            "regression": False,
            "skipped": _no_answers(silent),
        }
    table = compare_runs(
        source,
        *pair,
        n_boot=n_boot,
        min_effect=min_effect,
        seed=seed,
        check=False,
        runs=summ[summ["evaluation_id"].isin(pair)],
        latencies=lat,
    )
    return {**step, **_median_verdict(table)}


def _median_verdict(table: pd.DataFrame) -> dict[str, Any]:
    """The median row of a :func:`compare_runs` table as :data:`STEP_COLUMNS`."""
    d = table[table["statistic"] == "median"].iloc[0]
    return {
        "median_a_ms": d["a"],
        "median_b_ms": d["b"],
        "rel": d["rel"],
        "ci_low": d["ci_low"],
        "ci_high": d["ci_high"],
        "verdict": d["verdict"],
        "regression": d["verdict"] == SLOWER,
        "skipped": "",
    }


def _no_answers(ids: Sequence[str]) -> str:
    """Why a step with runs ``ids`` was not compared."""
    return f"{', '.join(ids)} answered no query"
