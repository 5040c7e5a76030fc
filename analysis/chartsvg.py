"""A :class:`analysis.chart.Chart` drawn as one standalone ``<svg>`` element
(:func:`svg`): each panel's axes laid out, framed and filled with its marks, rules,
notes and legend."""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

from analysis.chart import NAMED, Chart, Panel, colour, floats
from analysis.chartdraw import Box, draw_heat, draw_mark, legend, rect, rule, text, text_width
from analysis.chartscale import Scale, axis_values, scale

__all__ = ["svg"]


@dataclass(frozen=True)
class _Axes:
    """A panel's plotting box and its scales."""

    box: Box
    x: Scale
    y: Scale
    y2: Scale | None

    def at(self, x: float, y: float, *, right: bool = False) -> tuple[float, float]:
        sy = self.y2 if right and self.y2 is not None else self.y
        return float(self.box.px(self.x, floats([x]))[0]), float(self.box.py(sy, floats([y]))[0])


def _axes(panel: Panel, left: float, top: float, width: float, height: float) -> _Axes:
    sx = scale(panel.x, *axis_values(panel, False, "x"))
    sy = scale(panel.y, *axis_values(panel, False, "y"))
    sy2 = scale(panel.y2, *axis_values(panel, True, "y")) if panel.y2 else None
    tick_w = max((text_width(s) for _, s in sy.ticks), default=0)
    inner = left + 8 + (16 if panel.y.label else 0) + tick_w + 6
    right_w = 8.0
    if sy2 is not None:
        right_w += max((text_width(s) for _, s in sy2.ticks), default=0) + 26
    return _Axes(
        Box(inner, top + 8, max(left + width - right_w - inner, 10), height - 42), sx, sy, sy2
    )


def _frame(panel: Panel, ax: _Axes, left: float, width: float) -> list[str]:
    """The box, grid, ticks and axis labels."""
    box = ax.box
    bottom, right = box.top + box.height, box.left + box.width
    grid = ' stroke-opacity="0.12"'
    out = [rect(box.left, box.top, box.width, box.height, "none", ' stroke="#333"')]
    for t, s in ax.x.ticks:
        x = ax.at(t, ax.y.lo)[0]
        out += [f'<path d="M{x:.1f} {box.top:.1f}V{bottom:.1f}" stroke="#000"{grid}/>']
        out.append(text(x, bottom + 14, s))
    for t, s in ax.y.ticks:
        y = ax.at(ax.x.lo, t)[1]
        out += [
            rule(box.left, right, y, "#000", grid),
            text(box.left - 5, y + 4, s, anchor="end"),
        ]
    for t, s in ax.y2.ticks if ax.y2 is not None else ():
        out.append(text(right + 5, ax.at(ax.x.lo, t, right=True)[1] + 4, s, anchor="start"))
    out.append(text(box.left + box.width / 2, bottom + 30, panel.x.label))
    cy = box.top + box.height / 2
    for label, x in (
        (panel.y.label, left + 12),
        (panel.y2.label if panel.y2 else "", left + width - 8),
    ):
        if label:
            out.append(text(x, cy, label, transform=f"rotate(-90 {x:.1f} {cy:.1f})"))
    return out


def _contents(panel: Panel, ax: _Axes) -> tuple[list[str], list[tuple[str, str, bool, str]]]:
    """The marks, rules and notes, and the legend's entries."""
    out = ["<g>"]
    entries: list[tuple[str, str, bool, str]] = []
    for i, m in enumerate(panel.marks):
        fill = NAMED.get(m.colour, m.colour) or colour(i)
        sy = ax.y2 if m.right and ax.y2 is not None else ax.y
        out += draw_mark(m, ax.box, ax.x, sy, fill)
        if m.label:
            entries.append((m.label, fill, m.dashed, m.kind))
    right = ax.box.left + ax.box.width
    for y, c, label in panel.rules:
        fill = NAMED.get(c, c)
        dash = ' stroke-dasharray="2 3" stroke-width="1.5"'
        out.append(rule(ax.box.left, right, ax.at(ax.x.lo, y)[1], fill, dash))
        if label:
            entries.append((label, fill, True, "rule"))
    for x, y, s in panel.notes:
        px, py = ax.at(x, y)
        if math.isfinite(px) and math.isfinite(py):  # near the right edge: to the left
            flip = px + 3 + text_width(s, 9) > right
            anchor = "end" if flip else "start"
            out.append(text(px - 3 if flip else px + 3, py - 3, s, size=9, anchor=anchor))
    return [*out, "</g>"], entries


def _draw_panel(
    panel: Panel, left: float, top: float, width: float, height: float
) -> tuple[list[str], float]:
    """A panel's elements in the rectangle given, and the legend's extra height."""
    if panel.heat is not None:
        return draw_heat(panel.heat, left + 6, top + 6, width - 12, height - 6), 0.0
    ax = _axes(panel, left, top, width, height)
    drawn, entries = _contents(panel, ax)
    key, extra = legend(entries, ax.box.left, top + height + 14, ax.box.width)
    return _frame(panel, ax, left, width) + drawn + key, extra


def svg(chart: Chart) -> str:
    """The chart as one standalone ``<svg>`` element (scales to its container's width)."""
    title_h = 20 if chart.title else 0
    n = max(len(chart.panels), 1)
    w = chart.width / n
    parts: list[str] = []
    legend_h = 0.0
    for i, panel in enumerate(chart.panels):
        drawn, extra = _draw_panel(panel, i * w, title_h, w, chart.height - title_h)
        parts += drawn
        legend_h = max(legend_h, extra)
    height = chart.height + legend_h + (6 if legend_h else 0)
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{chart.width}" height="{height:.0f}" '
        f'viewBox="0 0 {chart.width} {height:.0f}" font-family="system-ui,sans-serif" '
        f'style="max-width:100%;height:auto" role="img">'
        + (f"<title>{escape(chart.title)}</title>" if chart.title else "")
        + '<rect width="100%" height="100%" fill="#fff"/>'
    )
    title = [text(chart.width / 2, 14, chart.title, size=12)] if chart.title else []
    return "".join([head, *title, *parts, "</svg>"])
