"""`mlscope report`: self-contained HTML and Markdown reports, and the suite's Table 2,
through the real CLI against a real stack's evaluations (read through the chDB owner)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from mlscope.settings import Settings
from tests.analysis_fixtures import AnalysisRuns
from tests.conftest import child_env, python

pytestmark = pytest.mark.timeout(300)


def mlscope(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python(), "-m", "cli.main", *args],
        env=child_env(settings),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_html_report_is_self_contained_with_tables_and_plots(
    analysis_runs: AnalysisRuns, tmp_path: Path
) -> None:
    ids = list(analysis_runs.all)
    out = tmp_path / "report.html"
    done = mlscope(analysis_runs.settings, "report", *ids, "-o", str(out))
    assert done.returncode == 0, done.stderr
    html = out.read_text()
    assert html.lstrip().lower().startswith("<!doctype html")
    assert html.count("<table") >= 2  # the summary and at least one figure's table
    assert all(i in html for i in ids)
    assert re.search(r"<svg|data:image/(png|svg\+xml);base64,", html), "no embedded plot"
    # Self-contained: nothing is fetched from elsewhere.
    assert not re.search(r"""(src|href)=["']https?://""", html)


def test_markdown_report_has_the_summary_table(analysis_runs: AnalysisRuns, tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    done = mlscope(analysis_runs.settings, "report", *analysis_runs.online, "-o", str(out))
    assert done.returncode == 0, done.stderr
    md = out.read_text()
    assert re.search(r"^\|.*evaluation_id.*\|$", md, re.M), md[:2000]
    assert all(i in md for i in analysis_runs.online)


def test_suite_prints_table_2(analysis_runs: AnalysisRuns) -> None:
    done = mlscope(
        analysis_runs.settings, "report", "--suite", "--models", "digits_cnn/onnxruntime"
    )
    assert done.returncode == 0, done.stderr
    header = done.stdout.splitlines()[0].lower()
    for column in ("model", "framework", "top-1", "size", "p90", "tput", "batch"):
        assert column in header, done.stdout
    assert "digits_cnn" in done.stdout and "onnxruntime" in done.stdout


def test_report_of_an_unknown_evaluation_fails_clearly(
    analysis_runs: AnalysisRuns, tmp_path: Path
) -> None:
    done = mlscope(analysis_runs.settings, "report", "ev-nope", "-o", str(tmp_path / "r.md"))
    assert done.returncode != 0
    assert "ev-nope" in done.stderr
