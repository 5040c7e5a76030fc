"""Trace: the timeline of one evaluation, zoomable from model to layer to kernel, with a
lane per query in flight so that queueing shows as stacked bars."""

from __future__ import annotations

import altair as alt
import streamlit as st

from analysis.trace import DEPTHS, inflight_slots, system_samples, timeline
from dashboard.common import evaluation_picker, recent_evaluations, source

KIND_ROW = {"query": 0, "step": 1, "layer": 2, "op": 2, "kernel": 3}
# What a depth adds over the one above it, and why a run may have none of it.
ADDS = {
    "layer": (("layer", "op"), "layer", "trace level `framework` or above records them"),
    "kernel": (("kernel",), "kernel", "kernels are device launches (a GPU run, level `full`)"),
}

st.title("Trace")
ids = evaluation_picker("Evaluation", key="trace_eval")
if not ids:
    st.stop()
c1, c2, c3 = st.columns(3)
depth = str(c1.radio("Depth", list(DEPTHS), index=0, key="trace_depth", horizontal=True))
first = c2.number_input("First query", min_value=0, value=0, key="trace_first")
count = c3.number_input("Queries", min_value=1, max_value=200, value=5, key="trace_count")
tl = timeline(source(), ids[0], depth=depth, first_query=int(first), queries=int(count))
if tl.empty:
    st.info(
        "No spans for these queries (trace level `none`, or the queries are past the "
        "end of the run)."
    )
    st.stop()
if depth in ADDS:
    kinds, word, why = ADDS[depth]
    if not tl["kind"].isin(kinds).any():
        ev = recent_evaluations()
        row = ev[ev["evaluation_id"] == ids[0]]
        device = str(row["device"].iloc[0]) if len(row) else "cpu"
        level = str(row["trace_level"].iloc[0]) if len(row) else "?"
        run = "this CPU run" if device == "cpu" else f"this {device} run"
        st.info(f"No {word} spans: {run} at trace level `{level}` has none ({why}).")
slot = inflight_slots(tl)
tl = tl.assign(
    lane_name=[f"in flight {s} · {k}" for s, k in zip(slot, tl["kind"], strict=True)],
    order=slot * 10 + tl["kind"].map(KIND_ROW).fillna(4).astype(int),
)
lanes = list(tl.sort_values("order")["lane_name"].drop_duplicates())
chart = (
    alt.Chart(tl)
    .mark_bar()
    .encode(
        x=alt.X("start_ms:Q", title="ms from the first span"),
        x2="end_ms:Q",
        y=alt.Y("lane_name:N", sort=lanes, title=None),
        color=alt.Color("kind:N"),
        tooltip=[
            "kind",
            "name",
            "op_type",
            "shape",
            "query_index",
            alt.Tooltip("dur_ms:Q", format=".3f"),
        ],
    )
    .properties(height=60 + 28 * len(lanes))
    .interactive(bind_y=False)
)
st.altair_chart(chart, width="stretch")
most = int(slot.max()) + 1
st.caption(
    f"{most} quer{'y' if most == 1 else 'ies'} in flight at most: overlapping queries "
    "take separate lanes, so a queue shows as bars stacked downwards. Drag to pan, "
    "scroll to zoom; pick a deeper level to see layers and kernels."
)
st.dataframe(tl.drop(columns=["lane", "lane_name", "order"]), hide_index=True)
sys_df = system_samples(source(), ids[0])
if not sys_df.empty:
    st.subheader("System samples")
    st.dataframe(sys_df, hide_index=True)
