"""Matplotlib figures of the analysis frames, rendered to inline SVG or PNG bytes.

Plots draw frames that :mod:`analysis` computed; they compute nothing themselves
(a percentile curve is the sorted samples, drawn).
"""

from __future__ import annotations

import io
from collections.abc import Mapping

import numpy as np
import pandas as pd

from analysis.figures import KEY, measured_runs, prefer_valid
from mlscope.extras import require

# matplotlib comes with the report extra: without it, importing this module says so
require("matplotlib", extra="report", needed_for="a report with figures").use("Agg")
# no display; "Agg" must be chosen before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

__all__ = [
    "accuracy_scatter",
    "latency_histogram",
    "latency_over_time",
    "latency_percentiles",
    "layer_bars",
    "png",
    "speedup_figure",
    "svg",
    "throughput_by_batch",
    "throughput_latency",
]


def svg(fig: Figure) -> str:
    """The figure as an inline ``<svg>`` element (closed afterwards)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg") :]


def png(fig: Figure, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _quantile_positions(n: int) -> np.ndarray:
    """1 / (1 - q) of each sorted sample (q = (i + 0.5) / n): the x of a percentile
    curve on a log axis, where 50%, 90%, 99%, 99.9% are evenly spaced."""
    q = (np.arange(n) + 0.5) / max(n, 1)
    return 1.0 / (1.0 - q)


def latency_percentiles(latencies_ms: Mapping[str, np.ndarray]) -> Figure:
    """Latency against percentile, on a log axis of 1/(1-q): the tail (p99, p99.9)
    gets as much room as the median, unlike a linear CDF that squeezes it into a line
    at the top. One line per evaluation (the sorted samples, drawn)."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    widest = 1
    for label, ms in latencies_ms.items():
        y = np.sort(np.asarray(ms, float))
        if y.size:
            ax.step(_quantile_positions(y.size), y, where="post", label=label)
            widest = max(widest, y.size)
    ticks = [(50, 2.0), (90, 10.0), (99, 100.0), (99.9, 1000.0), (99.99, 10000.0)]
    ticks = [(p, x) for p, x in ticks if x <= 2 * widest]
    ax.set_xscale("log")
    ax.set_xticks([x for _, x in ticks], [f"p{p:g}" for p, _ in ticks])
    ax.minorticks_off()
    ax.set_xlabel("percentile")
    ax.set_ylabel("latency (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def latency_histogram(latencies_ms: Mapping[str, np.ndarray], bins: int = 50) -> Figure:
    """Histogram of latency (log-spaced bins, so a long tail stays visible)."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    arrays = {k: np.asarray(v, float) for k, v in latencies_ms.items()}
    arrays = {k: v[v > 0] for k, v in arrays.items() if (v > 0).any()}
    if arrays:
        lo = min(float(v.min()) for v in arrays.values())
        hi = max(float(v.max()) for v in arrays.values())
        edges = np.geomspace(lo, max(hi, lo * 1.01), bins + 1)
        for label, v in arrays.items():
            ax.hist(v, bins=list(edges), histtype="stepfilled", alpha=0.45, label=label)
        ax.set_xscale("log")
        ax.legend(fontsize=7)
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("queries")
    ax.grid(alpha=0.3)
    return fig


def latency_over_time(windows: pd.DataFrame, title: str = "") -> Figure:
    """Completions per second beside p50 / p90 / p99 per window, from
    :func:`analysis.summary.latency_windows` (a stall shows in both)."""
    fig, (rate, lat) = plt.subplots(1, 2, figsize=(9, 3.0))
    start = windows["start_s"].astype(float)
    if "completed_per_s" in windows.columns:
        rate.bar(
            start,
            windows["completed_per_s"].astype(float),
            width=float(windows.attrs.get("window_s", 1.0)) * 0.9,
            align="edge",
            color="tab:gray",
        )
    rate.set_xlabel("time since start (s)")
    rate.set_ylabel("completions / s")
    rate.grid(alpha=0.3)
    for col in ("p50_ms", "p90_ms", "p99_ms"):
        lat.plot(start, windows[col].astype(float), marker=".", label=col.removesuffix("_ms"))
    lat.set_xlabel("time since start (s)")
    lat.set_ylabel("latency (ms)")
    lat.grid(alpha=0.3)
    lat.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def throughput_by_batch(summ: pd.DataFrame) -> Figure:
    """Throughput against batch size (solid, left axis) with the p99 latency of a
    batch (dashed, right axis), one colour per model/framework/system; ``summ`` newest
    first, as :func:`analysis.summary.summary` orders it."""
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    lat_ax = ax.twinx()
    runs = measured_runs(summ)
    runs = runs[(runs["scenario"] == "batched") & runs["throughput_ips"].notna()]
    # One point per batch size, as in analysis.figures: the newest valid run counts.
    runs = prefer_valid(runs).drop_duplicates([*KEY, "batch_size"], keep="first")
    groups = runs.groupby(["model", "framework", "system"])
    for i, ((m, f, s), g) in enumerate(groups):
        g = g.sort_values("batch_size")
        colour = f"C{i % 10}"
        ax.plot(
            g["batch_size"],
            g["throughput_ips"].astype(float),
            marker="o",
            color=colour,
            label=f"{m}/{f} ({s})",
        )
        lat_ax.plot(g["batch_size"], g["p99_ms"].astype(float), ls="--", marker="x", color=colour)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("throughput (inputs/s), solid")
    lat_ax.set_ylabel("p99 latency per batch (ms), dashed")
    ax.grid(alpha=0.3)
    if len(groups):
        ax.legend(fontsize=7, loc="upper left")
    return fig


def throughput_latency(points: pd.DataFrame, bound_ms: float | None = None) -> Figure:
    """A peak search's runs: p99 latency against achieved throughput, labelled with the
    offered rate; a run over the bound (or invalid for another reason, as its
    ``invalid_reasons`` say) is a red cross. ``points``: a :func:`summary` of the runs."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    pts = points[points["throughput_ips"].notna()].sort_values("requested_qps")
    x, y = pts["throughput_ips"].astype(float), pts["p99_ms"].astype(float)
    ok = pts["valid"].astype(bool).to_numpy()
    ax.plot(x, y, color="0.6", zorder=1)
    ax.scatter(x[ok], y[ok], color="tab:green", label="valid", zorder=2)
    ax.scatter(x[~ok], y[~ok], color="tab:red", marker="x", label="INVALID", zorder=2)
    for xi, yi, q in zip(x, y, pts["requested_qps"], strict=True):
        if q is not None and not pd.isna(q):
            ax.annotate(
                f"{float(q):g}/s", (xi, yi), fontsize=6, xytext=(3, 3), textcoords="offset points"
            )
    if bound_ms:
        ax.axhline(bound_ms, color="tab:red", ls=":", label=f"bound {bound_ms:g} ms")
    ax.set_xlabel("achieved throughput (queries/s)")
    ax.set_ylabel("p99 latency (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def layer_bars(top: pd.DataFrame) -> Figure:
    """Per-layer time from :func:`analysis.layers.top_layers`: one bar per layer,
    labelled with its op type and output shape, largest on top."""
    rows = top.iloc[::-1]
    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.32 * max(len(rows), 1)))
    labels = [
        f"{r.layer} · {r.op_type}" + (f" · {r.shape}" if r.shape else "") for r in rows.itertuples()
    ]
    ax.barh(range(len(rows)), rows["total_ms"].astype(float), color="tab:blue")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    for i, share in enumerate(rows["share"].astype(float)):
        ax.annotate(f" {share:.0%}", (float(rows["total_ms"].iloc[i]), i), va="center", fontsize=7)
    ax.set_xlabel("total time (ms)")
    ax.grid(alpha=0.3, axis="x")
    return fig


def speedup_figure(heat: pd.DataFrame) -> Figure:
    """Figure 6: the speed-up heatmap (rows models, columns batch sizes)."""
    fig, ax = plt.subplots(
        figsize=(1.2 + 0.7 * max(len(heat.columns), 1), 0.8 + 0.45 * max(len(heat), 1))
    )
    values = heat.to_numpy(float)
    im = ax.imshow(values, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(heat.columns)), [str(c) for c in heat.columns])
    ax.set_yticks(range(len(heat.index)), [str(i) for i in heat.index], fontsize=7)
    for (i, j), v in np.ndenumerate(values):
        if not np.isnan(v):
            ax.text(j, i, f"{v:.1f}", ha="center", va="center", color="w", fontsize=7)
    ax.set_xlabel("batch size")
    fig.colorbar(im, ax=ax, label="speed-up")
    return fig


def accuracy_scatter(points: pd.DataFrame, x: str) -> Figure:
    """Figures 4/5: top-1 against ``x`` (online_latency_ms or max_throughput_ips),
    marker area proportional to the model's size."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    pts = points[points[x].notna() & points["top1"].notna()]  # measured accuracy only
    size = pts["size_bytes"].astype(float).fillna(0)
    area = 30 + 400 * (size / size.max()) if len(size) and size.max() > 0 else 60
    ax.scatter(pts[x].astype(float), pts["top1"].astype(float), s=area, alpha=0.6)
    for _, r in pts.iterrows():
        ax.annotate(f"{r['model']}/{r['framework']}", (float(r[x]), float(r["top1"])), fontsize=7)
    ax.set_xlabel(
        {
            "online_latency_ms": "online latency, trimmed mean (ms)",
            "max_throughput_ips": "maximum throughput (inputs/s)",
        }.get(x, x)
    )
    ax.set_ylabel("top-1 accuracy")
    ax.grid(alpha=0.3)
    return fig
