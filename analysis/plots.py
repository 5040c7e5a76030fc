"""Matplotlib figures of the analysis frames, rendered to inline SVG or PNG bytes.

Plots draw frames that :mod:`analysis` computed; they compute nothing themselves
(the empirical CDF is the sorted samples, drawn).
"""

from __future__ import annotations

import io
from collections.abc import Mapping

import numpy as np
import pandas as pd

from analysis.figures import measured_runs
from mlscope.extras import require

# matplotlib comes with the report extra: without it, importing this module says so
require("matplotlib", extra="report", needed_for="a report with figures").use("Agg")
# no display; "Agg" must be chosen before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

__all__ = [
    "accuracy_scatter",
    "latency_cdf",
    "latency_over_time",
    "png",
    "speedup_figure",
    "svg",
    "throughput_by_batch",
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


def latency_cdf(latencies_ms: Mapping[str, np.ndarray]) -> Figure:
    """Empirical CDF of each evaluation's latency (one line per evaluation)."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for label, ms in latencies_ms.items():
        x = np.sort(np.asarray(ms, float))
        ax.step(x, np.arange(1, x.size + 1) / max(x.size, 1), where="post", label=label)
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("fraction of queries")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def latency_over_time(windows: pd.DataFrame, title: str = "") -> Figure:
    """p50 / p90 / p99 per window from :func:`analysis.summary.latency_windows`."""
    fig, ax = plt.subplots(figsize=(6, 3.0))
    for col in ("p50_ms", "p90_ms", "p99_ms"):
        ax.plot(
            windows["start_s"],
            windows[col].astype(float),
            marker=".",
            label=col.removesuffix("_ms"),
        )
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def throughput_by_batch(summ: pd.DataFrame) -> Figure:
    """Throughput against batch size, one line per model/framework/system."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    runs = measured_runs(summ)
    runs = runs[runs["scenario"] == "batched"]
    for (m, f, s), g in runs.groupby(["model", "framework", "system"]):
        g = g.sort_values("batch_size")
        ax.plot(
            g["batch_size"], g["throughput_ips"].astype(float), marker="o", label=f"{m}/{f} ({s})"
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("throughput (inputs/s)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
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
    pts = points[points[x].notna()]
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
