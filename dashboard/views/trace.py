"""Trace: the timeline of one evaluation, zoomable from model to layer to kernel."""

from __future__ import annotations

import altair as alt
import streamlit as st

from analysis.trace import DEPTHS, system_samples, timeline
from dashboard.common import evaluation_picker, source

LANES = {0: "query", 1: "step", 2: "layer / op", 3: "kernel"}

st.title("Trace")
ids = evaluation_picker("Evaluation", key="trace_eval")
if not ids:
    st.stop()
c1, c2, c3 = st.columns(3)
depth = c1.radio("Depth", list(DEPTHS), index=0, key="trace_depth", horizontal=True)
first = c2.number_input("First query", min_value=0, value=0, key="trace_first")
count = c3.number_input("Queries", min_value=1, max_value=200, value=5, key="trace_count")
tl = timeline(source(), ids[0], depth=str(depth), first_query=int(first), queries=int(count))
if tl.empty:
    st.info(
        "No spans for these queries at this depth (trace level `none`, or the "
        "framework profiler is off below `framework`)."
    )
    st.stop()
tl = tl.assign(lane_name=[LANES.get(x, "other") for x in tl["lane"]])
chart = (
    alt.Chart(tl)
    .mark_bar()
    .encode(
        x=alt.X("start_ms:Q", title="ms from the first span"),
        x2="end_ms:Q",
        y=alt.Y("lane_name:N", sort=list(LANES.values()), title=None),
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
    .properties(height=60 + 40 * tl["lane"].nunique())
    .interactive(bind_y=False)
)
st.altair_chart(chart, width="stretch")
st.caption("Drag to pan, scroll to zoom; pick a deeper level to see layers and kernels.")
st.dataframe(tl.drop(columns=["lane", "lane_name"]), hide_index=True)
sys_df = system_samples(source(), ids[0])
if not sys_df.empty:
    st.subheader("System samples")
    st.dataframe(sys_df, hide_index=True)
