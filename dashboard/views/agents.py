"""Agents: the live registry, with hardware and frameworks."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from dashboard.common import agents, stop_on_error
from mlscope.errors import MLScopeError

st.title("Agents")
try:
    found = agents()
except MLScopeError as exc:
    stop_on_error(exc)
    found = []
if not found:
    st.info("No live agent. Start one with `mlscope agent --framework onnxruntime`.")
    st.stop()
now = time.time()
st.dataframe(
    pd.DataFrame(
        [
            {
                "agent": a["agent_id"],
                "host": a["host"],
                "arch": a["arch"],
                "os": a["os"],
                "cpu": a["cpu_model"],
                "cores": a["cpu_cores"],
                "memory GiB": round(a["memory_bytes"] / 2**30, 1),
                "accelerators": ", ".join(f"{x['kind']}:{x['model']}" for x in a["accelerators"])
                or "-",
                "frameworks": ", ".join(
                    f"{f['name']} {f['version']} [{'/'.join(f['devices'])}]"
                    for f in a["frameworks"]
                ),
                "models": len(a["models"]),
                "last heartbeat s": round(now - a["heartbeat_at"], 1),
            }
            for a in found
        ]
    ),
    hide_index=True,
)
for a in found:
    with st.expander(f"{a['agent_id']}: models and capabilities"):
        st.dataframe(pd.DataFrame(a["models"]), hide_index=True)
        st.caption("Capabilities: " + (", ".join(a["capabilities"]) or "-"))
