"""Reports of evaluations: one self-contained HTML file or Markdown, plots inline.

:func:`build` gathers the frames and figures; :func:`to_html` and :func:`to_markdown`
render them. HTML embeds plots as inline SVG, so the file stands alone; Markdown
writes each plot as an SVG file into a directory beside it (``report_files/``) and links
it, or, with no directory (a terminal), names the plot in one line; :func:`to_json`
gives the tables and notes as plain data (plots are named, not drawn). Plots are
:class:`analysis.chart.Chart`s, drawn by :mod:`analysis.chartsvg` (no plotting package).
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis import figures, plots
from analysis.chart import Chart
from analysis.chartsvg import svg
from analysis.compare import SINGLE_RUN_NOTE, compare_runs, mismatches
from analysis.data import evaluations, with_sweep_runs
from analysis.layers import layer_kinds, layer_spans_left_out, layer_types, top_layers
from analysis.records import json_records
from analysis.rows import latencies_ms
from analysis.source import Source
from analysis.summary import latency_windows_of, summary

__all__ = [
    "Report",
    "Section",
    "build",
    "figure_dir_for",
    "price_warnings",
    "to_html",
    "to_json",
    "to_markdown",
]


@dataclass
class Section:
    title: str
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    plots: list[tuple[str, Callable[[], Chart]]] = field(default_factory=list)
    """Caption and what makes the chart: only a format that shows figures draws them
    (JSON and Markdown on a terminal name them)."""
    notes: list[str] = field(default_factory=list)


@dataclass
class Report:
    title: str
    sections: list[Section]
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    warnings: list[str] = field(default_factory=list)
    """What was asked of the report and could not be shown (:func:`price_warnings`): a
    caller says it beside the report (``mlscope report``: on stderr)."""


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
        "prepare (MB = 10^6 bytes; empty: not reported). Energy: "
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


def _fmt(v: Any) -> str:
    """A table cell as text: a whole number (a count, a batch size) as an integer; any
    other number in fixed point with four significant digits, more where it is large
    (a rate of 12345.7/s reads ``12346``), never in scientific notation unless
    smaller than 0.001."""
    if v is None or v is pd.NA or (isinstance(v, float | np.floating) and np.isnan(v)):
        return "–"
    if isinstance(v, bool | np.bool_):
        return str(bool(v))
    if isinstance(v, int | np.integer):
        return str(int(v))
    if isinstance(v, float | np.floating):
        x = float(v)
        if math.isinf(x):
            return str(x)
        if x.is_integer() and abs(x) < 1e18:
            return str(int(x))
        if abs(x) < 1e-3:
            return f"{x:.4g}"
        return f"{x:.{max(0, 3 - math.floor(math.log10(abs(x))))}f}"
    if isinstance(v, list | tuple):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def to_html(report: Report) -> str:
    """One self-contained HTML document (inline CSS and SVG, no external resources)."""
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>"
        f"{html.escape(report.title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(report.title)}</h1><p class='meta'>generated "
        f"{html.escape(report.created)}</p>",
    ]
    for sec in report.sections:
        parts.append(f"<h2>{html.escape(sec.title)}</h2>")
        parts += [f"<p class='note'>{html.escape(n)}</p>" for n in sec.notes]
        for caption, df in sec.tables:
            parts.append(f"<h3>{html.escape(caption)}</h3>{_html_table(df)}")
        for caption, draw in sec.plots:
            parts.append(
                f"<figure>{svg(draw())}<figcaption>{html.escape(caption)}</figcaption></figure>"
            )
    parts.append("</body></html>")
    return "\n".join(parts)


def _html_table(df: pd.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in row) + "</tr>"
        for row in df.itertuples(index=False)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def figure_dir_for(markdown_path: Path) -> Path:
    """Where the SVG figures of a Markdown report at ``markdown_path`` go: ``NAME_files/``."""
    return markdown_path.with_name(markdown_path.stem + "_files")


def to_markdown(report: Report, figure_dir: Path | None = None) -> str:
    """Markdown with pipe tables. Plots are SVG files written into ``figure_dir`` and
    linked relative to its parent (the Markdown file's directory); without
    ``figure_dir`` each plot is named in one line (no image data in the text)."""
    lines = [f"# {report.title}", "", f"_generated {report.created}_", ""]
    number = 0
    for sec in report.sections:
        lines += [f"## {sec.title}", ""]
        lines += [f"> {n}" for n in sec.notes]
        for caption, df in sec.tables:
            lines += [f"### {caption}", "", markdown_table(df), ""]
        for caption, draw in sec.plots:
            number += 1
            if figure_dir is None:
                lines += [f"_figure {number}: {caption} (write the report with -o FILE.md)_", ""]
                continue
            name = f"figure-{number:02d}-{_slug(caption)}.svg"
            figure_dir.mkdir(parents=True, exist_ok=True)
            (figure_dir / name).write_text(svg(draw()), encoding="utf-8")
            lines += [f"![{caption}]({figure_dir.name}/{name})", ""]
    return "\n".join(lines)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "plot"


def to_json(report: Report) -> dict[str, Any]:
    """The report as plain data: per section its notes, tables (lists of row objects)
    and the captions of its plots."""
    return {
        "title": report.title,
        "created": report.created,
        "sections": [
            {
                "title": sec.title,
                "notes": list(sec.notes),
                "tables": [
                    {"caption": caption, "rows": json_records(df)} for caption, df in sec.tables
                ],
                "plots": [caption for caption, _ in sec.plots],
            }
            for sec in report.sections
        ],
    }


def markdown_table(df: pd.DataFrame) -> str:
    head = "| " + " | ".join(str(c) for c in df.columns) + " |"
    rule = "|" + "|".join("---" for _ in df.columns) + "|"
    rows = [
        "| " + " | ".join(_fmt(v).replace("|", "\\|") for v in r) + " |"
        for r in df.itertuples(index=False)
    ]
    return "\n".join([head, rule, *rows])


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f0f0f0}td:first-child,th:first-child{text-align:left}
figure{margin:1em 0}figcaption{font-size:12px;color:#555}
.note{color:#a33}.meta{color:#777;font-size:12px}"""
