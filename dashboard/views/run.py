"""Run: push-button evaluation — task → model → framework → agent → scenario → trace
level — with live progress from the server's job events."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pandas as pd
import streamlit as st

from dashboard.common import agents, catalog, settings, stop_on_error
from mlscope.contracts import JobEvent, JobRequest, ScenarioSpec
from mlscope.errors import MLScopeError
from mlscope.jobs import submit

LEVELS = ["none", "model", "framework", "system", "full"]
SCENARIOS = ["online", "single-stream", "constant", "concurrency", "batched", "peak", "cold-start"]
"""The scenarios that need no file (replay and piecewise: mlscope-submit --scenario-file)."""

st.title("Run an evaluation")
tasks = catalog().tasks()
c1, c2, c3 = st.columns(3)
task = c1.selectbox("Task", list(tasks), key="run_task")
entries = tasks.get(task, []) if task else []
model = c2.selectbox("Model", sorted({e.manifest.name for e in entries}), key="run_model")
versions = sorted({e.manifest.version for e in entries if e.manifest.name == model})
version = c3.selectbox("Version", versions, key="run_version")
frameworks = sorted(
    {
        e.manifest.framework.name
        for e in entries
        if e.manifest.name == model and e.manifest.version == version
    }
)
c1, c2, c3 = st.columns(3)
framework = c1.selectbox("Framework", frameworks, key="run_framework")
try:
    live = [a for a in agents() if any(f["name"] == framework for f in a["frameworks"])]
except MLScopeError as exc:
    stop_on_error(exc)
    live = []
devices = sorted(
    {d for a in live for f in a["frameworks"] if f["name"] == framework for d in f["devices"]}
) or ["cpu"]
device = c2.selectbox("Device", devices, key="run_device")
choices: dict[str, str | None] = {"any (the server picks)": None}
choices |= {f"{a['agent_id']} ({a['host']}, {a['cpu_model']})": a["agent_id"] for a in live}
agent = c3.selectbox("Agent / system", list(choices), key="run_agent")
if not live:
    st.warning(f"No live agent offers {framework}; the job would fail to resolve.")
c1, c2, c3, c4 = st.columns(4)
scenario = c1.selectbox("Scenario", SCENARIOS, key="run_scenario")
qps = c2.number_input(
    "Rate (queries/s)",
    min_value=1.0,
    value=100.0,
    key="run_qps",
    disabled=scenario not in ("online", "constant", "peak"),
)
batch = c3.number_input(
    "Batch size", min_value=1, value=1 if scenario == "online" else 8, key="run_batch"
)
duration = c4.number_input("Duration (s)", min_value=0.5, value=10.0, key="run_duration")
c1, c2 = st.columns(2)
concurrency = c1.number_input(
    "Queries in flight (concurrency)",
    min_value=1,
    value=4,
    key="run_concurrency",
    disabled=scenario != "concurrency",
)
bound = c2.number_input(
    "p99 latency bound (ms, peak: the search target)",
    min_value=0.0,
    value=10.0 if scenario == "peak" else 0.0,
    key="run_bound",
)
level = st.select_slider("Trace level", LEVELS, value="model", key="run_level")

if st.button("Run", type="primary", key="run_go", disabled=not (model and framework)):
    job = JobRequest(
        model=str(model),
        model_version=version,
        framework=str(framework),
        device=str(device),
        agent_id=choices[str(agent)],
        scenario=ScenarioSpec.model_validate(
            {
                "name": scenario,
                "qps": float(qps),
                "batch_size": int(batch),
                "duration_s": float(duration),
                "concurrency": int(concurrency),
                "latency_bound_ms": float(bound) or None,
            }
        ),
        trace_level=str(level),
        submitted_at=time.time(),
    )
    bar = st.progress(0.0, text="submitted")
    status = st.empty()

    def on_event(event: JobEvent) -> None:
        if event.event == "accepted":
            status.write(f"accepted by {event.server_id}")
        elif event.event == "progress":
            frac = min(event.elapsed_s / float(duration), 1.0)
            p50 = "-" if event.p50_ms is None else f"{event.p50_ms:.3f} ms"
            bar.progress(
                frac,
                text=f"{event.queries_done} queries · {event.elapsed_s:.1f} s · running p50 {p50}",
            )

    try:
        summary = anyio.run(lambda: submit(settings(), job, on_event=on_event), backend="asyncio")
    except MLScopeError as exc:
        bar.empty()
        st.error(f"{type(exc).__name__}: {exc}")
    else:
        bar.progress(1.0, text="done")
        st.session_state["last_evaluation"] = summary.evaluation_id
        st.cache_data.clear()  # the new evaluation shows on the other pages now
        st.success(
            f"{summary.evaluation_id}: "
            + ("VALID" if summary.valid else "INVALID: " + "; ".join(summary.invalid_reasons))
        )
        lat = summary.latency_ms
        row: dict[str, Any] = {
            "evaluation": summary.evaluation_id,
            "queries": summary.queries,
            "trimmed mean ms": lat.trimmed_mean,
            "p50 ms": lat.p50,
            "p90 ms": lat.p90,
            "p99 ms": lat.p99,
            "throughput /s": summary.throughput_ips,
            "top-1": (summary.accuracy or {}).get("top1"),
        }
        st.dataframe(pd.DataFrame([row]), hide_index=True)
