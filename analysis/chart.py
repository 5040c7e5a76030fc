"""Charts as data: what a figure shows, drawn as SVG by :mod:`analysis.chartsvg`.

A figure is a :class:`Chart`: panels side by side, each a pair of axes (a right-hand y
axis where asked) with its :class:`Mark`s (lines, steps, bars, points), text notes,
horizontal rules, or a :class:`Heat` map. :func:`analysis.chartsvg.svg` draws a chart as
one standalone ``<svg>`` element in a few milliseconds: text stays text, no fonts,
scripts or images are embedded, and the same element serves the HTML report (inline),
the Markdown report (``.svg`` files beside it) and the dashboard (``st.image``). What a
chart shows is its data, so tests read the marks, not pixels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = ["NAMED", "Axis", "Chart", "Floats", "Heat", "Mark", "Panel", "colour", "floats"]

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


def colour(i: int) -> str:
    """The ``i``-th colour of the cycle (one per series, as in a legend)."""
    return PALETTE[i % len(PALETTE)]


def floats(v: Sequence[float] | npt.ArrayLike) -> Floats:
    """``v`` as a flat float64 array."""
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
        return Mark(kind, floats(x), floats(y), **options)  # type: ignore[arg-type]


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
