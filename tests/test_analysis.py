"""analysis/: statistics over the evaluation database, on real runs and real chDB."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import pytest

from analysis import compare, difference, figures, layers, regression, rows, suite, trace
from analysis.data import evaluations
from analysis.rows import queries
from analysis.source import BusSource, DirectSource, open_source, table_exists
from analysis.summary import latency_windows, summary
from broker.db import SAMPLE_COLUMNS, SPAN_COLUMNS, Database
from mlscope.errors import DatabaseError
from mlscope.settings import Settings
from mlscope.stats import nearest_rank, percentile, trimmed_mean
from tests.analysis_fixtures import BATCH_SIZES, LAYERS, QUERIES, SPAN_EVAL, AnalysisRuns
from tests.stored_rows import insert_queries, query_columns

# ------------------------------------------------------------------ comparison verdicts


def test_verdict_detects_a_ten_percent_shift() -> None:
    rng = np.random.default_rng(7)
    a = rng.lognormal(mean=np.log(2.0), sigma=0.15, size=800)
    b = rng.lognormal(mean=np.log(2.2), sigma=0.15, size=800)  # 10% slower
    slower = difference.bootstrap_difference(a, b, 50, n_boot=1000)
    assert slower.verdict == "slower"
    assert 0.05 < slower.rel < 0.15
    assert slower.ci_low > 0
    tail = difference.bootstrap_difference(a, b, 99, n_boot=1000, min_effect=0.05)
    assert tail.verdict == "slower"
    faster = difference.bootstrap_difference(b, a, 50, n_boot=1000)
    assert faster.verdict == "faster" and faster.ci_high < 0


def test_identical_distributions_are_judged_equal() -> None:
    rng = np.random.default_rng(11)
    for trial in range(5):
        a = rng.lognormal(mean=np.log(2.0), sigma=0.15, size=2000)
        b = rng.lognormal(mean=np.log(2.0), sigma=0.15, size=2000)
        for q, floor in ((50, 0.02), (99, 0.05)):  # compare_runs' floors
            d = difference.bootstrap_difference(a, b, q, n_boot=1000, seed=trial, min_effect=floor)
            assert d.verdict == "no significant change", (trial, q, d)
            assert abs(d.rel) < floor
    # The same samples in another order: the two bootstrap distributions are the same,
    # so the differences are symmetric about 0 and the interval must contain it.
    a = rng.lognormal(mean=np.log(2.0), sigma=0.15, size=2000)
    for q in (50, 99):
        d = difference.bootstrap_difference(a, rng.permutation(a), q, n_boot=1000)
        assert d.diff == 0 and d.ci_low < 0 < d.ci_high, (q, d)
    # Independent samples of one distribution: a 95% interval misses 0 in about 1 run
    # of 20 by design (so no single run may be required to cover it), but it must cover
    # it in about 19 of 20. An interval too narrow or off-centre fails this.
    trials = 60
    covered = dict.fromkeys((50, 99), 0)
    for trial in range(trials):
        a = rng.lognormal(mean=np.log(2.0), sigma=0.15, size=500)
        b = rng.lognormal(mean=np.log(2.0), sigma=0.15, size=500)
        for q in covered:
            d = difference.bootstrap_difference(a, b, q, n_boot=500, seed=trial)
            covered[q] += d.ci_low <= 0.0 <= d.ci_high
    assert all(c >= 0.87 * trials for c in covered.values()), covered


def test_resampled_percentile_is_the_stats_definition() -> None:
    rng = np.random.default_rng(3)
    x = rng.exponential(size=37)
    idx = rng.integers(0, x.size, size=(20, x.size))
    for q in (1, 50, 90, 99, 100):
        got = difference.resampled_percentile(x, q, idx)
        assert got.tolist() == [percentile(x[i], q) for i in idx]


@pytest.mark.parametrize("q", [50.0, 90.0, 99.0, 100.0])
def test_percentile_draws_follow_the_resampling_bootstrap(q: float) -> None:
    """The drawn percentiles have the distribution of percentiles of real resamples
    (ties, n = 1 and n = 2 included), and the interval of a difference agrees with
    scipy's resampling bootstrap to within Monte Carlo noise."""
    rng = np.random.default_rng(4)
    for x in (
        np.array([3.0]),
        np.array([2.0, 5.0]),
        rng.integers(1, 6, size=40).astype(float),  # heavy ties
        rng.lognormal(size=61),
    ):
        xs = np.sort(x)
        idx = rng.integers(0, x.size, size=(20_000, x.size))
        brute = difference.resampled_percentile(xs, q, idx)
        drawn = difference.bootstrap_percentiles(xs, q, 20_000, rng)
        values = np.unique(xs)
        freq = [(brute == v).mean() - (drawn == v).mean() for v in values]
        assert np.abs(freq).max() < 0.02, (x.size, q)
    from scipy import stats as sps

    a, b = rng.lognormal(0.0, 0.2, 400), rng.lognormal(0.05, 0.2, 300)

    def pick(y: np.ndarray, axis: int) -> np.ndarray:
        k = nearest_rank(y.shape[axis], q)
        return np.asarray(np.take(np.sort(y, axis=axis), k - 1, axis=axis))

    def stat(ya: np.ndarray, yb: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.asarray(pick(yb, axis) - pick(ya, axis))

    ref = sps.bootstrap(
        (a, b),
        stat,
        n_resamples=4000,
        vectorized=True,
        paired=False,
        method="percentile",
        rng=np.random.default_rng(1),
    ).confidence_interval
    got = difference.bootstrap_difference(a, b, q, n_boot=4000, seed=1)
    width = ref.high - ref.low
    assert abs(got.ci_low - ref.low) < 0.2 * width + 1e-12
    assert abs(got.ci_high - ref.high) < 0.2 * width + 1e-12


# ------------------------------------------------------------------ regression flags


@pytest.fixture
def fresh_db(span_db: DirectSource) -> Database:
    """The module's chDB (one embedded path per process), background merges stopped:
    duplicates stay on disk until a reader's FINAL folds them. Tests using it write
    evaluation ids of their own."""
    db: Database = span_db.db
    for table in ("evaluations", "queries", "spans", "system_samples"):
        db.command(f"SYSTEM STOP MERGES {table}")
    return db


def _store_latencies(db: Database, eval_id: str, latency_ms: np.ndarray) -> None:
    scheduled = np.arange(latency_ms.size, dtype=np.int64) * 10_000_000
    completed = scheduled + (latency_ms * 1e6).astype(np.int64)
    insert_queries(db, query_columns(eval_id, scheduled, completed))


def test_regression_flags_exactly_the_slower_version(fresh_db: Database) -> None:
    """Four framework versions, 1.9 -> 1.10 -> 1.11 -> 1.12 (numeric order, not string
    order): 1.10 is 15% slower than 1.9, 1.11 is the same as 1.10 and 1.12 is 15%
    faster. Exactly the 1.9 -> 1.10 step is a regression."""
    rng = np.random.default_rng(5)
    base = 2.0
    medians = {"1.9": base, "1.10": base * 1.15, "1.11": base * 1.15, "1.12": base}
    rows = []
    for i, (version, median) in enumerate(medians.items()):
        eval_id = f"ev-v{i}"
        _store_latencies(fresh_db, eval_id, rng.lognormal(mean=np.log(median), sigma=0.1, size=600))
        rows.append(
            {
                "evaluation_id": eval_id,
                "model": "m",
                "model_version": "1",
                "framework": "fw",
                "framework_version": version,
                "system": "cpu",
                "scenario": "online",
                "batch_size": 1,
                "valid": True,
            }
        )
    # A run on another system with no slowdown at all: never compared with the others.
    _store_latencies(fresh_db, "ev-other", rng.lognormal(np.log(base), 0.1, 600))
    rows.append({**rows[0], "evaluation_id": "ev-other", "system": "gpu"})
    flags = regression.regressions(DirectSource(fresh_db), pd.DataFrame(rows), n_boot=400)
    steps = list(zip(flags["from_version"], flags["to_version"], strict=True))
    assert steps == [("1.9", "1.10"), ("1.10", "1.11"), ("1.11", "1.12")]
    assert flags["regression"].tolist() == [True, False, False]
    assert flags["verdict"].tolist() == ["slower", "no significant change", "faster"]
    slower = flags.iloc[0]
    assert slower["rel"] == pytest.approx(0.15, abs=0.03)
    assert 0 < slower["ci_low"] <= slower["median_b_ms"] - slower["median_a_ms"]
    same = flags.iloc[1]
    assert same["ci_low"] <= 0 <= same["ci_high"]


def test_readers_show_a_redelivered_batch_once(fresh_db: Database) -> None:
    """Every analysis reader reads with FINAL: rows stored twice (an ingester that
    crashed between insert and ack) count once."""
    eval_id, n = "ev-twice", 5
    _store_latencies(fresh_db, eval_id, np.full(n, 1.0))
    _store_latencies(fresh_db, eval_id, np.full(n, 1.0))
    evaluation = dict.fromkeys(
        (
            "evaluation_id",
            "job_id",
            "rerun_of",
            "model",
            "model_version",
            "framework",
            "framework_version",
            "agent_id",
            "host",
            "device",
            "scenario",
            "trace_level",
            "status",
        ),
        "",
    )
    evaluation.update(evaluation_id=eval_id, agent_id="a1", device="cpu", spec="{}", summary="{}")
    names = [*evaluation, "valid", "t0_ns", "clock_offset_ns"]
    values = [[v] for v in evaluation.values()] + [[1], [0], [0]]
    for _ in range(2):
        fresh_db.insert("evaluations", values, names)
    spans: dict[str, list[Any]] = {
        "evaluation_id": [eval_id] * n,
        "agent_id": ["a1"] * n,
        "span_id": list(range(1, n + 1)),
        "parent_id": [0] * n,
        "query_index": list(range(n)),
        "level": [1] * n,
        "kind": ["query"] * n,
        "name": ["query"] * n,
        "start_ns": list(range(n)),
        "end_ns": list(range(1, n + 1)),
        "host": ["h"] * n,
        "attrs": [""] * n,
        "batch_id": ["sb-1"] * n,
    }
    samples: dict[str, list[Any]] = {
        "evaluation_id": [eval_id] * n,
        "agent_id": ["a1"] * n,
        "host": ["h"] * n,
        "ts_ns": list(range(n)),
        "metric": ["cpu.util"] * n,
        "device": [""] * n,
        "value": [50.0] * n,
        "batch_id": ["sm-1"] * n,
    }
    for _ in range(2):
        fresh_db.insert("spans", [spans[c] for c in SPAN_COLUMNS], SPAN_COLUMNS)
        fresh_db.insert("system_samples", [samples[c] for c in SAMPLE_COLUMNS], SAMPLE_COLUMNS)
    for table in ("evaluations", "queries", "spans", "system_samples"):  # really twice
        raw = fresh_db.rows(
            f"SELECT count() FROM {table} WHERE evaluation_id = {{e:String}}", {"e": eval_id}
        )[0][0]
        assert raw == (2 if table == "evaluations" else 2 * n), table
    src = DirectSource(fresh_db)
    assert len(evaluations(src, [eval_id])) == 1
    assert len(queries(src, [eval_id])) == n
    assert len(rows.spans(src, eval_id)) == n
    assert len(trace.timeline(src, eval_id, depth="model", queries=n)) == n
    got = trace.system_samples(src, eval_id)
    assert len(got) == n and got["ts_ns"].tolist() == list(range(n))
    assert rows.latencies_ms(src, ["ev-no-such-run"]) == {}  # no rows: nothing, no error


# ------------------------------------------------------------------ on real runs


def test_bus_and_direct_sources_agree(analysis_runs: AnalysisRuns) -> None:
    bus = open_source(analysis_runs.settings)
    assert isinstance(bus, BusSource)
    small = BusSource(analysis_runs.settings, page_rows=7)  # many pages
    ids = list(analysis_runs.online)
    q1, q2 = queries(bus, ids), queries(small, ids)
    assert len(q1) == len(q2) > 100
    pd.testing.assert_frame_equal(
        q1.reset_index(drop=True), q2.reset_index(drop=True), check_dtype=False
    )
    assert table_exists(bus, "queries") and not table_exists(bus, "no_such_table")
    # The statement runs once and its pages come from that one result: any order.
    unordered = "SELECT * FROM queries FINAL WHERE evaluation_id IN {ids:Array(String)}"
    paged = small.frame(unordered, {"ids": ids})
    key = ["evaluation_id", "query_index"]
    assert len(paged) == len(q1) and not paged.duplicated(key).any()
    with pytest.raises(DatabaseError):
        evaluations(bus, ["ev-does-not-exist"])
    held = BusSource(analysis_runs.settings)
    with held:  # one connection for every read of the block
        q3 = queries(held, ids)
        with pytest.raises(DatabaseError):  # a typed error, and the connection stays
            evaluations(held, ["ev-does-not-exist"])
        e3 = evaluations(held, ids)
    pd.testing.assert_frame_equal(q1, q3)
    pd.testing.assert_frame_equal(e3, evaluations(held, ids))  # per read again after it


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
    newest = summ.sort_values("created_at", ascending=False)  # the newest run counts
    newest_online = newest[newest["scenario"] == "online"]
    assert acc["online_latency_ms"].iloc[0] == pytest.approx(
        newest_online["trimmed_mean_ms"].iloc[0]
    )
    system = summ["system"].iloc[0]
    cost = figures.across_systems(summ, "digits_cnn", {system: 3.6})
    assert cost["cost_per_million"].iloc[0] == pytest.approx(
        3.6 / (best["max_throughput_ips"].iloc[0] * 3600) * 1e6
    )


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
    # 1 s runs, below the 10 s minimum: each comparison says so, with its rule.
    (note,) = set(table["note"])
    for e in (a, b):
        assert f"{e} is INVALID (" in note and "may not measure" in note, note
    assert set(table["verdict"]) <= {"faster", "slower", "no significant change"}
    assert (table["ci_low"] <= table["ci_high"]).all()
    summ = summary(src, analysis_runs.all)
    # Pretend the second online run used a newer framework: one step to judge.
    fake = summ.copy()
    fake.loc[fake["evaluation_id"] == b, "framework_version"] = "99.0"
    flags = regression.regressions(src, fake, n_boot=300)
    assert len(flags) == 1
    assert flags["from_version"].iloc[0] != "99.0" and flags["to_version"].iloc[0] == "99.0"
    assert flags["regression"].iloc[0] == (flags["verdict"].iloc[0] == "slower")
    with pytest.raises(ValueError):
        regression.regressions(src, summ, axis="nonsense")


def test_validity_notes_name_each_invalid_run_with_its_first_rule() -> None:
    runs = pd.DataFrame(
        {
            "evaluation_id": ["ev-a", "ev-b", "ev-c", "ev-d"],
            "valid": [True, False, None, False],
            "invalid_reasons": ["", "overloaded: completed 1/s of 50/s; 9 lost", None, ""],
        }
    )
    assert compare.validity_notes(runs) == [
        "ev-b is INVALID (overloaded: completed 1/s of 50/s; …): its latencies may not "
        "measure the system at the load asked",
        "ev-d is INVALID: its latencies may not measure the system at the load asked",
    ]
    assert compare.validity_notes(runs.drop(columns="valid")) == []
    twice = pd.concat([runs.iloc[[1]], runs.iloc[[1]]])  # a run compared with itself
    assert compare.validity_notes(twice) == compare.validity_notes(runs.iloc[[1]])


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
    online = summ[summ["scenario"] == "online"].sort_values("created_at", ascending=False)
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
