"""Results: the tables and figures of analysis/ for the evaluations picked."""

from __future__ import annotations

import streamlit as st

from analysis import figures, layers, plots
from analysis.compare import regressions
from analysis.summary import latency_windows, summary
from dashboard.common import (
    FIG_WIDTH,
    catalog,
    evaluation_picker,
    settings,
    source,
    stop_on_error,
)
from mlscope.errors import MLScopeError

st.title("Results")
ids = evaluation_picker("Evaluations", key="results_ids", multi=True, default_all=True)
if not ids:
    st.stop()
try:
    summ = summary(source(), ids)
except MLScopeError as exc:
    stop_on_error(exc)
st.subheader("Summary")
st.dataframe(summ, hide_index=True)

t_tput, t_acc, t_time, t_layers, t_sys, t_reg = st.tabs(
    ["Throughput", "Accuracy", "Latency over time", "Layers", "Across systems", "Regressions"]
)
with t_tput:
    best = figures.max_throughput(summ)
    if best.empty:
        st.info("No batched runs among these evaluations.")
    else:
        st.dataframe(best, hide_index=True)
        st.pyplot(plots.throughput_by_batch(summ), width=FIG_WIDTH)
        heat = figures.speedup_heatmap(summ)
        if heat.shape[1] > 1:
            st.caption("Throughput speed-up over the smallest batch size (paper Fig. 6)")
            st.dataframe(heat)
            st.pyplot(plots.speedup_figure(heat), width=FIG_WIDTH)
with t_acc:
    sizes = figures.model_sizes(catalog(), settings().zoo_dir)
    acc = figures.accuracy_tradeoff(summ, sizes)
    if acc.empty:
        st.info("No runs with an accuracy among these evaluations.")
    else:
        st.dataframe(acc, hide_index=True)
        for x in ("online_latency_ms", "max_throughput_ips"):
            if acc[x].notna().any():
                st.pyplot(plots.accuracy_scatter(acc, x), width=FIG_WIDTH)
with t_time:
    one = st.selectbox("Evaluation", ids, key="results_window_eval")
    window = st.number_input("Window (s)", min_value=0.05, value=1.0, key="results_window")
    w = latency_windows(source(), one, window_s=float(window))
    st.dataframe(w, hide_index=True)
    if len(w) > 1:
        st.pyplot(plots.latency_over_time(w, one), width=FIG_WIDTH)
with t_layers:
    one = st.selectbox("Evaluation", ids, key="results_layers_eval")
    n = st.number_input("Top N", min_value=1, value=10, key="results_top_n")
    top = layers.top_layers(source(), one, int(n))
    if top.empty:
        st.info("No layer spans: run with trace level `framework` or above.")
    else:
        st.dataframe(top, hide_index=True)
        st.caption("By layer type")
        st.dataframe(layers.layer_types(source(), one), hide_index=True)
with t_sys:
    systems = sorted(set(summ["system"]))
    model = st.selectbox("Model", sorted(set(summ["model"])), key="results_sys_model")
    prices = {
        s: st.number_input(
            f"{s}: price per hour (USD)", min_value=0.0, value=1.0, key=f"results_price_{i}"
        )
        for i, s in enumerate(systems)
    }
    st.dataframe(figures.across_systems(summ, str(model), prices), hide_index=True)
with t_reg:
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
    else:
        st.dataframe(reg, hide_index=True)
