"""The figures of reports and the dashboard, as :class:`analysis.chart.Chart`s.

Plots draw frames that :mod:`analysis` computed; they compute nothing themselves (a
percentile curve is the sorted samples, drawn; a histogram counts them into bins).
:func:`analysis.chartsvg.svg` draws any of them (no plotting package needed).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from analysis.chart import Axis, Chart, Heat, Mark, Panel, colour
from analysis.figures import SERIES_KEY, measured_runs, prefer_valid, series_label

__all__ = [
    "accuracy_scatter",
    "latency_histogram",
    "latency_over_time",
    "latency_percentiles",
    "layer_bars",
    "percentile_curve",
    "speedup_figure",
    "throughput_by_batch",
    "throughput_latency",
]


def percentile_curve(sorted_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The step of a percentile curve of ``sorted_ms`` (ascending, n values) on a log
    axis of 1 / (1 - q), where 50 %, 90 %, 99 %, 99.9 % are evenly spaced.

    Sample i (0-based) is the nearest-rank percentile (:mod:`mlscope.stats`: rank
    ceil(q n)) of every q in (i / n, (i + 1) / n], so its level starts at
    x = n / (n - i) and holds up to the next sample's: the level that reaches the tick
    of q is the percentile every table shows for q (at q = k / n the step rises there,
    after sample k - 1). The last sample holds to x = 2n, as far as the ticks go.
    """
    y = np.asarray(sorted_ms, float)
    n = y.size
    if n == 0:
        return np.empty(0), np.empty(0)
    x = n / (n - np.arange(n, dtype=float))  # exact at whole ticks (n / (n - i) = 10.0)
    return np.r_[x, 2.0 * n], np.r_[y, y[-1]]


def latency_percentiles(latencies_ms: Mapping[str, np.ndarray]) -> Chart:
    """Latency against percentile, on a log axis of 1/(1-q): the tail (p99, p99.9)
    gets as much room as the median, unlike a linear CDF that squeezes it into a line
    at the top. One line per evaluation (the sorted samples, drawn as
    :func:`percentile_curve`: nearest-rank at every tick)."""
    marks, widest = [], 1
    for label, ms in latencies_ms.items():
        y = np.sort(np.asarray(ms, float))
        if y.size:
            marks.append(Mark.of("step", *percentile_curve(y), label=label))
            widest = max(widest, y.size)
    ticks = [(50, 2.0), (90, 10.0), (99, 100.0), (99.9, 1000.0), (99.99, 10000.0)]
    shown = tuple((x, f"p{p:g}") for p, x in ticks if x <= 2 * widest)
    x = Axis("percentile", scale="log", ticks=shown)
    return Chart([Panel(x=x, y=Axis("latency (ms)"), marks=marks)])


def latency_histogram(latencies_ms: Mapping[str, np.ndarray], bins: int = 50) -> Chart:
    """Histogram of latency (log-spaced bins, so a long tail stays visible)."""
    arrays = {k: np.asarray(v, float) for k, v in latencies_ms.items()}
    arrays = {k: v[v > 0] for k, v in arrays.items() if (v > 0).any()}
    marks = []
    if arrays:
        lo = min(float(v.min()) for v in arrays.values())
        hi = max(float(v.max()) for v in arrays.values())
        edges = np.geomspace(lo, max(hi, lo * 1.01), bins + 1)
        for label, v in arrays.items():
            counts, _ = np.histogram(v, bins=edges)
            marks.append(
                Mark.of("bars", edges[:-1], counts, width=np.diff(edges), label=label, opacity=0.45)
            )
    x = Axis("latency (ms)", scale="log") if arrays else Axis("latency (ms)")
    return Chart([Panel(x=x, y=Axis("queries"), marks=marks)])


def latency_over_time(windows: pd.DataFrame, title: str = "") -> Chart:
    """Completions per second beside p50 / p90 / p99 per window, from
    :func:`analysis.summary.latency_windows` (a stall shows in both)."""
    start = windows["start_s"].astype(float)
    rate = Panel(x=Axis("time since start (s)"), y=Axis("completions / s"))
    if "completed_per_s" in windows.columns:
        width = float(windows.attrs.get("window_s", 1.0)) * 0.9
        rate.marks.append(
            Mark.of(
                "bars", start, windows["completed_per_s"].astype(float), width=width, colour="grey"
            )
        )
    lat = Panel(x=Axis("time since start (s)"), y=Axis("latency (ms)"))
    for col in ("p50_ms", "p90_ms", "p99_ms"):
        lat.marks.append(
            Mark.of(
                "line", start, windows[col].astype(float), marker=".", label=col.removesuffix("_ms")
            )
        )
    return Chart([rate, lat], title=title, width=900, height=300)


def throughput_by_batch(summ: pd.DataFrame) -> Chart:
    """Throughput against batch size (solid, left axis) with the p99 latency of a
    batch (dashed, right axis), one colour per row of
    :func:`analysis.figures.max_throughput` (labelled :func:`~analysis.figures.series_label`);
    the newest valid run of each batch size counts."""
    runs = measured_runs(summ)
    runs = runs[(runs["scenario"] == "batched") & runs["throughput_ips"].notna()]
    # One point per batch size, as in analysis.figures: the newest valid run counts.
    runs = prefer_valid(runs).drop_duplicates([*SERIES_KEY, "batch_size"], keep="first")
    panel = Panel(
        x=Axis("batch size", scale="log", base=2),
        y=Axis("throughput (inputs/s), solid"),
        y2=Axis("p99 latency per batch (ms), dashed"),
    )
    # One series per row of figures.max_throughput: runs measured differently apart.
    for i, (_, g) in enumerate(runs.groupby(SERIES_KEY, sort=True)):
        g = g.sort_values("batch_size")
        b, c = g["batch_size"], colour(i)
        label = series_label(g.iloc[0].to_dict())
        panel.marks += [
            Mark.of("line", b, g["throughput_ips"], marker="o", colour=c, label=label),
            Mark.of("line", b, g["p99_ms"], marker="x", dashed=True, colour=c, right=True),
        ]
    return Chart([panel], width=650, height=340)


def throughput_latency(points: pd.DataFrame, bound_ms: float | None = None) -> Chart:
    """A peak search's runs: p99 latency against achieved throughput, labelled with the
    offered rate; a run over the bound (or invalid for another reason, as its
    ``invalid_reasons`` say) is a red cross. ``points``: a :func:`summary` of the runs."""
    pts = points[points["throughput_ips"].notna()].sort_values("requested_qps")
    x, y = pts["throughput_ips"].astype(float), pts["p99_ms"].astype(float)
    ok = pts["valid"].astype(bool).to_numpy()
    panel = Panel(x=Axis("achieved throughput (queries/s)"), y=Axis("p99 latency (ms)"))
    panel.marks += [
        Mark.of("line", x, y, colour="#999999"),
        Mark.of("points", x[ok], y[ok], colour="green", label="valid"),
        Mark.of("points", x[~ok], y[~ok], colour="red", marker="x", label="INVALID"),
    ]
    panel.notes += [
        (float(xi), float(yi), f"{float(q):g}/s")
        for xi, yi, q in zip(x, y, pts["requested_qps"], strict=True)
        if q is not None and not pd.isna(q)
    ]
    if bound_ms:
        panel.rules.append((bound_ms, "red", f"bound {bound_ms:g} ms"))
    return Chart([panel])


def layer_bars(top: pd.DataFrame) -> Chart:
    """Per-layer time from :func:`analysis.layers.top_layers`: one bar per layer,
    labelled with its op type and output shape, largest on top."""
    rows = top.iloc[::-1]
    labels = [
        f"{r.layer} · {r.op_type}" + (f" · {r.shape}" if r.shape else "") for r in rows.itertuples()
    ]
    at = np.arange(len(rows), dtype=float)
    total = rows["total_ms"].astype(float).to_numpy()
    panel = Panel(
        x=Axis("total time (ms)"),
        y=Axis(ticks=tuple(zip(at.tolist(), (_short(s) for s in labels), strict=True))),
        marks=[Mark.of("hbars", total, at, colour="blue")],
        notes=[
            (float(t), float(i), f"{s:.0%}")
            for i, t, s in zip(at, total, rows["share"].astype(float), strict=True)
        ],
    )
    return Chart([panel], width=760, height=int(60 + 30 * max(len(rows), 1)))


def _short(label: str, most: int = 48) -> str:
    return label if len(label) <= most else label[: most - 1] + "…"


def speedup_figure(heat: pd.DataFrame) -> Chart:
    """Figure 6: the speed-up heatmap (rows models, columns batch sizes)."""
    cells = Heat(
        heat.to_numpy(float),
        rows=tuple(str(i) for i in heat.index),
        columns=tuple(str(c) for c in heat.columns),
        x_label="batch size",
        bar_label="speed-up",
    )
    longest = max((len(str(i)) for i in heat.index), default=0)
    width = int(longest * 6.5 + 110 + 64 * max(len(heat.columns), 1))
    return Chart([Panel(heat=cells)], width=width, height=int(56 + 32 * max(len(heat), 1)))


def accuracy_scatter(points: pd.DataFrame, x: str) -> Chart:
    """Figures 4/5: top-1 against ``x`` (online_latency_ms or max_throughput_ips),
    marker area proportional to the model's size."""
    pts = points[points[x].notna() & points["top1"].notna()]  # measured accuracy only
    size = pts["size_bytes"].astype(float).fillna(0).to_numpy()
    area = (
        30 + 400 * (size / size.max()) if len(size) and size.max() > 0 else np.full(len(pts), 60.0)
    )
    label = {
        "online_latency_ms": "online latency, trimmed mean (ms)",
        "max_throughput_ips": "maximum throughput (inputs/s)",
    }.get(x, x)
    panel = Panel(
        x=Axis(label),
        y=Axis("top-1 accuracy"),
        marks=[
            Mark.of(
                "points", pts[x].astype(float), pts["top1"].astype(float), sizes=area, opacity=0.6
            )
        ],
        notes=[
            (float(r[x]), float(r["top1"]), f"{r['model']}/{r['framework']}")
            for _, r in pts.iterrows()
        ],
    )
    return Chart([panel], height=340)
