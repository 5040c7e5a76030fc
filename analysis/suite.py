"""The paper's Table 2 for our zoo: one row per model and framework.

id, model, framework, top-1, size, online latency (trimmed mean and p90, batch 1),
maximum throughput and the optimal batch size; the newest valid runs count. Each
column is one way of measuring: the newest online run's (``online_placement``), and the
maximum over the batched runs measured like the newest one (``throughput_placement``),
never a maximum across placements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd

from analysis.figures import KEY, prefer_valid, throughput_per_key
from analysis.source import Source

__all__ = ["SHOWN_SQL", "TABLE2_COLUMNS", "format_table", "shown_evaluations", "table2"]

_SHOWN_KEY = (
    "model, model_version, framework, framework_version, device, "
    "JSONExtractRaw(spec, 'agent', 'accelerators'), "
    "JSONExtractString(spec, 'agent', 'cpu_model'), "
    "JSONExtractRaw(spec, 'agent', 'cpu_cores'), scenario, "
    "JSONExtractRaw(summary, 'scenario', 'batch_size'), valid, "
    "JSONExtractRaw(summary, 'accuracy', 'top1') IN ('', 'null'), "
    "JSONExtractRaw(summary, 'throughput_ips') IN ('', 'null'), "
    "JSONLength(summary, 'points') > 0, "
    # how the run was measured (analysis.data.MEASURED_AS): a key of every figure
    "JSONExtractString(summary, 'placement'), JSONExtractString(summary, 'preprocess')"
)
SHOWN_SQL = (
    "SELECT evaluation_id FROM evaluations FINAL WHERE evaluation_id IN ("
    "SELECT argMin(evaluation_id, (-toUnixTimestamp64Milli(created_at), evaluation_id)) "
    "FROM evaluations FINAL WHERE has(arrayZip({m:Array(String)}, {f:Array(String)}), "
    "(model, framework)) AND status != 'cancelled' "
    f"GROUP BY {_SHOWN_KEY}) ORDER BY created_at DESC, evaluation_id"
)
"""The newest evaluation of every group that :func:`table2` may pick a row from,
newest first. A group is finer than what the table tells apart (the system's parts
rather than its name; whether a run has a top-1 or a throughput, is a sweep, is
valid), so the run the table shows is always among them, and older runs, however
many, are never read. A cancelled run has no figures to show and is never one."""


def shown_evaluations(source: Source, pairs: Sequence[tuple[str, str]]) -> list[str]:
    """Ids of the evaluations Table 2 of ``pairs`` (model, framework) can show,
    newest first; found by the database, not by reading every evaluation."""
    if not pairs:
        return []
    got = source.frame(SHOWN_SQL, {"m": [m for m, _ in pairs], "f": [f for _, f in pairs]})
    return [str(e) for e in got["evaluation_id"]] if len(got) else []


TABLE2_COLUMNS = (
    "id",
    "model",
    "framework",
    "system",
    "top1",
    "size_mb",
    "online_trimmed_mean_ms",
    "online_p90_ms",
    "max_throughput_ips",
    "optimal_batch_size",
    "online_placement",
    "throughput_placement",
    "all_valid",
)


def table2(
    summ: pd.DataFrame, sizes: Mapping[str, int] | None = None, *, valid_only: bool = False
) -> pd.DataFrame:
    """Table 2 from a :func:`analysis.summary.summary` frame (ids numbered from 1).

    One row per :data:`analysis.figures.KEY`; the online columns come from one run, the
    throughput from runs measured alike (their placements in ``online_placement`` and
    ``throughput_placement``). The newest valid run counts; without
    ``valid_only`` an invalid run stands in where none is valid, and ``all_valid`` is
    False on that row."""
    valid = prefer_valid(summ)  # newest first, by created_at
    valid = valid[valid["valid"].astype(bool)] if valid_only else valid
    if valid.empty:
        return pd.DataFrame(columns=list(TABLE2_COLUMNS))
    online = valid[(valid["scenario"] == "online") & (valid["batch_size"] == 1)]
    online = online.drop_duplicates(KEY, keep="first")[
        [*KEY, "trimmed_mean_ms", "p90_ms", "valid", "placement"]
    ].rename(columns={"valid": "online_ok", "placement": "online_placement"})
    acc = valid[valid["top1"].notna()].drop_duplicates(KEY, keep="first")[[*KEY, "top1"]]
    keys = valid.drop_duplicates(KEY)[KEY]
    out = (
        keys.merge(acc, on=KEY, how="left")
        .merge(online, on=KEY, how="left")
        .merge(
            throughput_per_key(valid)[
                [
                    *KEY,
                    "max_throughput_ips",
                    "optimal_batch_size",
                    "all_valid",
                    "throughput_placement",
                ]
            ],
            on=KEY,
            how="left",
        )
    )
    sizes = sizes or {}
    out["size_mb"] = [
        (sizes.get(f"{m}/{f}") or 0) / 1e6 or None
        for m, f in zip(out["model"], out["framework"], strict=True)
    ]
    out = out.rename(
        columns={"trimmed_mean_ms": "online_trimmed_mean_ms", "p90_ms": "online_p90_ms"}
    )
    # The runs the row shows are all valid (missing runs do not count against it).
    out["all_valid"] = [
        not (_false(o) or _false(b))
        for o, b in zip(out["online_ok"], out["all_valid"], strict=True)
    ]
    out = out.sort_values(["model", "framework", "system"]).reset_index(drop=True)
    out.insert(0, "id", range(1, len(out) + 1))
    return out[list(TABLE2_COLUMNS)]


def _false(v: object) -> bool:
    return v is not None and not pd.isna(v) and not bool(v)


def _placed(placement: object) -> str:
    """`` (server)``: where a figure's runs were placed; "" where none was measured."""
    return "" if placement is None or pd.isna(placement) else f" ({placement})"


def format_table(table: pd.DataFrame) -> str:
    """Table 2 as aligned text for a terminal; the placement of each measurement after
    its figure (``1.234 (server)``, ``5000.0 (agent)``)."""
    heads = [
        "ID",
        "MODEL",
        "FRAMEWORK",
        "TOP-1",
        "SIZE MB",
        "ONLINE TM ms",
        "ONLINE P90 ms",
        "MAX TPUT/s",
        "OPT BATCH",
    ]

    def f(v: object, spec: str) -> str:
        return "-" if v is None or pd.isna(v) else format(v, spec)

    rows = [
        [
            str(r.id) + ("" if r.all_valid else "*"),
            str(r.model),
            str(r.framework),
            f(r.top1, ".4f"),
            f(r.size_mb, ".2f"),
            f(r.online_trimmed_mean_ms, ".3f") + _placed(r.online_placement),
            f(r.online_p90_ms, ".3f"),
            f(r.max_throughput_ips, ".1f") + _placed(r.throughput_placement),
            "-" if pd.isna(r.optimal_batch_size) else str(int(r.optimal_batch_size)),
        ]
        for r in table.itertuples()
    ]
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(heads)
    ]
    line = "  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True))
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    foot = (
        ["* includes runs judged INVALID (see `mlscope report EVAL_ID`)"]
        if not table["all_valid"].all()
        else []
    )
    return "\n".join([line, *body, *foot])
