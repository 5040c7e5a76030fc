"""A report as a document, and its renderings: one self-contained HTML file, Markdown
or plain data.

:func:`to_html` embeds plots as inline SVG, so the file stands alone; :func:`to_markdown`
writes each plot as an SVG file into a directory beside it (``report_files/``) and
links it, or, with no directory (a terminal), names the plot in one line; :func:`to_json`
gives the tables and notes as plain data (plots are named, not drawn). Plots are
:class:`analysis.chart.Chart`s, drawn by :mod:`analysis.chartsvg` (no plotting package).
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.chart import Chart
from analysis.chartsvg import svg
from analysis.records import json_records

__all__ = [
    "Report",
    "Section",
    "figure_dir_for",
    "markdown_table",
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
    """What was asked of the report and could not be shown
    (:func:`analysis.report.price_warnings`): a caller says it beside the report
    (``mlscope report``: on stderr)."""


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
