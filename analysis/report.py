"""Reports of evaluations: what a report shows, gathered from the evaluations' rows.

:func:`build` reads each evaluation once and gathers its tables, notes and figures into
a :class:`~analysis.report_render.Report`, which :mod:`analysis.report_render` renders
as HTML, Markdown or JSON.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np
import pandas as pd

from analysis import figures, plots
from analysis.compare import SINGLE_RUN_NOTE, compare_runs, mismatches
from analysis.data import evaluations, with_sweep_runs
from analysis.layers import layer_kinds, layer_spans_left_out, layer_types, top_layers
from analysis.report_render import Report, Section
from analysis.rows import latencies_ms
from analysis.source import Source
from analysis.summary import latency_windows_of, summary

__all__ = ["build", "price_warnings"]


SUMMARY_VIEW = [
    "evaluation_id",
    "model",
    "framework",
    "framework_version",
    "system",
    "scenario",
    "batch_size",
    "placement",
    "preprocess",
    "valid",
    "queries",
    "warmup_queries",
    "trimmed_mean_ms",
    "p50_ms",
    "p90_ms",
    "p99_ms",
    "throughput_ips",
    "top1",
    "peak_rss_mb",
    "rss_growth_mb",
    "host_other_cores",
]


READS_AT_ONCE = 4
"""Reads of one report in flight at once: those that do not need each other's results
go out together (a server answers them side by side; :class:`~analysis.source.Source`
is thread-safe). The server's read connections (``broker.readonly.ReadLimits.readers``)
are as many."""


def build(
    source: Source,
    ids: Sequence[str],
    *,
    sizes: Mapping[str, int] | Callable[[], Mapping[str, int]] | None = None,
    prices_per_hour: Mapping[str, float] | None = None,
    window_s: float = 1.0,
    top_n: int = 10,
) -> Report:
    """The report of evaluations ``ids``: summary, latency, throughput, accuracy,
    layers, and a comparison of each run against the first one. ``sizes``: the models'
    sizes (``"model/framework"`` to bytes), or what gives them when the accuracy
    section is reached (a catalog read while the evaluations are)."""
    ids = list(dict.fromkeys(ids))  # an id named twice is one run: one row, not compared
    shown = evaluations(source, ids)
    with ThreadPoolExecutor(READS_AT_ONCE - 1, thread_name_prefix="report-read") as pool:
        # the windows of every id (one query either way); those without samples dropped
        lat_read = pool.submit(latencies_ms, source, ids)
        windows_read = pool.submit(latency_windows_of, source, ids, window_s=window_s)
        layer_reads = [
            pool.submit(_layers_section, source, e, k, top_n)
            for e, k in layer_kinds(source, ids).items()
            if k is not None
        ]
        summ = summary(source, evaluated=with_sweep_runs(source, shown))
        # drawn from the summary alone, while the other reads still run
        throughput = _throughput_sections(
            summ, sizes() if callable(sizes) else sizes, prices_per_hour
        )
        lat, windows = lat_read.result(), windows_read.result()
        layers = [r.result() for r in layer_reads]
    sections = [_summary_section(summ)]
    latency = Section("Latency")
    if lat:
        latency.plots.append(
            ("Latency by percentile (log scale)", partial(plots.latency_percentiles, lat))
        )
    for e, w in windows.items():
        if e in lat and len(w) > 1:
            latency.plots.append(
                (
                    f"Latency over time, {e} ({window_s:g} s windows)",
                    partial(plots.latency_over_time, w, e),
                )
            )
    if not latency.plots:
        latency.notes.append(_no_latency(shown))
    sections.append(latency)
    sections += throughput
    sections += layers
    # Runs with per-query samples (an imported MLPerf run may have none); a sweep's
    # parent is the sum of its steps, never a run of its own.
    sweeps = set(summ.loc[summ["role"] == "sweep", "evaluation_id"])
    measured = [e for e in ids if e in lat and e not in sweeps]
    if len(measured) > 1:
        sections.append(_comparison(source, summ, measured, lat))
    return Report(
        f"mlscope report: {', '.join(ids)}",
        sections,
        warnings=price_warnings(summ, prices_per_hour),
    )


def _no_latency(shown: pd.DataFrame) -> str:
    """Why the latency section is empty: no evaluation has answered queries of its own
    (a sweep's or search's keeps them in its runs, named)."""
    runs = [r for rs in shown["runs"] for r in rs] if "runs" in shown else []
    where = f": its runs do ({', '.join(runs)})" if runs else ""
    return (
        "No latency to show: none of these evaluations has answered queries of its own "
        f"(a sweep's or search's evaluation keeps none{where})."
    )


def price_warnings(summ: pd.DataFrame, prices: Mapping[str, float] | None) -> list[str]:
    """Prices that cost nothing in the report, one line each. A system's cost per million
    inferences comes from its maximum throughput over batched runs
    (:func:`analysis.figures.across_systems`), so a price names a system of a batched
    run or it is unused: a misspelt system, one measured online only, or runs none of
    which is batched."""
    if not prices:
        return []
    batched = sorted(set(figures.max_throughput(summ)["system"]))
    if not batched:
        return [
            "prices ignored: a cost per million inferences comes from batched "
            "(throughput) runs, and none of these runs is batched"
        ]
    unused = sorted(set(prices) - set(batched))
    if not unused:
        return []
    return [
        f"no cost for {', '.join(map(repr, unused))}: prices apply to batched runs, "
        f"and these are on {', '.join(map(repr, batched))} only"
    ]


def _summary_section(summ: pd.DataFrame) -> Section:
    section = Section("Summary", tables=[("Per-evaluation summary", summ[SUMMARY_VIEW])])
    section.notes += [
        f"{r.evaluation_id} is a sweep: its runs are listed beside it and counted once each"
        for r in summ.itertuples()
        if r.role == "sweep"
    ]
    invalid = summ[~summ["valid"].astype(bool)]
    section.notes += [
        f"{r.evaluation_id} is INVALID: {r.invalid_reasons}" for r in invalid.itertuples()
    ]
    section.notes.append(
        "queries: the measured queries, whose latency every figure counts; "
        "warmup_queries: the warm-up queries sent before them, left out of every figure "
        "(`mlscope runs` counts both)."
    )
    section.notes.append(
        "Memory: peak_rss_mb is the agent process's peak resident memory while the "
        "evaluation was prepared, rss_growth_mb its resident memory at release minus at "
        "prepare (MB = 10^6 bytes; empty: not reported); host_other_cores the cores other "
        "processes kept busy on the agent's host on average meanwhile (the server and "
        "load generator included when they shared it; more than a few tenths: the model "
        "had less CPU than on a quiet host). Energy: "
        + (
            "not available (no power source was readable on the agents' hosts)."
            if summ["energy_j"].isna().all()
            else "energy_j per evaluation, where a power source was read."
        )
    )
    return section


def _layers_section(source: Source, evaluation_id: str, kind: str, top_n: int) -> Section:
    """The layer tables of one evaluation (``kind``: its :func:`layer_kind`), and a note
    of the spans they leave out."""
    section = Section(
        f"Layers of {evaluation_id}",
        tables=[
            (f"Top {top_n} layers by time", top_layers(source, evaluation_id, top_n, kind=kind)),
            ("By layer type", layer_types(source, evaluation_id, kind=kind)),
        ],
    )
    left_out = layer_spans_left_out(source, evaluation_id, kind=kind)
    if left_out:
        section.notes.append(
            f"{left_out} {kind} span(s) of {evaluation_id} end before they start: "
            "left out of these tables"
        )
    return section


def _comparison(
    source: Source, summ: pd.DataFrame, ids: Sequence[str], lat: Mapping[str, np.ndarray]
) -> Section:
    """Each run against the first, flagged where they are not comparable."""
    base = ids[0]
    sec = Section(f"Comparison against {base}")
    rows = []
    for other in ids[1:]:
        pair = summ[summ["evaluation_id"].isin([base, other])]
        why = mismatches(pair, base)
        if why:
            sec.notes.append(f"{other} vs {base}: NOT COMPARABLE: " + "; ".join(why))
        table = compare_runs(
            source,
            base,
            other,
            check=False,
            runs=pair,
            latencies={e: lat[e] for e in (base, other)},
        )
        sec.notes.extend(f"{other} vs {base}: {n}" for n in dict.fromkeys(table["note"]) if n)
        rows.append(table.assign(baseline=base, candidate=other, comparable=not why))
    sec.notes.append(f"Intervals: {SINGLE_RUN_NOTE}.")
    sec.tables.append(
        (
            "Bootstrap 95% CIs of latency differences (candidate − baseline; a, b, "
            "diff, ci_low, ci_high in ms, rel a fraction of the baseline's)",
            pd.concat(rows, ignore_index=True),
        )
    )
    return sec


def _throughput_sections(
    summ: pd.DataFrame, sizes: Mapping[str, int] | None, prices: Mapping[str, float] | None
) -> list[Section]:
    out = []
    tput = figures.max_throughput(summ)
    if len(tput):
        sec = Section("Throughput", tables=[("Maximum throughput and optimal batch size", tput)])
        sec.plots.append(("Throughput by batch size", partial(plots.throughput_by_batch, summ)))
        heat = figures.speedup_heatmap(summ)
        if heat.shape[1] > 1:
            sec.tables.append(
                (
                    "Speed-up over the smallest batch size",
                    heat.reset_index(names="model/framework@system"),
                )
            )
            sec.plots.append(("Speed-up heatmap", partial(plots.speedup_figure, heat)))
        if prices:
            for model in sorted(set(tput["model"])):
                sec.tables.append(
                    (f"{model} across systems", figures.across_systems(summ, model, prices))
                )
        out.append(sec)
    acc = figures.accuracy_tradeoff(summ, sizes)
    if len(acc):
        sec = Section("Accuracy", tables=[("Accuracy, latency, throughput and size", acc)])
        for x in ("online_latency_ms", "max_throughput_ips"):
            if acc[x].notna().any():
                sec.plots.append((f"Top-1 vs {x}", partial(plots.accuracy_scatter, acc, x)))
        out.append(sec)
    return out
