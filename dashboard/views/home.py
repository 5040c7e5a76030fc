"""Overview: what is running and the newest evaluations, each linked to its pages."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard.common import agents, catalog, recent_evaluations, stop_on_error
from mlscope.errors import MLScopeError

NEWEST = 15

st.title("mlscope")
try:
    live = agents()
    ev = recent_evaluations()
except MLScopeError as exc:
    stop_on_error(exc)
    live, ev = [], pd.DataFrame()
c1, c2, c3 = st.columns(3)
c1.metric("Live agents", len(live))
c2.metric("Models in the catalog", len({e.manifest.name for e in catalog().entries}))
c3.metric("Evaluations stored", len(ev))
if ev.empty:
    st.info("No evaluations yet: start one on the Run page or with `mlscope-submit`.")
    st.stop()
st.subheader("Newest evaluations")
newest = ev.head(NEWEST)
table = pd.DataFrame(
    {
        "evaluation": newest["evaluation_id"],
        "model": newest["model"] + "/" + newest["framework"],
        "scenario": newest["scenario"],
        "batch": newest["batch_size"],
        "valid": newest["valid"].astype(bool),
        "created": pd.to_datetime(newest["created_at"]),
        "results": "results?eval=" + newest["evaluation_id"],
        "trace": "trace?eval=" + newest["evaluation_id"],
        "again": "run?eval=" + newest["evaluation_id"],
    }
)
st.dataframe(
    table,
    hide_index=True,
    column_config={
        "results": st.column_config.LinkColumn("results", display_text="open"),
        "trace": st.column_config.LinkColumn("trace", display_text="open"),
        "again": st.column_config.LinkColumn("run again", display_text="settings"),
        "created": st.column_config.DatetimeColumn("created", format="MM-DD HH:mm:ss"),
    },
)
