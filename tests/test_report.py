"""`mlscope report`: self-contained HTML and Markdown reports, and the suite's Table 2,
through the real CLI against a real stack's evaluations (read through the chDB owner)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from xml.etree import ElementTree

import pytest

from mlscope.settings import Settings
from tests.analysis_fixtures import AnalysisRuns
from tests.conftest import child_env, python

pytestmark = pytest.mark.timeout(300)


# A report draws its figures itself: no plotting package is imported (blocked here).
_NO_PLOTTING = (
    "import sys; sys.modules['matplotlib'] = None; from cli.main import main; "
    "raise SystemExit(main(sys.argv[1:]))"
)


def mlscope(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python(), "-c", _NO_PLOTTING, *args],
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
    # Self-contained: nothing is fetched from elsewhere.
    assert not re.search(r"""(src|href)=["']https?://""", html)
    figures = re.findall(r"<figure>(<svg .*?</svg>)<figcaption>(.*?)</figcaption>", html, re.S)
    captions = [c for _, c in figures]
    assert "Latency by percentile (log scale)" in captions, captions
    for drawn, caption in figures:
        root = ElementTree.fromstring(drawn)  # well-formed, standalone SVG
        assert root.tag == "{http://www.w3.org/2000/svg}svg", caption
        drawn_shapes = [e for e in root.iter() if e.tag.rpartition("}")[2] in ("path", "rect")]
        assert len(drawn_shapes) > 2, caption  # more than the background and the frame
    # One curve per evaluation with samples, each from the fastest to the slowest query.
    [(curves, _)] = [f for f in figures if f[1].startswith("Latency by percentile")]
    for e in ids:
        assert f">{e}</text>" in curves, e


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
