"""An MLPerf run's figures mean what every other evaluation's mean.

Offline and MultiStream runs (real nats-server, chDB, LoadGen, onnxruntime agent): the
stored summary, ``mlscope report`` and analysis agree on queries, samples, throughput
and latency, and equal a recomputation from the stored rows with numpy alone (one row
per LoadGen sample). LoadGen's own figures are kept apart, under its names, and equal
its log files.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pandas as pd
import pytest

from analysis.source import BusSource
from analysis.summary import sample_stats
from analysis.summary import summary as analysis_summary
from cli.stack import Stack
from cli.summary_text import format_summary
from mlscope import bus as busmod
from mlscope import remote
from mlscope.contracts import EvaluationSummary
from tests.conftest import child_env, running_stack

pytestmark = pytest.mark.timeout(240)

MLSCOPE = Path(sys.executable).parent / "mlscope"
USER_CONF = """\
*.Offline.min_duration = 300
*.Offline.min_query_count = 1
*.MultiStream.min_duration = 300
*.MultiStream.min_query_count = 40
"""
OFFLINE_QPS = "20000"
"""Offline: one LoadGen query of 1.1 x 20000 x 0.3 s = 6600 samples."""


@pytest.fixture(scope="module")
def ort(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("numbers"), zoo_dir, ["onnxruntime"]) as s:
        yield s


@pytest.fixture(scope="module")
def runs(ort: Stack, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """scenario -> (summary, output dir), run once for the module's tests."""
    base = tmp_path_factory.mktemp("runs")
    conf = base / "user.conf"
    conf.write_text(USER_CONF)
    out: dict[str, Any] = {}
    for scenario, flags in (("Offline", ["--target-qps", OFFLINE_QPS]), ("MultiStream", [])):
        logs = base / scenario
        doc = cli(
            ort,
            "mlperf",
            "digits_cnn",
            "--framework",
            "onnxruntime",
            "--scenario",
            scenario,
            "--user-conf",
            str(conf),
            "--output",
            str(logs),
            *flags,
        )
        out[scenario] = (doc, logs)
    return out


def cli(stack: Stack, *args: str) -> Any:
    got = subprocess.run(
        [str(MLSCOPE), *args, "--json"],
        env=child_env(stack.settings),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert got.returncode == 0, got.stderr
    return json.loads(got.stdout)


def rows_of(stack: Stack, eval_id: str) -> dict[str, np.ndarray]:
    async def go() -> tuple[list[str], list[list[Any]]]:
        async with busmod.connect(stack.settings, name="test") as bus:
            return await remote.sql(
                bus,
                "SELECT batch_size, ok, scheduled_ns, issued_ns, completed_ns FROM queries "
                "FINAL WHERE evaluation_id = {e:String} ORDER BY query_index",
                {"e": eval_id},
            )

    names, rows = anyio.run(go, backend="asyncio")
    return {n: np.array([r[i] for r in rows], np.int64) for i, n in enumerate(names)}


def nearest_rank_ms(values_ns: np.ndarray, q: float) -> float:
    ordered = np.sort(values_ns)
    return float(ordered[max(1, math.ceil(q / 100 * ordered.size)) - 1]) / 1e6


def detail(logs: Path) -> dict[str, Any]:
    """LoadGen's detail log, read here without mlscope's parser."""
    out: dict[str, Any] = {}
    for line in (logs / "mlperf_log_detail.txt").read_text().splitlines():
        if line.startswith(":::MLLOG "):
            rec = json.loads(line[len(":::MLLOG ") :])
            out[rec["key"]] = rec["value"]
    return out


@pytest.mark.parametrize("scenario", ["Offline", "MultiStream"])
def test_summary_is_the_rows_figures(ort: Stack, runs: dict[str, Any], scenario: str) -> None:
    doc, logs = runs[scenario]
    rows = rows_of(ort, doc["evaluation_id"])
    kv = detail(logs)
    # One row per LoadGen sample, each of batch size 1.
    per_query = kv["effective_samples_per_query"]
    assert per_query == (8 if scenario == "MultiStream" else int(1.1 * 20000 * 0.3))
    assert rows["ok"].size == kv["result_query_count"] * per_query
    assert set(rows["batch_size"].tolist()) == {1}
    ok = rows["ok"] != 0
    assert doc["queries"] == rows["ok"].size and doc["samples"] == int(ok.sum())
    assert doc["scenario"]["batch_size"] == 1
    # errors = issued samples not answered with outputs (failed + refused + lost).
    assert doc["errors"] == int((~ok).sum()) == doc["failed"] + doc["refused"] + doc["lost"]
    # throughput = samples answered / (last completion - first issue)
    span_s = (rows["completed_ns"].max() - rows["issued_ns"][rows["issued_ns"] > 0].min()) / 1e9
    assert doc["throughput_ips"] == pytest.approx(ok.sum() / span_s, rel=1e-9)
    lat = (rows["completed_ns"] - rows["scheduled_ns"])[ok]
    for q in (50, 90, 99):
        assert doc["latency_ms"][f"p{q}"] == pytest.approx(nearest_rank_ms(lat, q), rel=1e-12)
    assert doc["latency_ms"]["max"] == pytest.approx(lat.max() / 1e6, rel=1e-12)
    # LoadGen's own figures, apart and under its names, as its logs state them.
    lg = doc["mlperf"]
    assert lg["num_errors"] == kv["num_errors"]
    assert lg["samples_per_query"] == per_query
    assert lg["result"]["query_count"] == kv["result_query_count"]
    rate = kv.get("result_samples_per_second", kv.get("result_completed_samples_per_sec"))
    assert lg["throughput_ips"] == pytest.approx(rate)
    assert lg["percentiles_ns"]["99.00"] == kv.get(
        "result_99.00_percentile_per_query_latency_ns", kv["result_99.00_percentile_latency_ns"]
    )
    summary_txt = (logs / "mlperf_log_summary.txt").read_text()
    assert doc["valid"] == ("Result is : VALID" in summary_txt and doc["errors"] == 0)
    # The printed summary shows both: mlscope's figures, and LoadGen's on a line of its own.
    text = format_summary(EvaluationSummary.model_validate(doc))
    sut = doc["scenario"]["sut_batch_size"]
    assert f"batch=1 (SUT batch {sut}) seed=" in text
    loadgen = next(line for line in text.splitlines() if line.strip().startswith("LoadGen "))
    assert f"{'-' if rate is None else f'{rate:.1f}'} samples/s" in loadgen
    assert f"p99 {lg['percentiles_ns']['99.00'] / 1e6:.3f}" in loadgen
    assert f"{per_query} samples per query; {kv['num_errors']} runtime errors" in loadgen


def test_report_and_analysis_agree_with_the_summary(ort: Stack, runs: dict[str, Any]) -> None:
    docs = {d["evaluation_id"]: d for d, _ in runs.values()}
    report = cli(ort, "report", *docs)
    table = next(t for s in report["sections"] for t in s.get("tables", []))
    seen = set()
    for row in table["rows"]:
        doc = docs[row["evaluation_id"]]
        seen.add(row["evaluation_id"])
        assert row["queries"] == doc["queries"]
        assert row["batch_size"] == doc["scenario"]["batch_size"] == 1
        assert row["throughput_ips"] == pytest.approx(doc["throughput_ips"], rel=1e-9)
        for q in ("p50", "p90", "p99"):
            assert row[f"{q}_ms"] == pytest.approx(doc["latency_ms"][q], rel=1e-9)
    assert seen == set(docs)
    with BusSource(ort.settings) as source:
        got = analysis_summary(source, list(docs)).set_index("evaluation_id")
    for ev, doc in docs.items():
        assert got.loc[ev, "samples"] == doc["samples"]
        assert got.loc[ev, "errors"] == doc["errors"]
        assert got.loc[ev, "throughput_ips"] == pytest.approx(doc["throughput_ips"], rel=1e-9)


def test_offline_has_no_offered_or_issued_rate(runs: dict[str, Any]) -> None:
    """Offline's one query is scheduled and issued at once: no rate over one instant."""
    doc, _ = runs["Offline"]
    assert doc["scheduled_qps"] is None and doc["achieved_qps"] is None
    assert doc["completed_qps"] is not None and doc["completed_qps"] > 0
    assert re.fullmatch(r"mlperf-offline", doc["scenario"]["name"])


class _OneEvaluation:
    """A source answering the per-evaluation statistics with one fixed row."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.row = row

    def frame(self, sql: str, parameters: dict[str, Any] | None = None) -> pd.DataFrame:
        return pd.DataFrame([self.row])


def test_rows_stored_with_samples_per_query_count_as_one_sample_each() -> None:
    """MLPerf rows stored by earlier versions carry LoadGen's samples per query in
    ``batch_size``: analysis still counts each as the one sample it is."""
    row = {
        **dict.fromkeys(
            ("warmup_queries", "errors", "not_issued", "failed", "refused", "lost", "correct"), 0
        ),
        **dict.fromkeys(("queries", "answered", "issued", "completed"), 100),
        "evaluation_id": "ev-old",
        "samples": 100 * 4400,
        "first_issued_ns": 1_000_000_000,
        "last_completed_ns": 3_000_000_000,
        **dict.fromkeys(("trimmed_mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms"), 1.0),
    }
    source = _OneEvaluation(row)
    old = sample_stats(source, ["ev-old"], sample_rows={"ev-old"})["ev-old"]
    assert old["samples"] == 100 and old["throughput_ips"] == 50.0
    other = sample_stats(source, ["ev-old"])["ev-old"]  # any other evaluation's rows
    assert other["samples"] == 440_000 and other["throughput_ips"] == 220_000.0
