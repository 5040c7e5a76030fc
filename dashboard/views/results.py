"""Results: the tables and figures of analysis/ for the evaluations picked (by default
the newest run and the runs comparable to it; `?eval=EV_ID` picks another anchor)."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import streamlit as st

from analysis import figures, layers, plots
from analysis.data import with_sweep_runs
from analysis.regression import NOT_COMPARED, regressions
from analysis.rows import latencies_ms
from analysis.summary import latency_windows, summary
from dashboard.common import (
    catalog,
    eval_label,
    evaluation_picker,
    recent_evaluations,
    settings,
    show,
    source,
    stop_on_error,
)
from mlscope.errors import MLScopeError

LAYER_LEVELS = frozenset({"framework", "system", "full"})
MAX_CURVES = 8  # more lines than this on one figure cannot be told apart


def one_of(ids: list[str], *, key: str, prefer: frozenset[str] = frozenset()) -> str:
    """One of the picked evaluations, labelled; the first traced at a ``prefer`` level
    is the default (the Layers tab starts on a run that has layers)."""
    wanted = set(ids)
    rows = {
        r.evaluation_id: r for r in recent_evaluations().itertuples() if r.evaluation_id in wanted
    }
    first = next((i for i, e in enumerate(ids) if e in rows and rows[e].trace_level in prefer), 0)
    return str(
        st.selectbox(
            "Evaluation",
            ids,
            index=first,
            key=key,
            format_func=lambda e: eval_label(rows[e]) if e in rows else e,
        )
    )


def latency_tab(summ: pd.DataFrame) -> None:
    runs = figures.measured_runs(summ).head(MAX_CURVES)
    ms = latencies_ms(source(), list(runs["evaluation_id"]))
    if not ms:
        st.info("No completed queries among these evaluations.")
        return
    if len(figures.measured_runs(summ)) > MAX_CURVES:
        st.caption(f"The newest {MAX_CURVES} runs.")
    c1, c2 = st.columns(2)
    show(plots.latency_percentiles(ms), width="stretch", on=c1)
    show(plots.latency_histogram(ms), width="stretch", on=c2)


def throughput_tab(summ: pd.DataFrame) -> None:
    best = figures.max_throughput(summ)
    if best.empty:
        st.info("No batched runs among these evaluations: run a batch-size sweep.")
        return
    st.dataframe(best, hide_index=True)
    show(plots.throughput_by_batch(summ))
    heat = figures.speedup_heatmap(summ)
    if heat.shape[1] > 1:
        st.caption("Throughput speed-up over the smallest batch size (paper Fig. 6)")
        st.dataframe(heat)
        show(plots.speedup_figure(heat))


def peak_tab(ids: list[str]) -> None:
    ev = recent_evaluations()
    peaks = ev[ev["evaluation_id"].isin(ids) & (ev["scenario"] == "peak")]
    trials = {r for runs in peaks["runs"] for r in runs}
    searches = peaks[~peaks["evaluation_id"].isin(trials)]  # a search, not one of its runs
    if searches.empty:
        st.info("No peak search among these evaluations (scenario `peak`).")
        return
    stored = set(ev["evaluation_id"])
    for row in searches.itertuples():
        # A search that made one run is stored as that run; a point naming a run that is
        # not stored (deleted, or a summary from elsewhere) is named and left out.
        named = list(row.runs) or [row.evaluation_id]
        lost = [r for r in named if r not in stored]
        if lost:
            st.caption(f"{row.evaluation_id}: not stored, left out: {', '.join(lost[:5])}")
        points = summary(source(), evaluated=ev[ev["evaluation_id"].isin(named)])
        if points.empty:
            continue
        st.caption(f"{row.evaluation_id}: {row.model}/{row.framework}, {len(points)} trials")
        show(plots.throughput_latency(points))
        cols = ["evaluation_id", "requested_qps", "throughput_ips", "p99_ms", "valid"]
        st.dataframe(points[cols].sort_values("requested_qps"), hide_index=True)


def accuracy_tab(summ: pd.DataFrame) -> None:
    # The report's table: top-1 where measured, beside the online latency and maximum
    # throughput of the same model (from runs that need not have measured top-1).
    sizes = figures.model_sizes(catalog(), settings().zoo_dir)
    acc = figures.accuracy_tradeoff(summ, sizes)
    if acc.empty:
        st.info(
            "No run among these measured accuracy (latency-only models have no labelled "
            "data; tick “Also measure accuracy” on the Run page)."
        )
        return
    st.dataframe(acc, hide_index=True)
    for x in ("online_latency_ms", "max_throughput_ips"):
        if acc[x].notna().any():
            show(plots.accuracy_scatter(acc, x))


def over_time_tab(ids: list[str]) -> None:
    one = one_of(ids, key="results_window_eval")
    window = st.number_input("Window (s)", min_value=0.05, value=0.25, key="results_window")
    w = latency_windows(source(), one, window_s=float(window))
    if len(w) > 1:
        show(plots.latency_over_time(w, one), width="stretch")
    else:
        st.info("One window only: pick a shorter window or a longer run.")
    st.dataframe(w, hide_index=True)


def layers_tab(ids: list[str]) -> None:
    one = one_of(ids, key="results_layers_eval", prefer=LAYER_LEVELS)
    n = st.number_input("Top N", min_value=1, value=10, key="results_top_n")
    top = layers.top_layers(source(), one, int(n))
    if top.empty:
        st.info("No layer spans in this run: run with trace level `framework` or above.")
        return
    show(plots.layer_bars(top))
    st.dataframe(top, hide_index=True)
    st.caption("By layer type")
    st.dataframe(layers.layer_types(source(), one), hide_index=True)
    left_out = layers.layer_spans_left_out(source(), one)
    if left_out:
        st.caption(f"{left_out} layer span(s) end before they start: left out of these tables")


def systems_tab(summ: pd.DataFrame) -> None:
    systems = sorted(set(summ["system"]))
    model = st.selectbox("Model", sorted(set(summ["model"])), key="results_sys_model")
    prices = {
        s: st.number_input(
            f"{s}: price per hour (USD)", min_value=0.0, value=1.0, key=f"results_price_{i}"
        )
        for i, s in enumerate(systems)
    }
    st.dataframe(figures.across_systems(summ, str(model), prices), hide_index=True)


def regressions_tab(summ: pd.DataFrame) -> None:
    axis = st.radio(
        "Across versions of",
        ["framework_version", "model_version"],
        key="results_reg_axis",
        horizontal=True,
    )
    reg = regressions(source(), summ, axis=str(axis))
    if reg.empty:
        st.info(
            "No two versions to compare among these evaluations (same model, "
            "framework, system, scenario and batch size)."
        )
        return
    # A step with a run that answered no query has no latency to compare: named, left out.
    skipped = reg[reg["verdict"] == NOT_COMPARED]
    if not skipped.empty:
        steps = [f"{r.from_version} → {r.to_version} ({r.skipped})" for r in skipped.itertuples()]
        st.info(f"Not compared, left out: {'; '.join(steps)}")
    compared = reg[reg["verdict"] != NOT_COMPARED]
    if not compared.empty:
        st.dataframe(compared.drop(columns="skipped"), hide_index=True)


st.title("Results")
ids = evaluation_picker("Evaluations", key="results_ids", multi=True)
if not ids:
    st.info("Pick at least one evaluation.")
    st.stop()
try:
    # The listing's rows: one whose stored JSON cannot be read shows what its columns say
    # instead of stopping the page for every other run. A sweep comes with its runs, as
    # in `mlscope report`: its batch sizes and rates are theirs.
    listed = recent_evaluations()
    by_id = listed.set_index("evaluation_id")
    picked = by_id.loc[[i for i in ids if i in by_id.index]].reset_index()
    summ = summary(source(), evaluated=with_sweep_runs(source(), picked, listed=listed))
except MLScopeError as exc:
    stop_on_error(exc)
st.subheader("Summary")
st.dataframe(summ, hide_index=True)

TABS: dict[str, Callable[[], None]] = {
    "Latency": lambda: latency_tab(summ),
    "Throughput": lambda: throughput_tab(summ),
    "Peak search": lambda: peak_tab(ids),
    "Accuracy": lambda: accuracy_tab(summ),
    "Over time": lambda: over_time_tab(ids),
    "Layers": lambda: layers_tab(ids),
    "Across systems": lambda: systems_tab(summ),
    "Regressions": lambda: regressions_tab(summ),
}
for tab, draw in zip(st.tabs(list(TABS)), TABS.values(), strict=True):
    with tab:
        draw()
