"""The paper's evaluation figures as data frames, from a :func:`analysis.summary.summary`.

* :func:`max_throughput` — maximum throughput and the optimal batch size (the batch
  size that reaches it) of each model, framework and system, over its batched runs;
* :func:`speedup_heatmap` — throughput at each batch size over throughput at the
  smallest batch size measured (paper Figure 6);
* :func:`accuracy_tradeoff` — top-1 against online latency and against maximum
  throughput, with the model's size for the marker (Figures 4 and 5);
* :func:`across_systems` — one model on several systems with the cost of a million
  inferences at each system's price per hour (Figure 7).

A figure of one scenario (maximum throughput, speed-up) has a row per
:data:`SERIES_KEY`: model, framework and system with their versions, and how the runs
were measured (:data:`analysis.data.MEASURED_AS`: placement, preprocess), so that runs
measured differently are different rows (and series), each labelled
(:func:`series_label`). A table across scenarios (accuracy, across systems, Table 2)
has a row per :data:`KEY` and takes, of each scenario, the newest run's measurement
(its ``*_placement`` columns say which). The newest valid run (by ``created_at``,
whatever the frame's order) counts for each key, scenario and batch size; with
``valid_only=False`` the newest invalid one stands in where none is valid (the frames
carry ``valid`` so that a reader can tell).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from analysis.data import MEASURED_AS
from mlscope.errors import MLScopeError

if TYPE_CHECKING:  # the catalog's manifests are read only where sizes are wanted
    from mlscope.catalog import Catalog

__all__ = [
    "KEY",
    "SERIES_KEY",
    "accuracy_tradeoff",
    "across_systems",
    "max_throughput",
    "measured_runs",
    "model_sizes",
    "prefer_valid",
    "series_label",
    "speedup_heatmap",
    "throughput_per_key",
    "with_measurement",
]

KEY = ["model", "model_version", "framework", "framework_version", "system"]
"""One row of a table across scenarios (Table 2, accuracy, across systems): the model,
the framework and the system, with their versions."""
SERIES_KEY = [*KEY, *MEASURED_AS]
"""One row (or series) of a figure of one scenario: :data:`KEY` and how its runs were
measured (placement, preprocess), so that runs measured differently are never one row:
a batch-size sweep's speed-up or maximum is taken over runs measured alike."""


def with_measurement(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with the columns of :data:`~analysis.data.MEASURED_AS`, their default
    where a frame (built by hand, or by an older reader) lacks one or leaves it empty."""
    missing = {k: v for k, v in MEASURED_AS.items() if k not in frame.columns}
    out = frame.assign(**missing) if missing else frame
    empty = [k for k in MEASURED_AS if out[k].isna().any()]
    return out.assign(**{k: out[k].fillna(MEASURED_AS[k]) for k in empty}) if empty else out


def series_label(row: Mapping[str, object]) -> str:
    """``model/framework@system``, with how the run was measured where it is not the
    default (``[placement agent]``, ``[preprocess ahead]``)."""
    how = [f"{k} {row[k]}" for k, v in MEASURED_AS.items() if str(row.get(k, v)) != v]
    label = f"{row['model']}/{row['framework']}@{row['system']}"
    return label + "".join(f" [{h}]" for h in how)


def prefer_valid(frame: pd.DataFrame) -> pd.DataFrame:
    """Valid runs first, each newest first by ``created_at`` where the frame has it (in
    the frame's order otherwise), so keep="first" picks the newest valid run, or the
    newest invalid one where no run is valid. Every column of :data:`KEY` is there
    (:func:`with_measurement`)."""
    frame = with_measurement(frame)
    order = (~frame["valid"].astype(bool)).astype(int)
    keys, ascending = ["_o"], [True]
    if "created_at" in frame.columns:
        frame = frame.assign(_t=pd.to_datetime(frame["created_at"], utc=True))
        keys, ascending = ["_o", "_t"], [True, False]
    out = frame.assign(_o=order).sort_values(
        keys, ascending=ascending, kind="stable", na_position="last"
    )
    return out.drop(columns=[k for k in ("_o", "_t") if k in out.columns])


def measured_runs(summ: pd.DataFrame) -> pd.DataFrame:
    """Rows of measured runs: a sweep's parent (its summary only) is left out, so each
    batch size or rate is counted once, from its own run."""
    if "role" not in summ.columns:
        return summ
    return summ[summ["role"].fillna("run") != "sweep"]


def _runs(summ: pd.DataFrame, scenario: str, *, valid_only: bool) -> pd.DataFrame:
    summ = measured_runs(summ)
    runs = summ[summ["scenario"] == scenario]
    runs = prefer_valid(runs)  # newest (valid) first, whatever the frame's order
    runs = runs[runs["valid"].astype(bool)] if valid_only else runs
    # A figure a stored summary got wrong is already None (analysis.data): only missing.
    runs = runs[runs["throughput_ips"].notna()] if scenario == "batched" else runs
    return runs.drop_duplicates([*SERIES_KEY, "batch_size"], keep="first")


def max_throughput(summ: pd.DataFrame, *, valid_only: bool = False) -> pd.DataFrame:
    """SERIES_KEY columns + max_throughput_ips, optimal_batch_size, batch_sizes (tested),
    all_valid: one row per model, framework, system and way of measuring."""
    return _max_throughput(summ, valid_only=valid_only).drop(columns="_newest")


def _max_throughput(summ: pd.DataFrame, *, valid_only: bool) -> pd.DataFrame:
    """:func:`max_throughput` with ``_newest``: the position of each row's newest run
    in the newest-first order (0: the newest batched run of all)."""
    runs = _runs(summ, "batched", valid_only=valid_only).reset_index(drop=True)
    cols = [*SERIES_KEY, "max_throughput_ips", "optimal_batch_size", "batch_sizes", "all_valid"]
    if runs.empty:
        return pd.DataFrame(columns=[*cols, "_newest"])
    rows = []
    for key, g in runs.groupby(SERIES_KEY, sort=True):
        best = g.loc[g["throughput_ips"].idxmax()]
        rows.append(
            {
                **dict(zip(SERIES_KEY, key, strict=True)),
                "max_throughput_ips": best["throughput_ips"],
                "optimal_batch_size": best["batch_size"],
                "batch_sizes": sorted(g["batch_size"]),
                "all_valid": bool(g["valid"].astype(bool).all()),
                "_newest": int(g.index.min()),
            }
        )
    return pd.DataFrame(rows, columns=[*cols, "_newest"])


def throughput_per_key(summ: pd.DataFrame, *, valid_only: bool = False) -> pd.DataFrame:
    """One :func:`max_throughput` row per :data:`KEY`: the series of the newest batched
    run, its placement as ``throughput_placement`` (never a maximum over placements)."""
    tput = _max_throughput(summ, valid_only=valid_only).sort_values("_newest", kind="stable")
    tput = tput.drop_duplicates(KEY, keep="first")
    return tput.rename(columns={"placement": "throughput_placement"}).drop(
        columns=["_newest", "preprocess"]
    )


def speedup_heatmap(summ: pd.DataFrame, *, valid_only: bool = False) -> pd.DataFrame:
    """Rows :func:`series_label` (``model/framework@system``, and how the runs were
    measured where not the default), columns batch sizes, values the speed-up over
    the smallest batch size measured for that row (NaN where not measured)."""
    runs = _runs(summ, "batched", valid_only=valid_only)
    if runs.empty:
        return pd.DataFrame()
    # one row per SERIES_KEY: its label names how the runs were measured where it differs
    runs = runs.assign(row=[series_label(r) for r in runs.to_dict("records")])
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
    """KEY + top1, online_latency_ms (trimmed mean, batch 1, of the newest online run),
    online_placement, max_throughput_ips (of the newest batched run's series),
    throughput_placement, size_bytes: one point per model, framework and system that
    has a top-1."""
    online = _runs(summ, "online", valid_only=valid_only)
    online = online[online["batch_size"] == 1]
    tput = throughput_per_key(summ, valid_only=valid_only)
    measured = measured_runs(summ)
    acc = prefer_valid(measured[measured["top1"].notna()]).drop_duplicates(KEY, keep="first")
    acc = acc[[*KEY, "top1"]]
    lat = online.drop_duplicates(KEY, keep="first")[[*KEY, "trimmed_mean_ms", "placement"]]
    out = acc.merge(lat, on=KEY, how="left").merge(
        tput[[*KEY, "max_throughput_ips", "throughput_placement"]], on=KEY, how="left"
    )
    out = out.rename(
        columns={"trimmed_mean_ms": "online_latency_ms", "placement": "online_placement"}
    )
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
    mine = with_measurement(summ[summ["model"] == model])
    if framework is not None:
        mine = mine[mine["framework"] == framework]
    tput = throughput_per_key(mine, valid_only=valid_only)
    online = _runs(mine, "online", valid_only=valid_only)
    online = online[online["batch_size"] == 1].drop_duplicates(KEY, keep="first")
    out = tput.merge(online[[*KEY, "trimmed_mean_ms", "p90_ms", "placement"]], on=KEY, how="outer")
    out = out.rename(
        columns={
            "trimmed_mean_ms": "online_latency_ms",
            "p90_ms": "online_p90_ms",
            "placement": "online_placement",
        }
    )
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
