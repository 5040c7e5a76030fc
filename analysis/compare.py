"""Run-versus-run comparison: which runs may be compared, and their latency differences.

:func:`compare_runs` gives the median and p99 latency differences of two stored runs
with their bootstrap intervals and verdicts (:func:`analysis.difference.bootstrap_difference`,
whose docstring holds the method and the verdict rule).

That interval covers only the noise between queries of one run: two runs of the same
system also differ run to run (placement, caches, frequency, neighbours), so one run
each cannot show a change smaller than that (``basis`` says so). With repeated runs
(``mlscope-submit --repeat N``), :func:`compare_repeats` takes each run's statistic as
one sample and gives Welch's t interval of the difference of the means over runs
(:func:`analysis.difference.run_level_difference`).

Runs are compared only when they share model, scenario, requested rate, batch size,
placement and preprocessing (:data:`COMPARED_FIELDS`, :func:`mismatches`); otherwise
they are refused, or flagged where a report or the dashboard shows them. Regression
flags across versions, built on :func:`compare_runs`, are :mod:`analysis.regression`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from analysis.data import MEASURED_AS, evaluations
from analysis.difference import bootstrap_difference, run_level_difference
from analysis.figures import with_measurement
from analysis.rows import latencies_ms
from analysis.source import Source
from mlscope.errors import ConfigError
from mlscope.stats import percentile

__all__ = [
    "COMPARED_FIELDS",
    "SINGLE_RUN_NOTE",
    "artifact_notes",
    "compare_repeats",
    "compare_runs",
    "mismatches",
    "validity_notes",
]

SINGLE_RUN_NOTE = (
    "one run each: the interval covers query-to-query noise within a run, "
    "not run-to-run variance (for that, repeat each side with mlscope-submit --repeat N "
    "and compare the repeats: analysis.compare.compare_repeats)"
)
NO_LATENCY = "has no latency to compare: no answered query, or it was cancelled"
"""Why a run is not compared (:func:`analysis.rows.latencies_ms` has no samples of it)."""

COMPARED_FIELDS = ("model", "scenario", "requested_qps", "batch_size", *MEASURED_AS)
"""What two runs must share to be compared (framework, system or version may differ:
that is what a comparison is for). The one definition of "comparable" for every
surface: :func:`compare_runs`, the report's comparison and the dashboard's Compare page
call :func:`mismatches` on rows that carry these columns (those of
:func:`analysis.data.evaluations` and of :func:`analysis.summary.summary` do)."""


def mismatches(summ: pd.DataFrame, baseline: str | None = None) -> list[str]:
    """How the runs of ``summ`` (rows of :func:`analysis.summary.summary`) differ in
    :data:`COMPARED_FIELDS`, and which ran with ``--parallel``; [] when comparable.
    Each field's values are named in the rows' order, ``baseline``'s first."""
    out = []
    summ = with_measurement(summ)  # a frame that does not say: measured the default way
    if baseline is not None and "evaluation_id" in summ.columns:
        summ = summ.iloc[np.argsort(summ["evaluation_id"].to_numpy() != baseline, kind="stable")]
    for col in COMPARED_FIELDS:
        if col in summ.columns:
            values = dict.fromkeys(None if pd.isna(v) else v for v in summ[col])
            if len(values) > 1:
                shown = ", ".join(str(v) for v in values)
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


def validity_notes(summ: pd.DataFrame) -> list[str]:
    """The runs of ``summ`` that broke a validity rule, each with the first rule it
    broke: an overloaded or paused run's latencies measure its backlog, not the system
    at the load asked, so a difference involving one says little about the system."""
    if "valid" not in summ.columns:
        return []
    out = []
    told: set[object] = set()  # a run compared with itself is one run, told once
    for row in summ.to_dict("records"):
        if pd.isna(row["valid"]) or bool(row["valid"]):  # VALID, or not judged yet
            continue
        if row["evaluation_id"] in told:
            continue
        told.add(row["evaluation_id"])
        reasons = [r for r in str(row.get("invalid_reasons") or "").split("; ") if r]
        why = f" ({reasons[0]}{'; …' if len(reasons) > 1 else ''})" if reasons else ""
        out.append(
            f"{row['evaluation_id']} is INVALID{why}: its latencies may not measure the "
            "system at the load asked"
        )
    return out


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
    :func:`artifact_notes` and :func:`validity_notes` of the pair, "" when they loaded
    the same file and both were VALID).

    Runs that differ in a :data:`COMPARED_FIELDS` (model, scenario, rate, batch size,
    placement, preprocessing) are refused
    (:class:`~mlscope.errors.ConfigError`) unless ``check`` is False. The interval is
    over queries of one run each (``basis`` says so): see :func:`compare_repeats`.
    ``runs``: the two evaluations' rows (of :func:`analysis.data.evaluations` or
    :func:`analysis.summary.summary`) when the caller has them; read otherwise.
    ``latencies``: their samples by id (:func:`analysis.rows.latencies_ms`), likewise.
    A run that answered no query, or was cancelled, is a ConfigError naming it."""
    if runs is None:
        runs = evaluations(source, [baseline, candidate])
    if check:
        why = mismatches(runs, baseline)
        if why:
            raise ConfigError(f"{baseline} and {candidate} are not comparable: " + "; ".join(why))
    notes = [*artifact_notes(runs), *validity_notes(runs)]
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
    runs = evaluations(source, ids)
    if check:
        why = mismatches(runs, ids[0] if ids else None)
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
    notes = [*artifact_notes(runs), *validity_notes(runs)]
    return pd.DataFrame(rows).assign(basis=basis, note="; ".join(notes))
