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


def page(name: str) -> AppTest:
    at = AppTest.from_file(str(VIEWS / name), default_timeout=TIMEOUT)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


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
    at = page("results.py")
    summ = at.dataframe[0].value
    assert set(summ["evaluation_id"]) == set(env.all)
    expected = summary(BusSource(env.settings), env.all).set_index("evaluation_id")
    for r in summ.itertuples():
        assert r.p90_ms == pytest.approx(expected.loc[r.evaluation_id, "p90_ms"])
    best = at.dataframe[1].value  # Throughput tab: max throughput table
    assert list(best["batch_sizes"].iloc[0]) == list(BATCH_SIZES)
    assert len(at.get("image")) >= 2  # throughput and speed-up figures (st.pyplot)
    at.selectbox(key="results_window_eval").select(env.online[0]).run()
    assert not at.exception


def test_run_page_runs_an_evaluation(env: AnalysisRuns) -> None:
    at = page("run.py")
    at.selectbox(key="run_task").select("image_classification").run()
    at.selectbox(key="run_model").select("digits_cnn").run()
    at.selectbox(key="run_framework").select("onnxruntime").run()
    at.selectbox(key="run_scenario").select("online").run()
    at.number_input(key="run_duration").set_value(0.6).run()
    at.button(key="run_go").click().run(timeout=120)
    assert not at.exception, [e.value for e in at.exception]
    new = at.session_state["last_evaluation"]
    assert new.startswith("ev-") and new not in env.all
    assert at.dataframe[0].value["evaluation"].iloc[0] == new
    assert at.success and new in at.success[0].value


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
    at = page("trace.py")
    at.selectbox(key="trace_eval").select(env.online[0]).run()
    assert not at.exception
    spans = at.dataframe[0].value
    assert {"query", "step"} <= set(spans["kind"])
    assert set(spans["query_index"]) == set(range(5))
    at.radio(key="trace_depth").set_value("kernel").run()
    at.number_input(key="trace_count").set_value(2).run()
    assert not at.exception
    assert set(at.dataframe[0].value["query_index"]) == {0, 1}


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
    with chromium.open_page(f"{dashboard_url}/results", tmp_path / "profile") as tab:
        tab.wait_for(READY, timeout=90)
        time.sleep(1.0)  # let the last frame paint
        html = tab.dom()
        tab.screenshot(shot)
    # The page ran its script against the stack and rendered its tables and figures.
    assert "Results" in html and "Summary" in html
    assert html.count('data-testid="stDataFrame"') >= 2  # summary + max throughput
    assert "digits_cnn" in html and env.online[0] in html
    assert "Traceback" not in html and "stException" not in html
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one
