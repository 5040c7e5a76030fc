"""Every dashboard page on real runs (AppTest), and the real server in headless Chromium."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pandas as pd
import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from analysis.source import BusSource
from analysis.summary import summary
from mlscope.contracts import JobRequest, ScenarioSpec
from tests import chromium
from tests.analysis_fixtures import BATCH_SIZES, AnalysisRuns

REPO = Path(__file__).resolve().parent.parent
VIEWS = REPO / "dashboard" / "views"
TIMEOUT = 60


@pytest.fixture
def env(analysis_runs: AnalysisRuns, monkeypatch: pytest.MonkeyPatch) -> AnalysisRuns:
    """The dashboard reads its settings from the environment, like every command."""
    for k, v in analysis_runs.settings.as_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MLSCOPE_CLICKHOUSE_DSN", raising=False)
    st.cache_resource.clear()
    st.cache_data.clear()
    return analysis_runs


def page(name: str, **query: str) -> AppTest:
    at = AppTest.from_file(str(VIEWS / name), default_timeout=TIMEOUT)
    at.query_params.update(query)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not stray_text(at), stray_text(at)
    return at


def stray_text(at: AppTest) -> list[str]:
    """Markdown the pages never write on purpose: a bare string literal in a page script
    (Streamlit "magic" prints it). The Run page's links to Results are the only markdown."""
    return [str(m.value) for m in at.markdown if not str(m.value).startswith("Open in Results")]


def texts(at: AppTest) -> str:
    parts = [m.value for m in at.markdown] + [m.value for m in at.info]
    parts += [m.value for m in at.caption] + [m.value for m in at.title]
    return "\n".join(str(p) for p in parts)


def test_agents_page(env: AnalysisRuns) -> None:
    at = page("agents.py")
    table = at.dataframe[0].value
    assert len(table) == 1
    assert "onnxruntime" in table["frameworks"].iloc[0]
    assert table["cores"].iloc[0] >= 1


def test_models_page(env: AnalysisRuns) -> None:
    at = page("models.py")
    tables = [d.value for d in at.dataframe]
    models = {m for t in tables for m in t["model"]}
    assert {"digits_cnn", "efficientnet_lite0"} <= models
    at.selectbox(key="models_task").select("image_classification").run()
    assert not at.exception
    narrowed = {m for d in at.dataframe for m in d.value["model"]}
    assert "digits_cnn" in narrowed and "silero_vad" not in narrowed


def test_results_page(env: AnalysisRuns) -> None:
    # By default the newest run and the runs like it (the batch sweep), not everything.
    at = page("results.py")
    summ = at.dataframe[0].value
    assert set(summ["evaluation_id"]) == set(env.batched.values())
    expected = summary(BusSource(env.settings), env.all).set_index("evaluation_id")
    for r in summ.itertuples():
        assert r.p90_ms == pytest.approx(expected.loc[r.evaluation_id, "p90_ms"])
    best = at.dataframe[1].value  # Throughput tab: max throughput table
    assert list(best["batch_sizes"].iloc[0]) == list(BATCH_SIZES)
    # latency percentiles + histogram, throughput, speed-up, completions/latency over time
    assert len(at.get("image")) >= 5
    at.selectbox(key="results_window_eval").select(env.batched[1]).run()
    assert not at.exception
    # Deep link: ?eval= anchors the selection on another run and its peers.
    at = page("results.py", eval=env.online[0])
    assert set(at.dataframe[0].value["evaluation_id"]) == set(env.online)
    assert "No batched runs" in texts(at)


def run_form(scenario: str) -> AppTest:
    at = page("run.py")
    at.selectbox(key="run_task").select("image_classification").run()
    at.selectbox(key="run_model").select("digits_cnn").run()
    at.multiselect(key="run_frameworks").set_value(["onnxruntime"]).run()
    at.selectbox(key="run_scenario").select(scenario).run()
    return at


def test_run_page_runs_an_evaluation(env: AnalysisRuns) -> None:
    at = run_form("online")
    assert set(at.selectbox(key="run_scenario").options) >= {
        "online", "batched", "peak", "cold-start", "multi-stream", "piecewise", "replay"
    }  # fmt: skip
    at.number_input(key="run_duration").set_value(0.6).run()
    at.button(key="run_go").click().run(timeout=120)
    assert not at.exception, [e.value for e in at.exception]
    new = at.session_state["last_evaluation"]
    assert new.startswith("ev-") and new not in env.all
    assert at.dataframe[0].value["evaluation"].iloc[0] == new
    # 0.6 s is under the default minimum duration: INVALID, shown as a warning with why.
    assert not at.success
    assert "INVALID" in at.warning[0].value and "minimum 10 s" in at.warning[0].value
    assert not stray_text(at), stray_text(at)


def test_run_page_starts_from_a_linked_evaluation(env: AnalysisRuns) -> None:
    at = page("run.py", eval=env.batched[4])
    assert at.selectbox(key="run_model").value == "digits_cnn"
    assert at.multiselect(key="run_frameworks").value == ["onnxruntime"]
    assert at.selectbox(key="run_scenario").value == "batched"
    assert at.number_input(key="run_batch").value == 4
    assert at.text_input(key="run_sweep").value == ""  # batch 4 alone, not a sweep
    at.number_input(key="run_batch").set_value(2).run()  # an edit is not undone
    assert at.number_input(key="run_batch").value == 2


def test_run_page_sweep_with_validity_knobs(env: AnalysisRuns) -> None:
    at = run_form("batched")
    at.text_input(key="run_sweep").set_value("1, 2").run()
    at.number_input(key="run_duration").set_value(0.4).run()
    at.number_input(key="run_min_duration").set_value(0.1).run()
    at.number_input(key="run_min_q").set_value(5).run()
    at.checkbox(key="run_accuracy").check().run()
    at.button(key="run_go").click().run(timeout=120)
    assert not at.exception, [e.value for e in at.exception]
    row = at.dataframe[0].value.iloc[0]
    assert row["top-1"] > 0.5  # the accuracy pass ran
    # The knobs reached the server: its default minimums are not what it checked.
    verdict = (at.success or at.warning)[0].value
    assert "minimum 10 s" not in verdict and "minimum 100" not in verdict


def test_run_page_system_requirements_reach_resolution(env: AnalysisRuns) -> None:
    """A requirement no live agent meets is refused by the server, per agent."""
    at = run_form("online")
    at.number_input(key="run_duration").set_value(0.4).run()
    at.number_input(key="run_sys_cores").set_value(4096).run()
    at.button(key="run_go").click().run(timeout=120)
    assert not at.exception, [e.value for e in at.exception]
    shown = " ".join(e.value for e in at.error)
    assert "4096 cores" in shown and "misses" in shown, shown


def test_compare_page(env: AnalysisRuns) -> None:
    at = page("compare.py")
    at.selectbox(key="compare_base").select(env.online[0]).run()
    at.multiselect(key="compare_cands").set_value([env.online[1]]).run()
    assert not at.exception, [e.value for e in at.exception]
    table = at.dataframe[0].value
    assert table["statistic"].tolist() == ["median", "p99"]
    assert set(table["verdict"]) <= {"faster", "slower", "no significant change"}
    assert len(at.metric) == 2


def test_trace_page(env: AnalysisRuns) -> None:
    at = page("trace.py", eval=env.online[0])
    assert at.selectbox(key="trace_eval").value == env.online[0]
    spans = at.dataframe[0].value
    assert {"query", "step"} <= set(spans["kind"])
    assert set(spans["query_index"]) == set(range(5))
    at.radio(key="trace_depth").set_value("kernel").run()
    at.number_input(key="trace_count").set_value(2).run()
    assert not at.exception
    assert set(at.dataframe[0].value["query_index"]) == {0, 1}
    assert "No kernel spans: this CPU run" in texts(at)


def test_overview_page_links_every_evaluation(env: AnalysisRuns) -> None:
    at = page("home.py")
    table = at.dataframe[0].value
    assert set(env.all) <= set(table["evaluation"])
    assert f"results?eval={env.online[0]}" in set(table["results"])


# ------------------------------------------------------------------ the real server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def dashboard_url(env: AnalysisRuns, tmp_path: Path) -> Iterator[str]:
    from cli.dashboard_cmd import command

    port = _free_port()
    log = (tmp_path / "streamlit.log").open("wb")
    proc = subprocess.Popen(
        command(port),
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError((tmp_path / "streamlit.log").read_text()) from None
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()


# What is on the page once it has settled: Streamlit exception boxes, each visible
# figure's share of coloured pixels (an empty chart is black, grey and white only; every
# figure of ours draws its data in colour) and markdown that no page writes
# on purpose (alerts, captions, labels and tabs render markdown too).
INSPECT = """(() => {
  const main = document.querySelector('[data-testid=stMain]');
  const out = {exceptions: main.querySelectorAll('[data-testid=stException]').length,
               figures: [], stray: [], text: main.innerText};
  for (const img of main.querySelectorAll('img')) {
    if (img.offsetParent === null) continue;
    if (!img.complete || !img.naturalWidth) { out.figures.push(-1); continue; }
    const c = document.createElement('canvas');
    c.width = img.naturalWidth; c.height = img.naturalHeight;
    const g = c.getContext('2d'); g.drawImage(img, 0, 0);
    const d = g.getImageData(0, 0, c.width, c.height).data;
    let n = 0;
    for (let i = 0; i < d.length; i += 4) {
      const hi = Math.max(d[i], d[i + 1], d[i + 2]), lo = Math.min(d[i], d[i + 1], d[i + 2]);
      if (hi - lo > 60) n++;
    }
    out.figures.push(n / (d.length / 4));
  }
  for (const m of main.querySelectorAll('[data-testid=stMarkdown]')) {
    if (m.offsetParent === null || m.querySelector('[data-testid=stCaptionContainer]') ||
        m.closest(
      '[data-testid=stAlert], [data-testid=stCaptionContainer], label, summary, ' +
      '[role=tab], [data-testid=stMetric], [data-testid=stHeading]')) continue;
    const path = []; for (let e = m.parentElement; e && e !== main; e = e.parentElement)
      if (e.dataset.testid) path.push(e.dataset.testid);
    out.stray.push(m.innerText.slice(0, 200) + ' @ ' + path.slice(0, 4).join('<'));
  }
  return out;
})()"""

SHOTS_DIR = REPO / "docs" / "screenshots"


@dataclass(frozen=True)
class Shot:
    name: str
    """The PNG's name (docs/screenshots/NAME.png)."""
    path: str
    """Page and query, ``results?eval={online}``: filled in from :func:`tour_runs`."""
    tab: str | None = None
    radio: str | None = None
    expect: str = ""
    """Text the page must show (tables and charts are canvases: not their text)."""
    absent: str = "No evaluations"
    """Text it must not show."""
    figures: int = 0
    """Figures (st.pyplot) it must show at least."""


TOUR = (
    Shot("overview", "", expect="Newest evaluations"),
    Shot("agents", "agents", expect="onnxruntime"),
    Shot("models", "models", expect="image_classification"),
    Shot("run", "run", expect="Validity and warm-up"),
    Shot("results-latency", "results?eval={online}", "Latency", figures=2),
    Shot("results-throughput", "results?eval={batched}", "Throughput", figures=2),
    Shot("results-peak", "results?eval={peak}", "Peak search", figures=1),
    Shot("results-accuracy", "results?eval={scored}", "Accuracy", figures=1),
    Shot("results-over-time", "results?eval={online}", "Over time", figures=1),
    Shot("results-layers", "results?eval={traced}", "Layers", figures=1),
    Shot("results-systems", "results?eval={online}", "Across systems", expect="price per hour"),
    Shot("results-regressions", "results?eval={online}", "Regressions", expect="versions"),
    Shot("compare", "compare?eval={online}", expect="vs", figures=1),
    Shot("trace", "trace?eval={online}", expect="in flight"),
    Shot("trace-layers", "trace?eval={traced}", radio="layer", absent="No layer spans"),
    Shot("trace-kernels", "trace?eval={traced}", radio="kernel", expect="No kernel spans"),
)


@pytest.fixture
def tour_runs(env: AnalysisRuns) -> dict[str, str]:
    """Besides the shared runs: a peak search, an online run traced at the framework
    level and one with its accuracy measured (through the Python API)."""
    from mlscope.api import Client

    async def run() -> dict[str, str]:
        async with Client(env.settings) as client:

            def job(**kw: Any) -> JobRequest:
                return JobRequest(model="digits_cnn", framework="onnxruntime", **kw)

            peak = await client.submit(
                job(
                    scenario=ScenarioSpec(
                        name="peak",
                        qps=50,
                        duration_s=0.3,
                        latency_bound_ms=50,
                        peak_trials=3,
                        min_duration_s=0.1,
                        min_queries=10,
                    )
                )
            )
            traced = await client.submit(
                job(
                    scenario=ScenarioSpec(name="online", qps=150, duration_s=0.5, seed=3),
                    trace_level="framework",
                )
            )
            # Its own run: the accuracy pass's queries would share the trace's indices.
            scored = await client.submit(
                job(
                    scenario=ScenarioSpec(name="online", qps=150, duration_s=0.3, seed=4),
                    accuracy=True,
                    accuracy_samples=200,
                )
            )
        return {
            "peak": peak.evaluation_id,
            "traced": traced.evaluation_id,
            "scored": scored.evaluation_id,
        }

    extra = anyio.run(run, backend="asyncio")
    st.cache_data.clear()
    return {"online": env.online[0], "batched": env.batched[BATCH_SIZES[-1]], **extra}


@pytest.mark.timeout(420)  # a stack's evaluations (~90 s here), then 16 pages in a browser
def test_screenshots_of_every_page(
    dashboard_url: str, tour_runs: dict[str, str], tmp_path: Path
) -> None:
    """Every page and tab in headless Chromium after a fixed set of runs: no exception
    box, no empty figure, no stray text; the screenshots go to MLSCOPE_SCREENSHOT_DIR
    (``docs/screenshots`` to refresh the README's)."""
    if chromium.executable() is None:
        pytest.fail("chromium is not installed: run `make install` (as root it installs it)")
    out = Path(os.environ.get("MLSCOPE_SCREENSHOT_DIR", tmp_path / "shots"))
    out.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    with chromium.open_page(f"{dashboard_url}/", tmp_path / "profile", size="1400,1050") as tab:
        for shot in TOUR:
            tab.goto(f"{dashboard_url}/{shot.path.format(**tour_runs)}")
            tab.settle(TIMEOUT)
            if shot.tab:
                tab.click("[role=tab]", shot.tab)
                tab.settle(TIMEOUT)
            if shot.radio:
                tab.click("[data-testid=stRadioOption]", shot.radio)
                tab.settle(TIMEOUT)
            seen = tab.evaluate(INSPECT)
            tab.screenshot(out / f"{shot.name}.png")
            problems += [f"{shot.name}: an exception box"] * bool(seen["exceptions"])
            problems += [f"{shot.name}: stray text {t!r}" for t in seen["stray"]]
            problems += [
                f"{shot.name}: figure {i} is empty ({c:.4f} coloured)"
                for i, c in enumerate(seen["figures"])
                if c < 0.001
            ]
            if len(seen["figures"]) < shot.figures:
                problems.append(f"{shot.name}: {len(seen['figures'])} figures < {shot.figures}")
            if shot.expect not in seen["text"]:
                problems.append(f"{shot.name}: no {shot.expect!r} on the page")
            if shot.absent in seen["text"]:
                problems.append(f"{shot.name}: {shot.absent!r} on the page")
            if "Traceback" in seen["text"]:
                problems.append(f"{shot.name}: a traceback")
    assert not problems, "\n".join(problems)
    assert all((out / f"{s.name}.png").stat().st_size > 20_000 for s in TOUR)


# ------------------------------------------------------------------ pure helpers


def test_comparable_runs_share_model_and_scenario() -> None:
    from dashboard.common import comparable

    ev = pd.DataFrame(
        {
            "evaluation_id": ["e5", "e4", "e3", "e2", "e1"],  # newest first
            "model": ["a", "b", "a", "a", "a"],
            "scenario": ["online", "online", "online", "batched", "online"],
        }
    )
    assert comparable(ev, None) == ["e5", "e3", "e1"]
    assert comparable(ev, "e2") == ["e2"]
    assert comparable(ev, "e1") == ["e1", "e5", "e3"]
    assert comparable(ev, "missing") == ["e5", "e3", "e1"]


def test_accuracy_scatter_leaves_out_runs_without_accuracy() -> None:
    from analysis import plots

    points = pd.DataFrame(
        {
            "model": ["digits_cnn", "light_resnet50"],
            "framework": ["onnxruntime", "onnxruntime"],
            "top1": [0.97, None],
            "online_latency_ms": [1.0, 5.0],
            "size_bytes": [1000, 90000],
        }
    )
    [drawn] = plots.accuracy_scatter(points, "online_latency_ms").marks
    assert drawn.x.tolist() == [1.0] and drawn.y.tolist() == [0.97]  # not light_resnet50 at 0


def test_inflight_slots_stack_overlapping_queries() -> None:
    from analysis.trace import inflight_slots

    tl = pd.DataFrame(
        {
            "kind": ["query", "step", "query", "step", "query"],
            "query_index": [0, 0, 1, 1, 2],
            "start_ms": [0.0, 0.5, 1.0, 1.5, 5.0],
            "end_ms": [4.0, 3.5, 6.0, 5.5, 7.0],
        }
    )
    # 1 starts while 0 runs (queued: its own lane); 2 starts after 0 ended (lane 0 again).
    assert inflight_slots(tl).tolist() == [0, 0, 1, 1, 0]


def test_layer_shapes_read_as_dimensions() -> None:
    from analysis.layers import shape_text

    ort = {
        "inputs": [{"dtype": "float", "shape": [1, 1, 8, 8]}],
        "outputs": [{"dtype": "float", "shape": [1, 8, 6, 6]}],
    }
    assert shape_text(ort) == "1×1×8×8 → 1×8×6×6"
    assert shape_text([[1, 10], [10]]) == "1×10, 10"
    assert shape_text(None) == ""


def test_throughput_plot_has_one_point_per_batch_size() -> None:
    from analysis import plots

    key = {"model_version": "1", "framework_version": "1", "system": "cpu", "role": "run"}
    summ = pd.DataFrame(
        [  # newest first; batch 1 measured twice, the newer run invalid
            {"batch_size": 1, "throughput_ips": 90.0, "p99_ms": 9.0, "valid": False},
            {"batch_size": 4, "throughput_ips": 300.0, "p99_ms": 4.0, "valid": True},
            {"batch_size": 1, "throughput_ips": 100.0, "p99_ms": 1.0, "valid": True},
        ]
    ).assign(model="m", framework="f", scenario="batched", **key)
    throughput, p99 = plots.throughput_by_batch(summ).marks
    assert throughput.x.tolist() == [1, 4] and throughput.y.tolist() == [100.0, 300.0]
    assert p99.right and p99.y.tolist() == [1.0, 4.0]
