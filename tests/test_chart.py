"""Charts drawn as SVG by mlscope itself: well-formed for any input, data at the right
place (checked against the drawn tick labels), long curves thinned without changing
their shape, and every figure of the reports and the dashboard drawn from its frames."""

from __future__ import annotations

import re
from xml.etree import ElementTree

import numpy as np
import pandas as pd
import pytest

from analysis import plots
from analysis.chart import Axis, Chart, Heat, Mark, Panel
from analysis.chartdraw import viridis
from analysis.chartscale import tick_text
from analysis.chartsvg import svg

SVG = "{http://www.w3.org/2000/svg}"


def parse(chart: Chart) -> ElementTree.Element:
    root = ElementTree.fromstring(svg(chart))
    assert root.tag == f"{SVG}svg"
    return root


def texts(root: ElementTree.Element) -> dict[str, tuple[float, float]]:
    return {
        t.text or "": (float(t.get("x", 0)), float(t.get("y", 0))) for t in root.iter(f"{SVG}text")
    }


def path_points(d: str) -> np.ndarray:
    """The (x, y) vertices of a path's ``d`` written as M/L pairs and H/V steps."""
    points, x, y = [], 0.0, 0.0
    for op, a, b in re.findall(r"([MLHV])(-?[\d.]+)(?: (-?[\d.]+))?", d):
        if op in "ML":
            x, y = float(a), float(b)
        elif op == "H":
            x = float(a)
        else:
            y = float(a)
        points.append((x, y))
    return np.asarray(points)


def mark_paths(root: ElementTree.Element) -> list[ElementTree.Element]:
    return [p for p in root.iter(f"{SVG}path") if p.get("fill") == "none" and p.get("stroke-width")]


def test_points_sit_where_their_tick_labels_say() -> None:
    """An independent check of the mapping: the tick label "5" is drawn halfway between
    the points at 0 and 10, on both axes."""
    chart = Chart([Panel(marks=[Mark.of("points", [0, 10], [0, 10])])])
    root = parse(chart)
    (x0, y0), (x1, y1) = [
        (float(c.get("cx", 0)), float(c.get("cy", 0))) for c in root.iter(f"{SVG}circle")
    ]
    assert x1 > x0 and y1 < y0  # up and to the right
    labels = [t for t in root.iter(f"{SVG}text") if t.text == "5"]
    x_label = next(t for t in labels if t.get("text-anchor") == "middle")
    y_label = next(t for t in labels if t.get("text-anchor") == "end")
    assert float(x_label.get("x", 0)) == pytest.approx((x0 + x1) / 2, abs=0.2)
    assert float(y_label.get("y", 0)) - 4 == pytest.approx((y0 + y1) / 2, abs=0.2)


def test_a_log_axis_spaces_decades_evenly() -> None:
    chart = Chart(
        [Panel(x=Axis(scale="log"), marks=[Mark.of("line", [1, 10, 100, 1000], [20, 30, 40, 50])])]
    )
    at = texts(parse(chart))
    xs = [at[s][0] for s in ("1", "10", "100", "1000")]
    assert np.allclose(np.diff(xs), np.diff(xs)[0], atol=0.2)


def test_a_long_curve_keeps_its_shape_in_a_few_points_per_pixel() -> None:
    rng = np.random.default_rng(7)
    y = np.sort(rng.lognormal(0, 1, 200_000))
    x = np.arange(y.size, dtype=float)
    chart = Chart([Panel(marks=[Mark.of("step", x, y)])])
    root = parse(chart)
    [curve] = mark_paths(root)
    drawn = path_points(curve.get("d", ""))
    assert len(drawn) <= 4 * 2 * chart.width  # a step adds one corner per point
    # The ends and the extremes are those of the full curve: its first point at the
    # lowest height, its last at the highest.
    assert drawn[:, 1].max() == pytest.approx(drawn[0, 1]) and drawn[:, 1].min() == pytest.approx(
        drawn[-1, 1]
    )
    assert np.all(np.diff(drawn[:, 0]) >= 0)  # still in order


def test_a_missing_value_breaks_the_line() -> None:
    chart = Chart([Panel(marks=[Mark.of("line", [0, 1, 2, 3, 4], [1, 2, np.nan, 2, 1])])])
    [line] = mark_paths(parse(chart))
    assert line.get("d", "").count("M") == 2


@pytest.mark.parametrize(
    "x, y",
    [
        ([], []),
        ([np.nan, np.nan], [np.nan, np.inf]),
        ([5.0], [5.0]),
        ([0.0, -1.0, 1e300], [-1e300, 0.0, 1e-300]),
        ([1, 2, 3], [7, 7, 7]),
    ],
    ids=["empty", "nothing-finite", "one-point", "extremes", "flat"],
)
@pytest.mark.parametrize("scale", ["linear", "log"])
@pytest.mark.parametrize("kind", ["line", "step", "bars", "hbars", "points"])
def test_any_data_draws_a_well_formed_chart(
    x: list[float], y: list[float], scale: str, kind: str
) -> None:
    axis = Axis(scale="log") if scale == "log" else Axis()
    chart = Chart([Panel(x=axis, y=axis, marks=[Mark.of(kind, x, y, label="s")])])  # type: ignore[arg-type]
    root = parse(chart)
    for el in root.iter():
        for name in ("x", "y", "cx", "cy", "width", "height"):
            v = el.get(name)
            if v is not None and not v.endswith("%"):
                assert np.isfinite(float(v)), (el.tag, name, v)
        assert "nan" not in (el.get("d") or "") and "inf" not in (el.get("d") or "")


def test_labels_are_text_never_markup() -> None:
    hostile = '<script>alert("x")</script> & ]]>'
    chart = Chart(
        [
            Panel(
                x=Axis(hostile),
                marks=[Mark.of("points", [1], [1], label=hostile)],
                notes=[(1, 1, hostile)],
            )
        ],
        title=hostile,
    )
    root = parse(chart)
    assert not list(root.iter(f"{SVG}script")) and not list(root.iter("script"))
    assert sum(t.text == hostile for t in root.iter(f"{SVG}text")) == 4  # title, axis, legend, note


def test_tick_labels_are_short() -> None:
    assert [tick_text(v) for v in (0.1 + 0.2, 2500.0, 12_500.0, 3e6, 0.0)] == [
        "0.3",
        "2500",
        "12.5k",
        "3M",
        "0",
    ]


def test_a_heat_map_leaves_missing_cells_empty() -> None:
    heat = Heat(np.array([[1.0, 2.0], [np.nan, 4.0]]), rows=("a", "b"), columns=("1", "2"))
    root = parse(Chart([Panel(heat=heat)]))
    cells = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "cell"]
    values = [t.text for t in root.iter(f"{SVG}text")]
    assert {"1.0", "2.0", "4.0"} <= set(values) and "nan" not in values
    assert len(cells) == 3  # row by row: a1, a2, b2 (b1 is missing)
    [(x1, y1), (x2, _), (_, y3)] = [(float(c.get("x", "")), float(c.get("y", ""))) for c in cells]
    assert x2 > x1 and y3 > y1
    # the colour scale runs from the smallest value to the largest
    low, mid, high = (c.get("fill") for c in cells)
    assert len({low, mid, high}) == 3
    assert (low, high) == (viridis(0.0), viridis(1.0))


# --- the figures of the reports and the dashboard, from their frames -------------------


def windows() -> pd.DataFrame:
    w = pd.DataFrame(
        {
            "start_s": [0.0, 1.0, 2.0],
            "completed_per_s": [100.0, 120.0, 90.0],
            "p50_ms": [1.0, 1.1, np.nan],
            "p90_ms": [2.0, 2.1, 2.2],
            "p99_ms": [4.0, 4.2, 4.4],
        }
    )
    w.attrs["window_s"] = 1.0
    return w


def test_each_figure_is_drawn_from_its_frames() -> None:
    lat = {"ev-a": np.array([1.0, 2.0, 3.0, 4.0]), "ev-b": np.array([2.0, 3.0])}
    pct = plots.latency_percentiles(lat)
    # sample i from q = i / n (nearest rank over (i/n, (i+1)/n]), the last held to 2n
    assert [m.y.tolist() for m in pct.marks] == [[1.0, 2.0, 3.0, 4.0, 4.0], [2.0, 3.0, 3.0]]
    assert pct.marks[0].x.tolist() == pytest.approx(
        [1 / (1 - q) for q in (0, 0.25, 0.5, 0.75)] + [8]
    )
    hist = plots.latency_histogram(lat, bins=4)
    assert [int(m.y.sum()) for m in hist.marks] == [4, 2]  # every sample counted once
    over = plots.latency_over_time(windows(), "ev-a")
    assert [len(p.marks) for p in over.panels] == [1, 3] and over.title == "ev-a"
    top = pd.DataFrame(
        {
            "layer": ["a", "b"],
            "op_type": ["Conv", "Relu"],
            "shape": ["1×8", ""],
            "total_ms": [3.0, 1.0],
            "share": [0.75, 0.25],
        }
    )
    [bars] = plots.layer_bars(top).marks
    assert bars.x.tolist() == [1.0, 3.0]  # largest on top: drawn last, at the highest row
    heat = pd.DataFrame([[1.0, 2.5]], index=["m/f@s"], columns=[1, 4])
    assert plots.speedup_figure(heat).panels[0].heat is not None
    peak = pd.DataFrame(
        {
            "throughput_ips": [100.0, 190.0, np.nan],
            "p99_ms": [1.0, 9.0, np.nan],
            "valid": [True, False, False],
            "requested_qps": [100.0, 200.0, 300.0],
        }
    )
    peak_chart = plots.throughput_latency(peak, bound_ms=5.0)
    line, ok, bad = peak_chart.marks
    assert line.x.tolist() == [100.0, 190.0] and line.y.tolist() == [1.0, 9.0]
    assert ok.x.tolist() == [100.0] and bad.x.tolist() == [190.0]
    assert peak_chart.panels[0].rules == [(5.0, "red", "bound 5 ms")]
    for chart in (pct, hist, over, plots.layer_bars(top), plots.speedup_figure(heat)):
        parse(chart)


def test_figures_of_empty_frames_still_draw() -> None:
    empty_windows = windows().iloc[:0]
    empty_windows.attrs["window_s"] = 1.0
    for chart in (
        plots.latency_percentiles({}),
        plots.latency_histogram({"ev": np.array([0.0, -1.0])}),
        plots.latency_over_time(empty_windows),
        plots.layer_bars(pd.DataFrame(columns=["layer", "op_type", "shape", "total_ms", "share"])),
        plots.speedup_figure(pd.DataFrame()),
    ):
        parse(chart)
