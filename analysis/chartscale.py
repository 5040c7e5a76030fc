"""A chart's axes as numbers: the range an axis spans over its panel's data, padded,
linear or logarithmic, and its ticks (round numbers, or powers of the base)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from analysis.chart import Axis, Floats, Panel, floats

__all__ = ["Scale", "axis_values", "scale", "tick_text"]


@dataclass(frozen=True)
class Scale:
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


def scale(axis: Axis, values: Floats, floor: float | None = None) -> Scale:
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
    return Scale(lo, hi, log, axis.base, ticks)


def axis_values(panel: Panel, right: bool, which: str) -> tuple[Floats, float | None]:
    """The data an axis spans, and the base its bars stand on (when they do)."""
    parts, floor = [], None
    for m in panel.marks:
        if which == "x":
            parts.append(m.x)
            if m.kind == "bars":
                parts.append(m.x + np.broadcast_to(floats(m.width), m.x.shape))
            if m.kind == "hbars":
                floor = 0.0
        elif m.right == right:
            parts.append(m.y)
            if m.kind == "bars":
                floor = 0.0
            if m.kind == "hbars":
                w = np.broadcast_to(floats(m.width), m.y.shape) / 2
                parts += [m.y - w, m.y + w]
    if which == "y" and not right:
        parts.append(floats([r[0] for r in panel.rules]))
    return (np.concatenate(parts) if parts else floats([])), floor
