"""Run: push-button evaluation (task → model → frameworks → agent → scenario → trace level)
through the Python API (mlscope.api.Client), with live progress from the job events."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import pandas as pd
import streamlit as st

from dashboard.common import (
    agents,
    catalog,
    deep_link,
    settings,
    stop_on_error,
)
from dashboard.prefill import LEVELS, notes, prefill
from mlscope import scenario_traits
from mlscope.api import Client
from mlscope.contracts import (
    EvaluationSummary,
    JobEvent,
    JobRequest,
    ScenarioSpec,
    SystemRequirement,
)
from mlscope.errors import MLScopeError

# Comments here, never a bare string after a statement: Streamlit "magic" would print
# it on the page. Which inputs a scenario takes comes from its traits (the ``fields``
# it reads), so a new scenario gets its form without an edit here.


def _numbers(text: str, kind: type[float] | type[int]) -> tuple[Any, ...]:
    """Comma- or whitespace-separated numbers ("1, 2, 4" → (1, 2, 4)); a ValueError
    names the first word that is not one."""
    out = []
    for word in text.replace(",", " ").split():
        try:
            out.append(kind(word))
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise ValueError(f"{word!r} is not {what}") from None
    return tuple(out)


def _segments(text: str) -> tuple[tuple[float, float, float], ...]:
    """``start,end,seconds`` per line or per ``;`` (a piecewise rate schedule)."""
    out = []
    for part in text.replace("\n", ";").split(";"):
        if part.strip():
            numbers = _numbers(part, float)
            if len(numbers) != 3:
                raise ValueError(f"{part.strip()!r} is not three numbers: from, to, seconds")
            out.append((numbers[0], numbers[1], numbers[2]))
    return tuple(out)


def _read(label: str, text: str, parse: Callable[[str], Any], unread: list[str]) -> Any:
    """``parse(text)``; where it cannot, None, and why (under the box and in ``unread``)."""
    try:
        return parse(text)
    except ValueError as exc:
        unread.append(f"{label}: {exc}")
        st.error(unread[-1])
        return None


def scenario_form(unread: list[str]) -> dict[str, Any]:
    """The scenario's fields, as ScenarioSpec takes them: those it does not read
    (:meth:`~mlscope.scenario_traits.ScenarioTraits.reads`) are disabled and never sent,
    as ``mlscope-submit`` refuses their flags (a disabled box still holds a value). A
    text box that cannot be read is said and added to ``unread`` (nothing runs then)."""
    c1, c2, c3, c4 = st.columns(4)
    scenario_traits.load_modules(settings().scenario_modules)  # scenarios of plug-ins too
    name = c1.selectbox("Scenario", scenario_traits.names(), key="run_scenario")
    traits = scenario_traits.get(name)
    off = {f: not traits.reads(f) for f in ScenarioSpec.model_fields}
    values: dict[str, Any] = {"name": name}
    values["qps"] = c2.number_input(
        "Rate (queries/s)", min_value=1.0, value=100.0, key="run_qps", disabled=off["qps"]
    )
    values["batch_size"] = c3.number_input(
        "Batch size (multi-stream: samples per query)",
        min_value=1,
        value=8 if traits.fields & {"batch_size", "batch_sizes"} else 1,
        key="run_batch",
    )
    values["duration_s"] = c4.number_input(
        "Duration (s)",
        min_value=0.1,
        value=10.0,
        key="run_duration",
        disabled=off["duration_s"],
        help=f"{name}: {traits.unread('duration_s')}" if off["duration_s"] else None,
    )
    values.update(_load_row(traits, off, unread))
    values.update(_cold_start_row(off))
    values.update(_lists(off, unread))
    return {k: v for k, v in values.items() if k == "name" or not off[k]}


def _load_row(
    traits: scenario_traits.ScenarioTraits, off: dict[str, bool], unread: list[str]
) -> dict[str, Any]:
    """The second row: a sweep's batch sizes, queries in flight, a latency bound, a
    peak search's trials."""
    c1, c2, c3, c4 = st.columns(4)
    values: dict[str, Any] = {}
    sweep = c1.text_input(
        "Batch sizes swept (batched)", "1, 2, 4, 8", key="run_sweep", disabled=off["batch_sizes"]
    )
    if not off["batch_sizes"] and sweep.strip():
        values["batch_sizes"] = _read(
            "Batch sizes swept", sweep, lambda t: _numbers(t, int), unread
        )
    values["concurrency"] = c2.number_input(
        "Queries in flight",
        min_value=1,
        value=4,
        key="run_concurrency",
        disabled=off["concurrency"],
    )
    bound = c3.number_input(
        "p99 latency bound (ms; peak: the target)",
        min_value=0.0,
        value=10.0 if "peak_trials" in traits.fields else 0.0,
        key="run_bound",
        disabled=off["latency_bound_ms"],
    )
    values["latency_bound_ms"] = float(bound) or None
    values["peak_trials"] = c4.number_input(
        "Peak: most trials", min_value=2, value=10, key="run_trials", disabled=off["peak_trials"]
    )
    return values


def _cold_start_row(off: dict[str, bool]) -> dict[str, Any]:
    """The third row: cold start's loads and warm queries, load generators, the seed."""
    c1, c2, c3, c4 = st.columns(4)
    return {
        "repetitions": c1.number_input(
            "Cold start: loads", min_value=1, value=5, key="run_reps", disabled=off["repetitions"]
        ),
        "warm_queries": c2.number_input(
            "Cold start: warm queries",
            min_value=1,
            value=20,
            key="run_warm",
            disabled=off["warm_queries"],
        ),
        "loadgens": c3.number_input(
            "Load generators", min_value=1, value=1, key="run_loadgens", disabled=off["loadgens"]
        ),
        "seed": c4.number_input("Seed", value=0, step=1, key="run_seed"),
    }


def _lists(off: dict[str, bool], unread: list[str]) -> dict[str, Any]:
    """A piecewise run's segments and a replay's inter-arrival times, where read."""
    values: dict[str, Any] = {}
    if not off["segments"]:
        text = st.text_area(
            "Segments: rate from, rate to, seconds; …", "50,200,2; 200,200,2", key="run_segments"
        )
        values["segments"] = _read("Segments", text, _segments, unread)
    if not off["arrivals_s"]:
        text = st.text_area("Inter-arrival times (s)", "0.01 0.01 0.05 0.002", key="run_arrivals")
        values["arrivals_s"] = _read(
            "Inter-arrival times", text, lambda t: _numbers(t, float), unread
        )
    return values


def validity_form(name: str) -> dict[str, Any]:
    """Validity knobs and warm-up (0 / empty: the server's policy), for scenario
    ``name``: those it does not read (cold-start judges its loads) disabled and not sent."""
    off = {f: not scenario_traits.get(name).reads(f) for f in ScenarioSpec.model_fields}
    with st.expander("Validity and warm-up"):
        c1, c2, c3, c4, c5 = st.columns(5)
        values = {
            "min_duration_s": c1.number_input(
                "Min duration (s)",
                min_value=0.0,
                value=0.0,
                key="run_min_duration",
                disabled=off["min_duration_s"],
            )
            or None,
            "min_queries": c2.number_input(
                "Min queries", min_value=0, value=0, key="run_min_q", disabled=off["min_queries"]
            )
            or None,
            "max_issue_lag_us": c3.number_input(
                "Max p99 issue lag (µs)",
                min_value=0.0,
                value=0.0,
                key="run_max_lag",
                disabled=off["max_issue_lag_us"],
            )
            or None,
            "max_queries": c4.number_input(
                "Max queries", min_value=0, value=0, key="run_max_q", disabled=off["max_queries"]
            )
            or None,
            "warmup_queries": c5.number_input(
                "Warm-up queries",
                min_value=0,
                value=0,
                key="run_warmup",
                disabled=off["warmup_queries"],
            ),
        }
    return {k: v for k, v in values.items() if not off[k]}


def system_form() -> SystemRequirement | None:
    """What the agent's machine must have (empty: anything), as ``--system`` asks."""
    with st.expander("System requirements"):
        c1, c2, c3, c4, c5 = st.columns(5)
        wanted: dict[str, Any] = {
            "arch": c1.text_input("Architecture", "", key="run_sys_arch", placeholder="amd64")
            or None,
            "accelerator": c2.text_input("Accelerator", "", key="run_sys_acc", placeholder="H100")
            or None,
            "min_memory_bytes": int(
                c3.number_input("Min memory (GiB)", min_value=0.0, value=0.0, key="run_sys_mem")
                * (1 << 30)
            )
            or None,
            "min_cores": c4.number_input("Min cores", min_value=0, value=0, key="run_sys_cores")
            or None,
            "host": c5.text_input("Host", "", key="run_sys_host") or None,
        }
    if not any(v is not None for v in wanted.values()):
        return None
    return SystemRequirement.model_validate(wanted)


def run_jobs(jobs: list[JobRequest]) -> list[EvaluationSummary]:
    """Submit ``jobs`` one after another on one client, with a progress bar each: how
    far the running run is against its scenario's planned extent (a sweep's bar starts
    again with each of its runs), empty where the extent is unknown."""
    done: list[EvaluationSummary] = []

    async def go() -> None:
        async with Client(settings(), name="mlscope dashboard") as client:
            for job in jobs:
                bar = st.progress(0.0, text=f"{job.framework}: submitted")
                extent = scenario_traits.get(job.scenario.name).extent(job.scenario)

                def on_event(
                    event: JobEvent, bar: Any = bar, fw: str = job.framework, extent: Any = extent
                ) -> None:
                    if event.event == "queued":
                        bar.progress(0.0, text=f"{fw}: queued, every server is busy")
                    elif event.event == "accepted":
                        bar.progress(0.0, text=f"{fw}: accepted by {event.server_id}")
                    elif event.event == "progress":
                        p50 = "-" if event.p50_ms is None else f"{event.p50_ms:.3f} ms"
                        bar.progress(
                            extent.fraction(event.queries_done, event.elapsed_s) or 0.0,
                            text=f"{fw}: {event.evaluation_id}: {event.queries_done} queries · "
                            f"{event.elapsed_s:.1f} s · running p50 {p50}",
                        )

                done.append(await client.submit(job, on_progress=on_event))
                bar.progress(1.0, text=f"{job.framework}: done")

    anyio.run(go, backend="asyncio")
    return done


def show(summaries: list[EvaluationSummary]) -> None:
    for s in summaries:
        if s.valid:
            st.success(f"{s.evaluation_id} ({s.framework['name']}): VALID")
        else:
            st.warning(
                f"{s.evaluation_id} ({s.framework['name']}): INVALID\n\n"
                + "\n".join(f"- {r}" for r in s.invalid_reasons or ("(no reason given)",))
            )
    rows = [
        {
            "evaluation": s.evaluation_id,
            "framework": s.framework["name"],
            "valid": s.valid,
            "queries": s.queries,
            "trimmed mean ms": s.latency_ms.trimmed_mean,
            "p50 ms": s.latency_ms.p50,
            "p90 ms": s.latency_ms.p90,
            "p99 ms": s.latency_ms.p99,
            "throughput /s": s.throughput_ips,
            "top-1": (s.accuracy or {}).get("top1"),
        }
        for s in summaries
    ]
    st.dataframe(pd.DataFrame(rows), hide_index=True)
    links = " · ".join(f"[{s.evaluation_id}](results?eval={s.evaluation_id})" for s in summaries)
    st.markdown(f"Open in Results: {links}")


st.title("Run an evaluation")
if (linked := deep_link()) is not None:
    prefill(linked)
    started, unheld = notes()
    if started:
        st.caption(started)
    if unheld:
        st.warning(unheld)
tasks = catalog().tasks()
c1, c2, c3 = st.columns(3)
task = c1.selectbox("Task", list(tasks), key="run_task")
entries = tasks.get(task, []) if task else []
model = c2.selectbox("Model", sorted({e.manifest.name for e in entries}), key="run_model")
versions = sorted({e.manifest.version for e in entries if e.manifest.name == model})
version = c3.selectbox("Version", versions, key="run_version")
mine = [e for e in entries if e.manifest.name == model and e.manifest.version == version]
offered = sorted({e.manifest.framework.name for e in mine})
latency_only = all(e.manifest.latency_only for e in mine)
c1, c2, c3 = st.columns(3)
frameworks = c1.multiselect("Frameworks", offered, default=offered[:1], key="run_frameworks")
try:
    live = [a for a in agents() if any(f["name"] in frameworks for f in a["frameworks"])]
except MLScopeError as exc:
    stop_on_error(exc)
    live = []
devices = sorted(
    {d for a in live for f in a["frameworks"] if f["name"] in frameworks for d in f["devices"]}
) or ["cpu"]
device = c2.selectbox("Device", devices, key="run_device")
choices: dict[str, str | None] = {"any (the server picks)": None}
if len(frameworks) == 1:
    choices |= {f"{a['agent_id']} ({a['host']}, {a['cpu_model']})": a["agent_id"] for a in live}
agent = c3.selectbox("Agent / system", list(choices), key="run_agent")
missing = [f for f in frameworks if not any(x["name"] == f for a in live for x in a["frameworks"])]
if missing:
    st.warning(f"No live agent offers {', '.join(missing)}; the job would fail to resolve.")
unread: list[str] = []
spec = scenario_form(unread)
validity = validity_form(spec["name"])
system = system_form()
c1, c2, c3 = st.columns([2, 1, 1])
level = c1.select_slider("Trace level", LEVELS, value="model", key="run_level")
accuracy = c2.checkbox(
    "Also measure accuracy",
    value=False,
    key="run_accuracy",
    disabled=latency_only,
    help="latency-only model: no labelled data set" if latency_only else None,
)
parallel = c3.checkbox("Run beside other jobs", value=False, key="run_parallel")

if st.button("Run", type="primary", key="run_go", disabled=not (model and frameworks)):
    if unread:
        st.error("Not run: " + "; ".join(unread))
        st.stop()
    try:
        scenario = ScenarioSpec.model_validate({**spec, **validity})
    except ValueError as exc:
        st.error(f"The scenario is not valid: {exc}")
        st.stop()
    jobs = [
        JobRequest(
            model=str(model),
            model_version=version,
            framework=fw,
            device=str(device),
            agent_id=choices[str(agent)],
            scenario=scenario,
            trace_level=str(level),
            accuracy=bool(accuracy),
            parallel=bool(parallel),
            system=system,
            submitted_at=time.time(),
        )
        for fw in frameworks
    ]
    try:
        summaries = run_jobs(jobs)
    except MLScopeError as exc:
        st.error(f"{type(exc).__name__}: {exc}")
    else:
        st.session_state["last_evaluation"] = summaries[-1].evaluation_id
        st.cache_data.clear()  # the new evaluations show on the other pages now
        show(summaries)
