"""SVG elements of a chart: text, rectangles and rules, a mark's path, bars or points,
the legend, and a heat map with its colour bar.

A line with more points than its panel has pixels keeps, in each pixel column, its first,
last, lowest and highest point: the drawn shape is the same at that resolution (a
percentile curve of 10^5 samples is a few thousand points, not 10^5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

import numpy as np

from analysis.chart import Floats, Heat, Mark, floats
from analysis.chartscale import Scale, tick_text

__all__ = [
    "Box",
    "draw_heat",
    "draw_mark",
    "legend",
    "rect",
    "rule",
    "text",
    "text_width",
    "viridis",
]

FONT = 11  # px, tick labels and legend
CHAR = 0.6  # a character's width in font sizes (system-ui, digits and lower case)


@dataclass(frozen=True)
class Box:
    left: float
    top: float
    width: float
    height: float

    def px(self, sx: Scale, x: Floats) -> Floats:
        return self.left + sx.unit(x) * self.width

    def py(self, sy: Scale, y: Floats) -> Floats:
        return self.top + (1 - sy.unit(y)) * self.height


def text(x: float, y: float, s: str, *, size: int = FONT, anchor: str = "middle", **a: str) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in a.items())
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}"{extra}>'
        f"{escape(s)}</text>"
    )


def text_width(s: str, size: int = FONT) -> float:
    return len(s) * size * CHAR


def rect(x: float, y: float, w: float, h: float, fill: str, extra: str = "") -> str:
    return f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="{fill}"{extra}/>'


def rule(x0: float, x1: float, y: float, stroke: str, extra: str = "") -> str:
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


def draw_mark(m: Mark, box: Box, sx: Scale, sy: Scale, fill: str) -> list[str]:
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
    widths = np.broadcast_to(floats(m.width), m.x.shape)
    if m.kind == "bars":
        x0, x1 = box.px(sx, m.x), box.px(sx, m.x + widths)
        base = sy.lo if sy.log else max(sy.lo, min(0.0, sy.hi))
        y0, y1 = box.py(sy, floats([base]))[0], box.py(sy, m.y)
        rects = [
            (a, min(y0, c), b - a, abs(y0 - c))
            for a, b, c in zip(x0.tolist(), x1.tolist(), y1.tolist(), strict=True)
            if math.isfinite(a + b + c)
        ]
    else:  # hbars: rows at y, length x from 0
        y0, y1 = box.py(sy, m.y - widths / 2), box.py(sy, m.y + widths / 2)
        x0, x1 = box.px(sx, floats([max(sx.lo, 0.0)]))[0], box.px(sx, m.x)
        rects = [
            (min(x0, c), b, abs(c - x0), a - b)
            for a, b, c in zip(y0.tolist(), y1.tolist(), x1.tolist(), strict=True)
            if math.isfinite(a + b + c)
        ]
    return [rect(x, y, w, h, fill, opacity) for x, y, w, h in rects]


def legend(
    entries: list[tuple[str, str, bool, str]], left: float, top: float, width: float
) -> tuple[list[str], float]:
    """Legend entries (label, colour, dashed, kind) flowing in rows under a panel; the
    drawn elements and the height they take."""
    out, x, y = [], left, top
    for label, fill, dashed, kind in entries:
        w = 22 + text_width(label, 10) + 12
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
        out.append(text(x + 20, y, label, size=10, anchor="start"))
        x += w
    return out, (y - top + 15) if entries else 0.0


def viridis(t: float) -> str:
    """A colour of the viridis map at ``t`` in [0, 1] (five stops, interpolated)."""
    stops = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))
    t = min(max(t, 0.0), 1.0) * (len(stops) - 1)
    i = min(int(t), len(stops) - 2)
    f = t - i
    r, g, b = (round(a + (b - a) * f) for a, b in zip(stops[i], stops[i + 1], strict=True))
    return f"#{r:02x}{g:02x}{b:02x}"


def draw_heat(h: Heat, left: float, top: float, width: float, height: float) -> list[str]:
    values = np.asarray(h.values, dtype=np.float64).reshape(len(h.rows), len(h.columns))
    label_w = max((text_width(r, 10) for r in h.rows), default=0) + 8
    bar_w = 12 + 13 + max(text_width(h.bar_label, 10), 30)
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
        out.append(rect(x, y, cw, ch, viridis(t), ' class="cell"'))
        ink = "#000" if t > 0.6 else "#fff"
        out.append(text(x + cw / 2, y + ch / 2 + 4, f"{v:.1f}", size=10, fill=ink))
    for i, r in enumerate(h.rows):
        out.append(text(gx - 5, top + (i + 0.5) * ch + 4, r, size=10, anchor="end"))
    bottom = top + len(h.rows) * ch
    for j, c in enumerate(h.columns):
        out.append(text(gx + (j + 0.5) * cw, bottom + 14, c))
    out.append(text(gx + gw / 2, bottom + 30, h.x_label))
    bx = gx + gw + 12
    stops = "".join(
        f'<stop offset="{k / 4:g}" stop-color="{viridis(1 - k / 4)}"/>' for k in range(5)
    )
    out += [
        f'<defs><linearGradient id="heatbar" x2="0" y2="1">{stops}</linearGradient></defs>',
        rect(bx, top, 10, bottom - top, "url(#heatbar)"),
        text(bx + 13, top + 9, tick_text(round(hi, 2)), size=10, anchor="start"),
        text(bx + 13, bottom, tick_text(round(lo, 2)), size=10, anchor="start"),
        text(bx + 13, (top + bottom) / 2 + 4, h.bar_label, size=10, anchor="start"),
    ]
    return out
