"""Run-versus-run comparison and regression flags across versions.

The difference of a statistic (median, p99) between a baseline run A and a candidate
run B is ``stat(B) - stat(A)``. Its confidence interval is the percentile bootstrap:
resample A and B independently with replacement ``n_boot`` times, compute the
difference each time, take the (α/2, 1-α/2) quantiles of those differences (Efron &
Tibshirani, *An Introduction to the Bootstrap*, ch. 13), with mlscope's nearest-rank
percentile as the statistic. A resample's percentile is drawn from its exact
bootstrap distribution (an order statistic's, :func:`bootstrap_percentiles`: one Beta
draw) rather than by resampling n values ``n_boot`` times: the same interval in
distribution, checked against ``scipy.stats.bootstrap`` with ``method="percentile"``,
``paired=False``, at a cost that does not grow with n times ``n_boot``. The verdict:

* ``slower`` — the interval lies above 0 and the point difference is at least
  ``min_effect`` of A's statistic;
* ``faster`` — the interval lies below 0, same effect-size rule;
* ``no significant change`` — otherwise.

The effect-size floor keeps two runs of the same system from being called different
for a statistically real but meaningless 0.1 % (long runs make every CI narrow). The
floor is higher for the tail (p99): the percentile bootstrap of an extreme quantile
is known to under-cover (its resamples can only repeat the few largest samples), so
a tail difference must also be large to count.

That interval covers only the noise between queries of one run: two runs of the same
system also differ run to run (placement, caches, frequency, neighbours), so one run
each cannot show a change smaller than that (``basis`` says so). With repeated runs
(``mlscope-submit --repeat N``), :func:`compare_repeats` takes each run's statistic as
one sample and gives Welch's t interval of the difference of the means over runs.

Runs are compared only when they share model, scenario, requested rate, batch size,
placement and preprocessing (:data:`COMPARED_FIELDS`, :func:`mismatches`); otherwise
they are refused, or flagged where a report or the dashboard shows them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from packaging.version import InvalidVersion, Version

from analysis.data import MEASURED_AS, evaluations, latencies_ms
from analysis.figures import measured_runs, prefer_valid, with_measurement
from analysis.source import Source
from mlscope.errors import ConfigError
from mlscope.stats import nearest_rank, percentile, student_t_quantile

__all__ = [
    "COMPARED_FIELDS",
    "NOT_COMPARED",
    "REGRESSION_KEYS",
    "SINGLE_RUN_NOTE",
    "STEP_COLUMNS",
    "VERSION_AXES",
    "Difference",
    "artifact_notes",
    "bootstrap_difference",
    "bootstrap_percentiles",
    "check_comparable",
    "compare_repeats",
    "compare_runs",
    "mismatches",
    "regressions",
    "resampled_percentile",
    "run_level_difference",
]

FASTER, SLOWER, SAME = "faster", "slower", "no significant change"


@dataclass(frozen=True)
class Difference:
    statistic: str
    a: float
    b: float
    diff: float
    rel: float
    ci_low: float
    ci_high: float
    verdict: str


def resampled_percentile(samples: np.ndarray, q: float, idx: np.ndarray) -> np.ndarray:
    """The nearest-rank percentile (mlscope.stats' definition) of each resample.

    ``idx`` is (replicates, n) indices into ``samples``; row r's result equals
    ``mlscope.stats.percentile(samples[idx[r]], q)`` (tested), vectorized.
    """
    return _nearest_rank(samples[idx], q, axis=1)


def _nearest_rank(x: np.ndarray, q: float, axis: int) -> np.ndarray:
    """:func:`mlscope.stats.nearest_rank`'s percentile along ``axis`` (rows of
    resamples), vectorized."""
    k = nearest_rank(x.shape[axis], q)
    return np.asarray(np.take(np.sort(x, axis=axis), k - 1, axis=axis))


def bootstrap_percentiles(
    sorted_samples: np.ndarray, q: float, n_boot: int, rng: np.random.Generator
) -> np.ndarray:
    """``n_boot`` draws of the nearest-rank ``q``-th percentile of a bootstrap resample
    of ``sorted_samples`` (n values, ascending), without resampling.

    A resample draws n indices floor(n U_i), U_i uniform on [0, 1); floor is
    monotone, so its k-th smallest index (k the nearest rank) is floor(n U_(k)), and
    the k-th smallest of n uniforms is Beta(k, n - k + 1) distributed. One Beta draw
    per replicate therefore has the statistic's exact bootstrap distribution (ties
    included: equal values are equal outcomes), in O(n_boot) where resampling costs
    O(n_boot n log n) (tested against resampling)."""
    n = sorted_samples.size
    k = nearest_rank(n, q)
    at = (rng.beta(k, n - k + 1, size=n_boot) * n).astype(np.int64)
    return np.asarray(sorted_samples[np.minimum(at, n - 1)])


def bootstrap_difference(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    q: float = 50.0,
    *,
    n_boot: int = 2000,
    confidence: float = 0.95,
    min_effect: float = 0.02,
    seed: int = 0,
    statistic: str | None = None,
) -> Difference:
    """CI of percentile_q(b) - percentile_q(a) and the verdict (see module docstring)."""
    xa, xb = np.asarray(a, float), np.asarray(b, float)
    xa, xb = np.sort(xa[~np.isnan(xa)]), np.sort(xb[~np.isnan(xb)])
    if xa.size == 0 or xb.size == 0:
        raise ValueError("both runs need at least one latency sample")
    pa, pb = float(percentile(xa, q) or 0.0), float(percentile(xb, q) or 0.0)
    rng = np.random.default_rng(seed)
    # A and B resampled independently: each replicate's statistic drawn from its own
    # exact bootstrap distribution, then the differences' percentile interval.
    diffs = bootstrap_percentiles(xb, q, n_boot, rng) - bootstrap_percentiles(xa, q, n_boot, rng)
    alpha = (1 - confidence) / 2
    lo, hi = np.percentile(diffs, [100 * alpha, 100 * (1 - alpha)])
    diff = pb - pa
    rel = diff / pa if pa else float("inf") if diff else 0.0
    big = abs(rel) >= min_effect
    verdict = SLOWER if lo > 0 and big else FASTER if hi < 0 and big else SAME
    return Difference(statistic or f"p{q:g}", pa, pb, diff, rel, float(lo), float(hi), verdict)


SINGLE_RUN_NOTE = (
    "one run each: the interval covers query-to-query noise within a run, "
    "not run-to-run variance (use --repeat for run-level statistics)"
)
NO_LATENCY = "has no latency to compare: no answered query, or it was cancelled"
"""Why a run is not compared (:func:`analysis.data.latencies_ms` has no samples of it)."""

COMPARED_FIELDS = ("model", "scenario", "requested_qps", "batch_size", *MEASURED_AS)
"""What two runs must share to be compared (framework, system or version may differ:
that is what a comparison is for). The one definition of "comparable" for every
surface: :func:`compare_runs`, the report's comparison and the dashboard's Compare page
call :func:`mismatches` on rows that carry these columns (those of
:func:`analysis.data.evaluations` and of :func:`analysis.summary.summary` do)."""


def mismatches(summ: pd.DataFrame) -> list[str]:
    """How the runs of ``summ`` (rows of :func:`analysis.summary.summary`) differ in
    :data:`COMPARED_FIELDS`, and which ran with ``--parallel``; [] when comparable."""
    out = []
    summ = with_measurement(summ)  # a frame that does not say: measured the default way
    for col in COMPARED_FIELDS:
        if col in summ.columns:
            values = {None if pd.isna(v) else v for v in summ[col]}
            if len(values) > 1:
                shown = ", ".join(sorted(str(v) for v in values))
                out.append(f"they differ in {col.replace('_', ' ')} ({shown})")
    if "parallel" in summ.columns and summ["parallel"].any():
        out.append("some ran with --parallel (other evaluations shared their hosts)")
    return out


def artifact_notes(summ: pd.DataFrame) -> list[str]:
    """Where runs of one model version on one framework loaded different model files
    (another machine's build or a rebuild of the zoo): the numbers are still
    comparable, but a difference may come from the bytes rather than the system."""
    if "artifact_sha256" not in summ.columns:
        return []
    if len({s for s in summ["artifact_sha256"] if isinstance(s, str) and s}) < 2:
        return []  # one file (or none recorded): nothing to tell, no grouping needed
    out = []
    keys = ["model", "model_version", "framework"]
    for (model, version, framework), group in summ.groupby(keys, sort=True):
        shas = sorted({str(s) for s in group["artifact_sha256"] if isinstance(s, str) and s})
        if len(shas) > 1:
            out.append(
                f"{model}@{version} on {framework} ran different model files (sha256 "
                + ", ".join(s[:12] for s in shas)
                + "): built on another machine or rebuilt; a difference may come from "
                "the bytes, not the system"
            )
    return out


def check_comparable(source: Source, ids: Sequence[str]) -> list[str]:
    """:func:`mismatches` of stored evaluations ``ids``."""
    return mismatches(evaluations(source, list(ids)))


def compare_runs(
    source: Source,
    baseline: str,
    candidate: str,
    *,
    n_boot: int = 2000,
    confidence: float = 0.95,
    min_effect: float = 0.02,
    tail_min_effect: float = 0.05,
    seed: int = 0,
    check: bool = True,
    runs: pd.DataFrame | None = None,
    latencies: Mapping[str, np.ndarray] | None = None,
) -> pd.DataFrame:
    """Median and p99 latency of ``candidate`` against ``baseline`` (ms), one row each:
    statistic, a, b, diff, rel, ci_low, ci_high, verdict, basis, note (the
    :func:`artifact_notes` of the pair, "" when they loaded the same file).

    Runs that differ in a :data:`COMPARED_FIELDS` (model, scenario, rate, batch size,
    placement, preprocessing) are refused
    (:class:`~mlscope.errors.ConfigError`) unless ``check`` is False. The interval is
    over queries of one run each (``basis`` says so): see :func:`compare_repeats`.
    ``runs``: the two evaluations' rows (of :func:`analysis.data.evaluations` or
    :func:`analysis.summary.summary`) when the caller has them; read otherwise.
    ``latencies``: their samples by id (:func:`analysis.data.latencies_ms`), likewise.
    A run that answered no query, or was cancelled, is a ConfigError naming it."""
    if runs is None:
        runs = evaluations(source, [baseline, candidate])
    if check:
        why = mismatches(runs)
        if why:
            raise ConfigError(f"{baseline} and {candidate} are not comparable: " + "; ".join(why))
    notes = artifact_notes(runs)
    lat = dict(latencies) if latencies is not None else latencies_ms(source, [baseline, candidate])
    for e in (baseline, candidate):
        if e not in lat:
            raise ConfigError(f"evaluation {e} {NO_LATENCY}", evaluation_id=e)
    rows = [
        bootstrap_difference(
            lat[baseline],
            lat[candidate],
            q_,
            n_boot=n_boot,
            confidence=confidence,
            min_effect=floor,
            seed=seed,
            statistic=name,
        ).__dict__
        for name, q_, floor in (
            ("median", 50.0, min_effect),
            ("p99", 99.0, max(min_effect, tail_min_effect)),
        )
    ]
    return pd.DataFrame(rows).assign(basis=SINGLE_RUN_NOTE, note="; ".join(notes))


def run_level_difference(
    a: Sequence[float],
    b: Sequence[float],
    *,
    statistic: str,
    confidence: float = 0.95,
    min_effect: float = 0.02,
) -> Difference:
    """mean(b) - mean(a) over independent runs, Welch's t interval (unequal variances,
    Welch-Satterthwaite degrees of freedom); the verdict rule of the module docstring.
    Each side needs at least two runs."""
    xa, xb = np.asarray(a, float), np.asarray(b, float)
    if xa.size < 2 or xb.size < 2:
        raise ValueError("run-level statistics need at least two runs on each side")
    ma, mb = float(xa.mean()), float(xb.mean())
    va, vb = xa.var(ddof=1) / xa.size, xb.var(ddof=1) / xb.size
    se = math.sqrt(va + vb)
    diff = mb - ma
    if se == 0:
        lo = hi = diff
    else:
        df = (va + vb) ** 2 / (
            (va**2 / (xa.size - 1) if va else 0.0) + (vb**2 / (xb.size - 1) if vb else 0.0)
        )
        half = student_t_quantile(0.5 + confidence / 2, df) * se
        lo, hi = diff - half, diff + half
    rel = diff / ma if ma else float("inf") if diff else 0.0
    big = abs(rel) >= min_effect
    verdict = SLOWER if lo > 0 and big else FASTER if hi < 0 and big else SAME
    return Difference(statistic, ma, mb, diff, rel, float(lo), float(hi), verdict)


def compare_repeats(
    source: Source,
    baselines: Sequence[str],
    candidates: Sequence[str],
    *,
    confidence: float = 0.95,
    min_effect: float = 0.02,
    tail_min_effect: float = 0.05,
    check: bool = True,
) -> pd.DataFrame:
    """Median and p99 latency (ms) of repeated runs: each run's statistic is one sample,
    and the interval is over runs (:func:`run_level_difference`), so it includes
    run-to-run variance. Same columns as :func:`compare_runs`."""
    ids = [*baselines, *candidates]
    if check:
        why = check_comparable(source, ids)
        if why:
            raise ConfigError("the runs are not comparable: " + "; ".join(why))
    per_run = latencies_ms(source, ids)
    missing = [e for e in ids if e not in per_run]
    if missing:
        raise ConfigError(f"evaluation {missing[0]} {NO_LATENCY}", evaluation_id=missing[0])
    rows = []
    for name, q_, floor in (
        ("median", 50.0, min_effect),
        ("p99", 99.0, max(min_effect, tail_min_effect)),
    ):
        a = [float(percentile(per_run[e], q_) or 0.0) for e in baselines]
        b = [float(percentile(per_run[e], q_) or 0.0) for e in candidates]
        rows.append(
            run_level_difference(
                a, b, statistic=name, confidence=confidence, min_effect=floor
            ).__dict__
        )
    basis = f"runs: {len(baselines)} baseline, {len(candidates)} candidate"
    return pd.DataFrame(rows).assign(basis=basis)


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
never crosses a change of placement or preprocessing (:data:`COMPARED_FIELDS`)."""
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
