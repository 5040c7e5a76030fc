"""Charts as data, drawn as SVG by mlscope itself.

A figure is a :class:`Chart`: panels side by side, each a pair of axes (a right-hand y
axis where asked) with its :class:`Mark`s (lines, steps, bars, points), text notes,
horizontal rules, or a :class:`Heat` map. :func:`svg` draws a chart as one standalone
``<svg>`` element in a few milliseconds: text stays text, no fonts, scripts or images are
embedded, and the same element serves the HTML report (inline), the Markdown report
(``.svg`` files beside it) and the dashboard (``st.image``). What a chart shows is its
data, so tests read the marks, not pixels.

A line with more points than its panel has pixels keeps, in each pixel column, its first,
last, lowest and highest point: the drawn shape is the same at that resolution (a
percentile curve of 10^5 samples is a few thousand points, not 10^5).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = ["Axis", "Chart", "Heat", "Mark", "Panel", "colour", "svg"]

Floats = npt.NDArray[np.float64]
Kind = Literal["line", "step", "bars", "hbars", "points"]

# matplotlib's "tab10" cycle: C0..C9 name these, in this order
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
NAMED = {"blue": PALETTE[0], "green": PALETTE[2], "red": PALETTE[3], "grey": "#888888"}
FONT = 11  # px, tick labels and legend
CHAR = 0.6  # a character's width in font sizes (system-ui, digits and lower case)


def colour(i: int) -> str:
    """The ``i``-th colour of the cycle (one per series, as in a legend)."""
    return PALETTE[i % len(PALETTE)]


def _floats(v: Sequence[float] | npt.ArrayLike) -> Floats:
    return np.asarray(v, dtype=np.float64).reshape(-1)


@dataclass(frozen=True)
class Mark:
    """One series drawn on a panel.

    ``kind``: ``line`` (``marker`` at each point when given), ``step`` (a horizontal step
    from each point to the next, as a sorted sample's curve), ``bars`` (vertical, ``x``
    is each bar's left edge, ``width`` in x units), ``hbars`` (horizontal, ``y`` is the
    bar's row, ``x`` its length) or ``points`` (``sizes``: each point's area in px²).
    """

    kind: Kind
    x: Floats
    y: Floats
    label: str = ""
    colour: str = ""
    dashed: bool = False
    marker: Literal["", "o", "x", "."] = ""
    width: Floats | float = 0.8
    sizes: Floats | None = None
    right: bool = False
    """Measured on the panel's right-hand y axis."""
    opacity: float = 1.0

    @staticmethod
    def of(
        kind: Kind,
        x: npt.ArrayLike,
        y: npt.ArrayLike,
        **options: object,
    ) -> Mark:
        """A mark of ``kind`` over any array-likes (numbers, NaN where there is none)."""
        return Mark(kind, _floats(x), _floats(y), **options)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Axis:
    label: str = ""
    scale: Literal["linear", "log"] = "linear"
    base: float = 10.0
    ticks: tuple[tuple[float, str], ...] | None = None
    """Where the ticks are and what they say; default: round numbers over the data."""


@dataclass(frozen=True)
class Heat:
    """A table of values as coloured cells (``nan``: an empty cell), with a colour bar."""

    values: Floats
    rows: tuple[str, ...]
    columns: tuple[str, ...]
    x_label: str = ""
    bar_label: str = ""


@dataclass
class Panel:
    x: Axis = field(default_factory=Axis)
    y: Axis = field(default_factory=Axis)
    y2: Axis | None = None
    marks: list[Mark] = field(default_factory=list)
    notes: list[tuple[float, float, str]] = field(default_factory=list)
    """Text at a data point, as a point's label."""
    rules: list[tuple[float, str, str]] = field(default_factory=list)
    """Horizontal lines: (y, colour, legend label)."""
    heat: Heat | None = None


@dataclass
class Chart:
    panels: list[Panel]
    title: str = ""
    width: int = 600
    height: int = 320

    @property
    def marks(self) -> list[Mark]:
        return [m for p in self.panels for m in p.marks]


# --- scales ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Scale:
    lo: float
    hi: float
    log: bool
    base: float
    ticks: tuple[tuple[float, str], ...]

    def unit(self, v: Floats) -> Floats:
        """``v`` as a fraction of the axis (0 at ``lo``, 1 at ``hi``)."""
        if self.log:
            with np.errstate(divide="ignore", invalid="ignore"):
                v = np.where(v > 0, np.log(np.where(v > 0, v, 1.0)), np.nan)
            lo, hi = math.log(self.lo), math.log(self.hi)
        else:
            lo, hi = self.lo, self.hi
        return (v - lo) / (hi - lo)


def tick_text(v: float) -> str:
    """A tick's label: short, no float noise (0.30000000000000004 is "0.3")."""
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:.4g}M"
    if a >= 1e4:
        return f"{v / 1e3:.4g}k"
    return f"{v:.6g}"


def _nice_step(span: float, count: int = 5) -> float:
    raw = span / count
    power = 10 ** math.floor(math.log10(raw))
    return float(next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw))


def _linear_ticks(lo: float, hi: float) -> tuple[tuple[float, str], ...]:
    step = _nice_step(hi - lo)
    first = math.ceil(lo / step - 1e-9)
    values = [k * step for k in range(first, math.floor(hi / step + 1e-9) + 1)]
    return tuple((round(v, 12), tick_text(round(v, 12))) for v in values)


def _log_ticks(lo: float, hi: float, base: float) -> tuple[tuple[float, str], ...]:
    k0, k1 = math.ceil(math.log(lo, base) - 1e-9), math.floor(math.log(hi, base) + 1e-9)
    values = [base**k for k in range(k0, k1 + 1)]
    if base == 10 and len(values) < 2:  # under a decade: 1-2-5 steps
        values = [
            m * 10**k
            for k in range(k0 - 1, k1 + 1)
            for m in (1, 2, 5)
            if lo <= m * 10**k <= hi * (1 + 1e-9)
        ]
    if len(values) > 12:  # a wide range: every n-th power
        every = math.ceil(len(values) / 8)
        values = values[::every]
    if len(values) < 2:
        return _linear_ticks(lo, hi)
    return tuple((v, tick_text(v)) for v in values)


def _scale(axis: Axis, values: Floats, floor: float | None = None) -> _Scale:
    """The axis over ``values`` (NaN ignored), padded 5%; ``floor``: a bar's base that
    the axis starts at, unpadded."""
    log = axis.scale == "log"
    v = values[np.isfinite(values) & ((values > 0) if log else True)]
    v = np.clip(v, 1e-150 if log else -1e150, 1e150)  # padded ranges stay finite
    if floor is not None and not log:
        v = np.append(v, floor)
    if axis.ticks:
        v = np.append(v, [t for t, _ in axis.ticks if not log or t > 0])
    if not v.size:
        lo, hi = (1.0, axis.base) if log else (0.0, 1.0)
    else:
        lo, hi = float(v.min()), float(v.max())
    if log:
        if hi <= lo:
            lo, hi = lo / axis.base, hi * axis.base
        pad = (hi / lo) ** 0.05
        lo, hi = lo / pad, hi * pad
    else:
        if hi <= lo:
            lo, hi = lo - (abs(lo) or 1.0) * 0.5, hi + (abs(hi) or 1.0) * 0.5
        pad = (hi - lo) * 0.05
        lo = lo if floor is not None and lo == floor else lo - pad
        hi += pad
    ticks = axis.ticks or (_log_ticks(lo, hi, axis.base) if log else _linear_ticks(lo, hi))
    ticks = tuple((t, s) for t, s in ticks if lo <= t <= hi)
    return _Scale(lo, hi, log, axis.base, ticks)


# --- drawing --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Box:
    left: float
    top: float
    width: float
    height: float

    def px(self, sx: _Scale, x: Floats) -> Floats:
        return self.left + sx.unit(x) * self.width

    def py(self, sy: _Scale, y: Floats) -> Floats:
        return self.top + (1 - sy.unit(y)) * self.height


def _text(x: float, y: float, s: str, *, size: int = FONT, anchor: str = "middle", **a: str) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in a.items())
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{extra}>'
        f"{escape(s)}</text>"
    )


def _width(s: str, size: int = FONT) -> float:
    return len(s) * size * CHAR


def _rect(x: float, y: float, w: float, h: float, fill: str, extra: str = "") -> str:
    return f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}"{extra}/>'


def _rule(x0: float, x1: float, y: float, stroke: str, extra: str = "") -> str:
    return f'<path d="M{x0:.1f} {y:.1f}H{x1:.1f}" stroke="{stroke}"{extra}/>'


def _thin(px: Floats, py: Floats) -> tuple[Floats, Floats]:
    """At most four points per pixel column (first, last, lowest, highest)."""
    if px.size <= 2000:
        return px, py
    col = np.floor(px)
    order = np.lexsort((py, col))  # by column, then by height
    c = col[order]
    starts = np.flatnonzero(np.r_[True, c[1:] != c[:-1]])
    ends = np.r_[starts[1:], c.size] - 1
    first = np.flatnonzero(np.r_[True, col[1:] != col[:-1]])
    last = np.r_[first[1:], col.size] - 1
    keep = np.unique(np.concatenate([order[starts], order[ends], first, last]))
    return px[keep], py[keep]


def _path(px: Floats, py: Floats, *, step: bool) -> str:
    """``d`` of a polyline, broken where a value is missing."""
    out, pen = [], "M"
    for x, y in zip(px.tolist(), py.tolist(), strict=True):
        if not (math.isfinite(x) and math.isfinite(y)):
            pen = "M"
            continue
        if step and pen == "L":
            out.append(f"H{x:.1f}V{y:.1f}")
        else:
            out.append(f"{pen}{x:.1f} {y:.1f}")
        pen = "L"
    return "".join(out)


def _markers(
    px: Floats, py: Floats, marker: str, fill: str, sizes: Floats | None, default_r: float
) -> list[str]:
    ok = np.isfinite(px) & np.isfinite(py)
    radii = np.sqrt(sizes / math.pi) if sizes is not None else None
    out = []
    for i in np.flatnonzero(ok).tolist():
        x, y = px[i], py[i]
        r = float(radii[i]) if radii is not None else default_r
        if marker == "x":
            out.append(
                f'<path d="M{x - r:.1f} {y - r:.1f}L{x + r:.1f} {y + r:.1f}'
                f'M{x - r:.1f} {y + r:.1f}L{x + r:.1f} {y - r:.1f}" stroke="{fill}" '
                'stroke-width="2" fill="none"/>'
            )
        else:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r:.1f}" fill="{fill}"/>')
    return out


def _draw_mark(m: Mark, box: _Box, sx: _Scale, sy: _Scale, fill: str) -> list[str]:
    opacity = f' opacity="{m.opacity:g}"' if m.opacity < 1 else ""
    if m.kind in ("line", "step"):
        px, py = _thin(box.px(sx, m.x), box.py(sy, m.y))
        dash = ' stroke-dasharray="5 3"' if m.dashed else ""
        out = [
            f'<path d="{_path(px, py, step=m.kind == "step")}" fill="none" stroke="{fill}" '
            f'stroke-width="1.75"{dash}{opacity}/>'
        ]
        radius = 2.5 if m.marker == "." else 3.5
        return out + (_markers(px, py, m.marker, fill, None, radius) if m.marker else [])
    if m.kind == "points":
        px, py = box.px(sx, m.x), box.py(sy, m.y)
        marks = _markers(px, py, m.marker or "o", fill, m.sizes, 4.5)  # 6 pt, as a scatter
        return [f"<g{opacity}>", *marks, "</g>"]
    widths = np.broadcast_to(_floats(m.width), m.x.shape)
    if m.kind == "bars":
        x0, x1 = box.px(sx, m.x), box.px(sx, m.x + widths)
        base = sy.lo if sy.log else max(sy.lo, min(0.0, sy.hi))
        y0, y1 = box.py(sy, _floats([base]))[0], box.py(sy, m.y)
        rects = [
            (a, min(y0, c), b - a, abs(y0 - c))
            for a, b, c in zip(x0.tolist(), x1.tolist(), y1.tolist(), strict=True)
            if math.isfinite(a + b + c)
        ]
    else:  # hbars: rows at y, length x from 0
        y0, y1 = box.py(sy, m.y - widths / 2), box.py(sy, m.y + widths / 2)
        x0, x1 = box.px(sx, _floats([max(sx.lo, 0.0)]))[0], box.px(sx, m.x)
        rects = [
            (min(x0, c), b, abs(c - x0), a - b)
            for a, b, c in zip(y0.tolist(), y1.tolist(), x1.tolist(), strict=True)
            if math.isfinite(a + b + c)
        ]
    return [_rect(x, y, w, h, fill, opacity) for x, y, w, h in rects]


def _legend(
    entries: list[tuple[str, str, bool, str]], left: float, top: float, width: float
) -> tuple[list[str], float]:
    """Legend entries (label, colour, dashed, kind) flowing in rows under a panel; the
    drawn elements and the height they take."""
    out, x, y = [], left, top
    for label, fill, dashed, kind in entries:
        w = 22 + _width(label, 10) + 12
        if x > left and x + w > left + width:
            x, y = left, y + 15
        if kind in ("line", "step", "rule"):
            dash = ' stroke-dasharray="5 3"' if dashed else ""
            out.append(
                f'<path d="M{x:.1f} {y - 3.5:.1f}h16" stroke="{fill}" stroke-width="2"{dash}/>'
            )
        else:
            out.append(
                f'<rect x="{x + 4:.1f}" y="{y - 8:.1f}" width="9" height="9" fill="{fill}"/>'
            )
        out.append(_text(x + 20, y, label, size=10, anchor="start"))
        x += w
    return out, (y - top + 15) if entries else 0.0


def _viridis(t: float) -> str:
    """A colour of the viridis map at ``t`` in [0, 1] (five stops, interpolated)."""
    stops = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))
    t = min(max(t, 0.0), 1.0) * (len(stops) - 1)
    i = min(int(t), len(stops) - 2)
    f = t - i
    r, g, b = (round(a + (b - a) * f) for a, b in zip(stops[i], stops[i + 1], strict=True))
    return f"#{r:02x}{g:02x}{b:02x}"


def _draw_heat(h: Heat, left: float, top: float, width: float, height: float) -> list[str]:
    values = np.asarray(h.values, dtype=np.float64).reshape(len(h.rows), len(h.columns))
    label_w = max((_width(r, 10) for r in h.rows), default=0) + 8
    bar_w = 12 + 13 + max(_width(h.bar_label, 10), 30)
    gx, gw = left + label_w, max(width - label_w - bar_w, 10)
    cw, ch = gw / max(len(h.columns), 1), (height - 34) / max(len(h.rows), 1)
    finite = values[np.isfinite(values)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    span = (hi - lo) or 1.0
    out = []
    for (i, j), v in np.ndenumerate(values):
        x, y = gx + j * cw, top + i * ch
        if not math.isfinite(v):
            continue
        t = (v - lo) / span
        out.append(_rect(x, y, cw, ch, _viridis(t), ' class="cell"'))
        ink = "#000" if t > 0.6 else "#fff"
        out.append(_text(x + cw / 2, y + ch / 2 + 4, f"{v:.1f}", size=10, fill=ink))
    for i, r in enumerate(h.rows):
        out.append(_text(gx - 5, top + (i + 0.5) * ch + 4, r, size=10, anchor="end"))
    bottom = top + len(h.rows) * ch
    for j, c in enumerate(h.columns):
        out.append(_text(gx + (j + 0.5) * cw, bottom + 14, c))
    out.append(_text(gx + gw / 2, bottom + 30, h.x_label))
    bx = gx + gw + 12
    stops = "".join(
        f'<stop offset="{k / 4:g}" stop-color="{_viridis(1 - k / 4)}"/>' for k in range(5)
    )
    out += [
        f'<defs><linearGradient id="heatbar" x2="0" y2="1">{stops}</linearGradient></defs>',
        _rect(bx, top, 10, bottom - top, "url(#heatbar)"),
        _text(bx + 13, top + 9, tick_text(round(hi, 2)), size=10, anchor="start"),
        _text(bx + 13, bottom, tick_text(round(lo, 2)), size=10, anchor="start"),
        _text(bx + 13, (top + bottom) / 2 + 4, h.bar_label, size=10, anchor="start"),
    ]
    return out


def _axis_values(panel: Panel, right: bool, which: str) -> tuple[Floats, float | None]:
    """The data an axis spans, and the base its bars stand on (when they do)."""
    parts, floor = [], None
    for m in panel.marks:
        if which == "x":
            parts.append(m.x)
            if m.kind == "bars":
                parts.append(m.x + np.broadcast_to(_floats(m.width), m.x.shape))
            if m.kind == "hbars":
                floor = 0.0
        elif m.right == right:
            parts.append(m.y)
            if m.kind == "bars":
                floor = 0.0
            if m.kind == "hbars":
                w = np.broadcast_to(_floats(m.width), m.y.shape) / 2
                parts += [m.y - w, m.y + w]
    if which == "y" and not right:
        parts.append(_floats([r[0] for r in panel.rules]))
    return (np.concatenate(parts) if parts else _floats([])), floor


@dataclass(frozen=True)
class _Axes:
    """A panel's plotting box and its scales."""

    box: _Box
    x: _Scale
    y: _Scale
    y2: _Scale | None

    def at(self, x: float, y: float, *, right: bool = False) -> tuple[float, float]:
        sy = self.y2 if right and self.y2 is not None else self.y
        return float(self.box.px(self.x, _floats([x]))[0]), float(self.box.py(sy, _floats([y]))[0])


def _axes(panel: Panel, left: float, top: float, width: float, height: float) -> _Axes:
    sx = _scale(panel.x, *_axis_values(panel, False, "x"))
    sy = _scale(panel.y, *_axis_values(panel, False, "y"))
    sy2 = _scale(panel.y2, *_axis_values(panel, True, "y")) if panel.y2 else None
    tick_w = max((_width(s) for _, s in sy.ticks), default=0)
    inner = left + 8 + (16 if panel.y.label else 0) + tick_w + 6
    right_w = 8.0
    if sy2 is not None:
        right_w += max((_width(s) for _, s in sy2.ticks), default=0) + 26
    return _Axes(
        _Box(inner, top + 8, max(left + width - right_w - inner, 10), height - 42), sx, sy, sy2
    )


def _frame(panel: Panel, ax: _Axes, left: float, width: float) -> list[str]:
    """The box, grid, ticks and axis labels."""
    box = ax.box
    bottom, right = box.top + box.height, box.left + box.width
    grid = ' stroke-opacity="0.12"'
    out = [_rect(box.left, box.top, box.width, box.height, "none", ' stroke="#333"')]
    for t, s in ax.x.ticks:
        x = ax.at(t, ax.y.lo)[0]
        out += [f'<path d="M{x:.1f} {box.top:.1f}V{bottom:.1f}" stroke="#000"{grid}/>']
        out.append(_text(x, bottom + 14, s))
    for t, s in ax.y.ticks:
        y = ax.at(ax.x.lo, t)[1]
        out += [
            _rule(box.left, right, y, "#000", grid),
            _text(box.left - 5, y + 4, s, anchor="end"),
        ]
    for t, s in ax.y2.ticks if ax.y2 is not None else ():
        out.append(_text(right + 5, ax.at(ax.x.lo, t, right=True)[1] + 4, s, anchor="start"))
    out.append(_text(box.left + box.width / 2, bottom + 30, panel.x.label))
    cy = box.top + box.height / 2
    for label, x in (
        (panel.y.label, left + 12),
        (panel.y2.label if panel.y2 else "", left + width - 8),
    ):
        if label:
            out.append(_text(x, cy, label, transform=f"rotate(-90 {x:.1f} {cy:.1f})"))
    return out


def _contents(panel: Panel, ax: _Axes) -> tuple[list[str], list[tuple[str, str, bool, str]]]:
    """The marks, rules and notes, and the legend's entries."""
    out = ["<g>"]
    entries: list[tuple[str, str, bool, str]] = []
    for i, m in enumerate(panel.marks):
        fill = NAMED.get(m.colour, m.colour) or colour(i)
        sy = ax.y2 if m.right and ax.y2 is not None else ax.y
        out += _draw_mark(m, ax.box, ax.x, sy, fill)
        if m.label:
            entries.append((m.label, fill, m.dashed, m.kind))
    right = ax.box.left + ax.box.width
    for y, c, label in panel.rules:
        fill = NAMED.get(c, c)
        dash = ' stroke-dasharray="2 3" stroke-width="1.5"'
        out.append(_rule(ax.box.left, right, ax.at(ax.x.lo, y)[1], fill, dash))
        if label:
            entries.append((label, fill, True, "rule"))
    for x, y, s in panel.notes:
        px, py = ax.at(x, y)
        if math.isfinite(px) and math.isfinite(py):  # near the right edge: to the left
            flip = px + 3 + _width(s, 9) > right
            anchor = "end" if flip else "start"
            out.append(_text(px - 3 if flip else px + 3, py - 3, s, size=9, anchor=anchor))
    return [*out, "</g>"], entries


def _draw_panel(
    panel: Panel, left: float, top: float, width: float, height: float
) -> tuple[list[str], float]:
    """A panel's elements in the rectangle given, and the legend's extra height."""
    if panel.heat is not None:
        return _draw_heat(panel.heat, left + 6, top + 6, width - 12, height - 6), 0.0
    ax = _axes(panel, left, top, width, height)
    drawn, entries = _contents(panel, ax)
    legend, extra = _legend(entries, ax.box.left, top + height + 14, ax.box.width)
    return _frame(panel, ax, left, width) + drawn + legend, extra


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
    title = [_text(chart.width / 2, 14, chart.title, size=12)] if chart.title else []
    return "".join([head, *title, *parts, "</svg>"])
