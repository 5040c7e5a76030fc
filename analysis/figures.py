"""The paper's evaluation figures as data frames, from a :func:`analysis.summary.summary`.

* :func:`max_throughput` — maximum throughput and the optimal batch size (the batch
  size that reaches it) of each model, framework and system, over its batched runs;
* :func:`speedup_heatmap` — throughput at each batch size over throughput at the
  smallest batch size measured (paper Figure 6);
* :func:`accuracy_tradeoff` — top-1 against online latency and against maximum
  throughput, with the model's size for the marker (Figures 4 and 5);
* :func:`across_systems` — one model on several systems with the cost of a million
  inferences at each system's price per hour (Figure 7).

The newest valid run counts for each (model, framework, system, scenario, batch size);
with ``valid_only=False`` the newest invalid one stands in where none is valid (the
frames carry ``valid`` so that a reader can tell).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import pandas as pd

from mlscope.catalog import Catalog
from mlscope.errors import MLScopeError

__all__ = [
    "KEY",
    "accuracy_tradeoff",
    "across_systems",
    "max_throughput",
    "measured_runs",
    "model_sizes",
    "prefer_valid",
    "speedup_heatmap",
]

KEY = ["model", "model_version", "framework", "framework_version", "system"]


def prefer_valid(frame: pd.DataFrame) -> pd.DataFrame:
    """Valid runs first, each group newest first (so keep="first" picks the newest valid
    run, or the newest invalid one where no run is valid)."""
    order = (~frame["valid"].astype(bool)).astype(int)
    return frame.assign(_o=order).sort_values("_o", kind="stable").drop(columns="_o")


def measured_runs(summ: pd.DataFrame) -> pd.DataFrame:
    """Rows of measured runs: a sweep's parent (its summary only) is left out, so each
    batch size or rate is counted once, from its own run."""
    if "role" not in summ.columns:
        return summ
    return summ[summ["role"].fillna("run") != "sweep"]


def _runs(summ: pd.DataFrame, scenario: str, *, valid_only: bool) -> pd.DataFrame:
    summ = measured_runs(summ)
    runs = summ[summ["scenario"] == scenario]
    runs = runs[runs["valid"].astype(bool)] if valid_only else prefer_valid(runs)
    # A figure a stored summary got wrong is already None (analysis.data): only missing.
    runs = runs[runs["throughput_ips"].notna()] if scenario == "batched" else runs
    return runs.drop_duplicates([*KEY, "batch_size"], keep="first")


def max_throughput(summ: pd.DataFrame, *, valid_only: bool = False) -> pd.DataFrame:
    """KEY columns + max_throughput_ips, optimal_batch_size, batch_sizes (tested)."""
    runs = _runs(summ, "batched", valid_only=valid_only)
    cols = [*KEY, "max_throughput_ips", "optimal_batch_size", "batch_sizes", "all_valid"]
    if runs.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    for key, g in runs.groupby(KEY, sort=True):
        best = g.loc[g["throughput_ips"].idxmax()]
        rows.append(
            {
                **dict(zip(KEY, key, strict=True)),
                "max_throughput_ips": best["throughput_ips"],
                "optimal_batch_size": best["batch_size"],
                "batch_sizes": sorted(g["batch_size"]),
                "all_valid": bool(g["valid"].astype(bool).all()),
            }
        )
    return pd.DataFrame(rows, columns=cols)


def speedup_heatmap(summ: pd.DataFrame, *, valid_only: bool = False) -> pd.DataFrame:
    """Rows ``model/framework@system``, columns batch sizes, values the speed-up over
    the smallest batch size measured for that row (NaN where not measured)."""
    runs = _runs(summ, "batched", valid_only=valid_only)
    if runs.empty:
        return pd.DataFrame()
    runs = runs.assign(row=runs["model"] + "/" + runs["framework"] + "@" + runs["system"])
    table = runs.pivot_table(
        index="row", columns="batch_size", values="throughput_ips", aggfunc="first"
    ).sort_index(axis=1)
    base = table.apply(lambda r: r.dropna().iloc[0] if r.notna().any() else float("nan"), axis=1)
    heat = table.div(base, axis=0)
    heat.columns = [int(c) for c in heat.columns]
    heat.index.name = None
    return heat


def accuracy_tradeoff(
    summ: pd.DataFrame, sizes: Mapping[str, int] | None = None, *, valid_only: bool = False
) -> pd.DataFrame:
    """KEY + top1, online_latency_ms (trimmed mean, batch 1), max_throughput_ips,
    size_bytes: one point per model, framework and system that has a top-1."""
    online = _runs(summ, "online", valid_only=valid_only)
    online = online[online["batch_size"] == 1]
    tput = max_throughput(summ, valid_only=valid_only)
    measured = measured_runs(summ)
    acc = prefer_valid(measured[measured["top1"].notna()]).drop_duplicates(KEY, keep="first")
    acc = acc[[*KEY, "top1"]]
    lat = online.drop_duplicates(KEY, keep="first")[[*KEY, "trimmed_mean_ms"]]
    out = acc.merge(lat, on=KEY, how="left").merge(
        tput[[*KEY, "max_throughput_ips"]], on=KEY, how="left"
    )
    out = out.rename(columns={"trimmed_mean_ms": "online_latency_ms"})
    sizes = sizes or {}
    out["size_bytes"] = [
        sizes.get(f"{m}/{f}") or sizes.get(m)
        for m, f in zip(out["model"], out["framework"], strict=True)
    ]
    return out.reset_index(drop=True)


def across_systems(
    summ: pd.DataFrame,
    model: str,
    prices_per_hour: Mapping[str, float],
    *,
    framework: str | None = None,
    valid_only: bool = False,
) -> pd.DataFrame:
    """One model on each system: online latency, max throughput, optimal batch, price
    per hour and cost per million inferences = price / (max throughput × 3600) × 10⁶."""
    mine = summ[summ["model"] == model]
    if framework is not None:
        mine = mine[mine["framework"] == framework]
    tput = max_throughput(mine, valid_only=valid_only)
    online = _runs(mine, "online", valid_only=valid_only)
    online = online[online["batch_size"] == 1].drop_duplicates(KEY, keep="first")
    out = tput.merge(online[[*KEY, "trimmed_mean_ms", "p90_ms"]], on=KEY, how="outer")
    out = out.rename(columns={"trimmed_mean_ms": "online_latency_ms", "p90_ms": "online_p90_ms"})
    out["price_per_hour"] = [prices_per_hour.get(s) for s in out["system"]]
    price = out["price_per_hour"].astype(float)
    out["cost_per_million"] = price / (out["max_throughput_ips"].astype(float) * 3600) * 1e6
    return out.sort_values("system").reset_index(drop=True)


def model_sizes(
    catalog: Catalog, zoo_dir: Path, keys: Iterable[tuple[str, str]] | None = None
) -> dict[str, int]:
    """``{"model/framework": bytes}`` of the built graphs (and weights) in the zoo."""
    wanted = set(keys) if keys is not None else None
    out: dict[str, int] = {}
    for e in catalog.entries:
        m = e.manifest
        if wanted is not None and (m.name, m.framework.name) not in wanted:
            continue
        try:
            root = e.root(zoo_dir)
        except MLScopeError:
            continue
        total = 0
        for rel in filter(None, (m.assets.graph_path, m.assets.weights_path)):
            total += _size(root / rel)
        if total:
            out[f"{m.name}/{m.framework.name}"] = total
    return out


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0
