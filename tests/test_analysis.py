"""analysis/: statistics over the evaluation database, on real runs and real chDB."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from analysis import compare, figures, layers, suite, trace
from analysis.data import evaluations, queries
from analysis.source import BusSource, DirectSource, open_source, table_exists
from analysis.summary import latency_windows, summary
from mlscope.errors import DatabaseError
from mlscope.settings import Settings
from mlscope.stats import percentile, trimmed_mean
from tests.analysis_fixtures import BATCH_SIZES, LAYERS, QUERIES, SPAN_EVAL, AnalysisRuns

# ------------------------------------------------------------------ comparison verdicts


def test_verdict_detects_a_ten_percent_shift() -> None:
    rng = np.random.default_rng(7)
    a = rng.lognormal(mean=np.log(2.0), sigma=0.15, size=800)
    b = rng.lognormal(mean=np.log(2.2), sigma=0.15, size=800)  # 10% slower
    slower = compare.bootstrap_difference(a, b, 50, n_boot=1000)
    assert slower.verdict == "slower"
    assert 0.05 < slower.rel < 0.15
    assert slower.ci_low > 0
    tail = compare.bootstrap_difference(a, b, 99, n_boot=1000, min_effect=0.05)
    assert tail.verdict == "slower"
    faster = compare.bootstrap_difference(b, a, 50, n_boot=1000)
    assert faster.verdict == "faster" and faster.ci_high < 0


def test_identical_distributions_are_judged_equal() -> None:
    rng = np.random.default_rng(11)
    for trial in range(5):
        a = rng.lognormal(mean=np.log(2.0), sigma=0.15, size=2000)
        b = rng.lognormal(mean=np.log(2.0), sigma=0.15, size=2000)
        for q, floor in ((50, 0.02), (99, 0.05)):  # compare_runs' floors
            d = compare.bootstrap_difference(a, b, q, n_boot=1000, seed=trial,
                                             min_effect=floor)
            assert d.verdict == "no significant change", (trial, q, d)
            assert abs(d.rel) < floor


def test_resampled_percentile_is_the_stats_definition() -> None:
    rng = np.random.default_rng(3)
    x = rng.exponential(size=37)
    idx = rng.integers(0, x.size, size=(20, x.size))
    for q in (1, 50, 90, 99, 100):
        got = compare.resampled_percentile(x, q, idx)
        assert got.tolist() == [percentile(x[i], q) for i in idx]


# ------------------------------------------------------------------ on real runs


def test_bus_and_direct_sources_agree(analysis_runs: AnalysisRuns) -> None:
    bus = open_source(analysis_runs.settings)
    assert isinstance(bus, BusSource)
    small = BusSource(analysis_runs.settings, page_rows=7)  # many pages
    ids = list(analysis_runs.online)
    q1, q2 = queries(bus, ids), queries(small, ids)
    assert len(q1) == len(q2) > 100
    pd.testing.assert_frame_equal(q1.reset_index(drop=True), q2.reset_index(drop=True),
                                  check_dtype=False)
    assert table_exists(bus, "queries") and not table_exists(bus, "no_such_table")
    with pytest.raises(DatabaseError):
        evaluations(bus, ["ev-does-not-exist"])


def test_summary_recomputes_the_stored_figures(analysis_runs: AnalysisRuns) -> None:
    src = BusSource(analysis_runs.settings)
    summ = summary(src, analysis_runs.all)
    assert list(summ["evaluation_id"]) == analysis_runs.all
    stored = evaluations(src, analysis_runs.all)
    q = queries(src, [analysis_runs.online[0]])
    ms = q.loc[q["ok"], "latency_ns"].to_numpy() / 1e6
    row = summ.iloc[0]
    assert row["p90_ms"] == pytest.approx(percentile(ms, 90))
    assert row["trimmed_mean_ms"] == pytest.approx(trimmed_mean(ms))
    assert row["queries"] == len(q) and row["samples"] == int(q["ok"].sum())
    # The analysis recomputes what the server stored, with the same definitions.
    for r, s in zip(summ.itertuples(), stored.itertuples(), strict=True):
        assert r.throughput_ips == pytest.approx(s.throughput_ips, rel=1e-9)
        assert r.top1 == pytest.approx(s.top1)
        assert 0.8 < r.top1 <= 1.0  # digits_cnn is ~98% accurate on its hold-out set
    assert set(summ["scenario"]) == {"online", "batched"}
    assert summ.loc[summ["scenario"] == "batched", "batch_size"].tolist() == list(BATCH_SIZES)


def test_throughput_figures(analysis_runs: AnalysisRuns) -> None:
    summ = summary(BusSource(analysis_runs.settings), analysis_runs.all)
    batched = summ[summ["scenario"] == "batched"]
    best = figures.max_throughput(summ)
    assert len(best) == 1
    top = batched.loc[batched["throughput_ips"].idxmax()]
    assert best["max_throughput_ips"].iloc[0] == pytest.approx(top["throughput_ips"])
    assert best["optimal_batch_size"].iloc[0] == top["batch_size"]
    assert best["batch_sizes"].iloc[0] == list(BATCH_SIZES)
    heat = figures.speedup_heatmap(summ)
    assert list(heat.columns) == list(BATCH_SIZES) and len(heat) == 1
    assert heat.iloc[0, 0] == 1.0
    tput = batched.set_index("batch_size")["throughput_ips"]
    assert heat.iloc[0][16] == pytest.approx(tput[16] / tput[1])
    acc = figures.accuracy_tradeoff(summ, {"digits_cnn/onnxruntime": 1234})
    assert acc["size_bytes"].tolist() == [1234]
    assert acc["online_latency_ms"].iloc[0] == pytest.approx(summ["trimmed_mean_ms"].iloc[0])
    system = summ["system"].iloc[0]
    cost = figures.across_systems(summ, "digits_cnn", {system: 3.6})
    assert cost["cost_per_million"].iloc[0] == pytest.approx(
        3.6 / (best["max_throughput_ips"].iloc[0] * 3600) * 1e6)


def test_latency_windows(analysis_runs: AnalysisRuns) -> None:
    src = BusSource(analysis_runs.settings)
    w = latency_windows(src, analysis_runs.online[0], window_s=0.25)
    q = queries(src, [analysis_runs.online[0]])
    assert w["queries"].sum() == int(q["ok"].sum())
    assert len(w) >= 4 and list(w["window"]) == sorted(w["window"])
    assert (w["p50_ms"] <= w["p99_ms"]).all()
    with pytest.raises(ValueError):
        latency_windows(src, analysis_runs.online[0], window_s=0)


def test_compare_runs_and_regressions(analysis_runs: AnalysisRuns) -> None:
    src = BusSource(analysis_runs.settings)
    a, b = analysis_runs.online
    table = compare.compare_runs(src, a, b, n_boot=300)
    assert table["statistic"].tolist() == ["median", "p99"]
    assert set(table["verdict"]) <= {"faster", "slower", "no significant change"}
    assert (table["ci_low"] <= table["ci_high"]).all()
    summ = summary(src, analysis_runs.all)
    # Pretend the second online run used a newer framework: one step to judge.
    fake = summ.copy()
    fake.loc[fake["evaluation_id"] == b, "framework_version"] = "99.0"
    flags = compare.regressions(src, fake, n_boot=300)
    assert len(flags) == 1
    assert flags["from_version"].iloc[0] != "99.0" and flags["to_version"].iloc[0] == "99.0"
    assert flags["regression"].iloc[0] == (flags["verdict"].iloc[0] == "slower")
    with pytest.raises(ValueError):
        compare.regressions(src, summ, axis="nonsense")


def test_model_level_timeline(analysis_runs: AnalysisRuns) -> None:
    src = BusSource(analysis_runs.settings)
    tl = trace.timeline(src, analysis_runs.online[0], depth="model", queries=3)
    assert set(tl["query_index"]) == {0, 1, 2}
    assert {"query", "step"} <= set(tl["kind"])
    assert (tl["end_ms"] >= tl["start_ms"]).all()
    assert tl["start_ms"].min() == 0
    assert isinstance(trace.system_samples(src, analysis_runs.online[0]), pd.DataFrame)


def test_suite_table(analysis_runs: AnalysisRuns) -> None:
    summ = summary(BusSource(analysis_runs.settings), analysis_runs.all)
    t2 = suite.table2(summ, {"digits_cnn/onnxruntime": 2_000_000})
    assert len(t2) == 1
    row = t2.iloc[0]
    assert row["id"] == 1 and row["model"] == "digits_cnn" and row["size_mb"] == 2.0
    online = summ[summ["scenario"] == "online"]
    valid_online = online[online["valid"]]
    first = (valid_online if len(valid_online) else online).iloc[0]
    assert row["online_p90_ms"] == pytest.approx(first["p90_ms"])
    text = suite.format_table(t2)
    assert "digits_cnn" in text and "OPT BATCH" in text


# ------------------------------------------------------------------ layers (real chDB)


def test_top_layers_and_types(span_db: DirectSource) -> None:
    top = layers.top_layers(span_db, SPAN_EVAL, n=3)
    assert top["layer"].tolist() == ["conv2", "conv1", "fc"]
    conv2 = top.iloc[0]
    assert conv2["calls"] == QUERIES and conv2["mean_ms"] == pytest.approx(0.9)
    assert conv2["op_type"] == "Conv" and conv2["shape"] == "1×16×24×24"
    assert conv2["dominant"] == "implicit_gemm"
    assert conv2["dominant_share"] == pytest.approx(0.8)
    total_us = sum(x[3] for x in LAYERS)
    assert conv2["share"] == pytest.approx(900 / total_us)
    types = layers.layer_types(span_db, SPAN_EVAL)
    assert types["op_type"].tolist() == ["Conv", "Gemm", "Relu"]
    conv = types.iloc[0]
    assert conv["layers"] == 2 and conv["calls"] == 2 * QUERIES
    assert conv["total_ms"] == pytest.approx(QUERIES * 1.3)
    assert math.isclose(types["share"].sum(), 1.0)
    # A layer without kernels is dominated by its own op.
    relu = layers.top_layers(span_db, SPAN_EVAL, n=10).set_index("layer").loc["relu1"]
    assert relu["dominant"] == "Relu"
    assert layers.top_layers(span_db, "ev-none").empty


def test_layer_timeline_depths(span_db: DirectSource) -> None:
    model = trace.timeline(span_db, SPAN_EVAL, depth="model", queries=2)
    layer = trace.timeline(span_db, SPAN_EVAL, depth="layer", queries=2)
    kernel = trace.timeline(span_db, SPAN_EVAL, depth="kernel", queries=2)
    assert set(model["kind"]) == {"query", "step"}
    assert len(layer) == len(model) + 2 * len(LAYERS)
    assert (kernel["kind"] == "kernel").sum() == 2 * sum(len(x[4]) for x in LAYERS)
    conv = layer[layer["name"] == "conv1"].iloc[0]
    assert conv["op_type"] == "Conv" and conv["lane"] == 2
    with pytest.raises(ValueError):
        trace.timeline(span_db, SPAN_EVAL, depth="atoms")


def test_open_source_direct_for_a_server_dsn() -> None:
    # A ClickHouse server DSN selects direct access (nothing listens: the open fails typed).
    with pytest.raises(DatabaseError):
        open_source(Settings(clickhouse_dsn="http://127.0.0.1:1"))
