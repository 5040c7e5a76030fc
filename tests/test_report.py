"""`mlscope report`: self-contained HTML and Markdown reports, and the suite's Table 2,
through the real CLI against a real stack's evaluations (read through the chDB owner)."""

from __future__ import annotations

import re
import subprocess
import threading
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

from analysis import report, report_render
from analysis.source import BusSource, Source
from mlscope.settings import Settings
from tests.analysis_fixtures import AnalysisRuns
from tests.conftest import child_env, python

pytestmark = pytest.mark.timeout(300)


# A report draws its figures itself: no plotting package is imported (blocked here).
# The program entry, as the console script runs it.
_NO_PLOTTING = (
    "import sys; sys.modules['matplotlib'] = None; from cli.main import program; program()"
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


class _Overlap:
    """A Source around another that notes the most reads in flight at once. The first
    read waits (at most 10 s, once) for a second one to start, so reads that overlap
    are seen as overlapping however fast the machine; ``serial``: one at a time."""

    def __init__(self, inner: Source, *, serial: bool) -> None:
        self.inner, self.most, self._now = inner, 0, 0
        self._lock, self._turn = threading.Lock(), threading.Lock() if serial else None
        self._second = threading.Event()

    def frame(self, sql: str, parameters: dict[str, Any] | None = None) -> Any:
        if self._turn is not None:
            with self._turn:
                self._note(+1)
                try:
                    return self.inner.frame(sql, parameters)
                finally:
                    self._note(-1)
        self._note(+1)
        try:
            self._second.wait(timeout=10.0)
            self._second.set()  # waited once: the rest go straight through
            return self.inner.frame(sql, parameters)
        finally:
            self._note(-1)

    def _note(self, step: int) -> None:
        with self._lock:
            self._now += step
            self.most = max(self.most, self._now)
            if self._now > 1:
                self._second.set()


def test_a_report_sends_its_independent_reads_together_and_reads_the_same(
    analysis_runs: AnalysisRuns,
) -> None:
    """The reads that do not need each other's results are in flight at once (a server
    answers them side by side), and the report is the one a reader taking them one at a
    time gets."""
    ids = list(analysis_runs.all)
    with BusSource(analysis_runs.settings) as bus:
        together, one_by_one = _Overlap(bus, serial=False), _Overlap(bus, serial=True)
        built = report_render.to_json(report.build(together, ids))
        serial = report_render.to_json(report.build(one_by_one, ids))
    assert one_by_one.most == 1
    assert together.most >= 2, "every read waited for the one before it"
    built.pop("created", None)
    serial.pop("created", None)
    assert built == serial
