"""Every dashboard page on real runs (AppTest), and the real server in headless Chromium."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from analysis.source import BusSource
from analysis.summary import summary
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


# Rendered: tables present and the script no longer running.
READY = (
    "document.querySelectorAll('[data-testid=stDataFrame]').length > 0 && "
    "!document.querySelector('[data-testid=stStatusWidgetRunningIcon]') && "
    "document.querySelectorAll('[data-testid=stImage], [data-testid=stImageContainer], "
    "img').length > 0"
)


def test_dashboard_in_headless_chromium(
    dashboard_url: str, env: AnalysisRuns, tmp_path: Path
) -> None:
    if chromium.executable() is None:
        pytest.fail("chromium is not installed: run `make install` (as root it installs it)")
    shot = Path(os.environ.get("MLSCOPE_SCREENSHOT_DIR", tmp_path)) / "dashboard.png"
    url = f"{dashboard_url}/results?eval={env.online[0]}"
    with chromium.open_page(url, tmp_path / "profile") as tab:
        tab.wait_for(READY, timeout=90)
        time.sleep(1.0)  # let the last frame paint
        html = tab.dom()
        tab.screenshot(shot)
    # The page ran its script against the stack and rendered its tables and figures.
    assert "Results" in html and "Summary" in html
    assert html.count('data-testid="stDataFrame"') >= 1  # the summary
    assert "digits_cnn" in html and env.online[0] in html
    assert "Traceback" not in html and "stException" not in html
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one
