"""Models: the catalog by task, with versions and frameworks."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard.common import catalog

st.title("Models")
tasks = catalog().tasks()
if not tasks:
    st.info("The catalog is empty: no model manifests found.")
    st.stop()
task = st.selectbox("Task", ["(all)", *tasks], key="models_task")
for name, entries in tasks.items():
    if task not in ("(all)", name):
        continue
    st.subheader(name)
    st.dataframe(
        pd.DataFrame(
            [
                {
                    "model": e.manifest.name,
                    "version": e.manifest.version,
                    "framework": e.manifest.framework.name,
                    "framework versions": e.manifest.framework.version,
                    "dataset": e.manifest.dataset.name if e.manifest.dataset else "-",
                    "latency only": e.manifest.latency_only,
                    "description": e.manifest.description,
                }
                for e in entries
            ]
        ),
        hide_index=True,
    )
