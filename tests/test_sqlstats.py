"""The statistics the database computes equal mlscope's own definitions and the pandas
computations analysis did on raw rows, on the same stored data (a real chDB)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd
import pytest

from analysis import sqlstats, suite
from analysis.data import evaluations
from analysis.rows import queries
from analysis.source import DirectSource
from analysis.summary import latency_windows, sample_stats, summary
from broker.db import Database
from mlscope.outcomes import Outcome, classify
from mlscope.stats import percentiles, trimmed_mean
from tests import analysis_reference as reference
from tests.stored_rows import evaluation_row, insert_evaluation, insert_queries, query_columns

QS = (0.5, 1.0, 50.0, 90.0, 99.0, 99.9, 100.0)


def _groups(rng: np.random.Generator) -> list[np.ndarray]:
    """n = 1, 2, 3 and sizes where ceil(q/100 n) is an exact integer, ties (few
    distinct values), wide and narrow spreads."""
    out = [np.array([7], np.int64), np.array([9, 3], np.int64), np.array([5, 5, 1], np.int64)]
    for n in (4, 10, 20, 100, 101, 200, 999, 1000, 1001):
        out.append(rng.integers(1, 5, size=n))  # heavy ties
        out.append(rng.integers(1, 10**10, size=n))  # ns latencies up to 10 s
    out.append(np.full(50, 123_456_789, np.int64))
    return out


def test_sql_percentiles_and_trimmed_mean_are_the_stats_definitions(
    span_db: DirectSource,
) -> None:
    rng = np.random.default_rng(20)
    groups = _groups(rng)
    gid = np.concatenate([np.full(g.size, i, np.int64) for i, g in enumerate(groups)])
    values = np.concatenate(groups)
    per_q = ", ".join(f"{sqlstats.percentile('lat', q)} AS p{i}" for i, q in enumerate(QS))
    got = span_db.frame(
        f"SELECT g, length(lat) AS n, {sqlstats.trimmed_mean('lat')} AS tm, {per_q} "
        f"FROM (SELECT g, {sqlstats.sorted_ms('x')} AS lat FROM (SELECT "
        "tupleElement(t, 1) AS g, tupleElement(t, 2) AS x FROM (SELECT "
        "arrayJoin(arrayZip({g:Array(Int64)}, {x:Array(Int64)})) AS t)) GROUP BY g) "
        "ORDER BY g",
        {"g": gid.tolist(), "x": values.tolist()},
    )
    assert got["g"].tolist() == list(range(len(groups)))
    for row, g in zip(got.to_dict("records"), groups, strict=True):
        ms = g / 1e6
        assert row["n"] == g.size
        want = percentiles(ms, QS)
        assert [row[f"p{i}"] for i in range(len(QS))] == want, g.size  # exact: a sample
        assert row["tm"] == pytest.approx(trimmed_mean(ms), rel=1e-12, abs=0)


def test_sql_percentile_of_no_samples_is_null(span_db: DirectSource) -> None:
    got = span_db.frame(
        f"SELECT {sqlstats.percentile('lat', 50)} AS p, {sqlstats.trimmed_mean('lat')} AS tm "
        "FROM (SELECT CAST([], 'Array(Float64)') AS lat)"
    )
    assert got["p"].isna().all() and got["tm"].isna().all()
    with pytest.raises(ValueError):
        sqlstats.percentile("lat", 0)


def _store(db: Database, eval_id: str, rng: np.random.Generator, n: int) -> None:
    """Queries with every outcome, warm-up rows, rows stored before outcomes (255),
    tied latencies and several batch sizes."""
    scheduled = np.sort(rng.integers(0, 3_000_000_000, size=n))
    latency = rng.choice([2_000_000, 3_000_000, *rng.integers(1, 80_000_000, size=40)], size=n)
    issued = scheduled + rng.integers(0, 50_000, size=n)
    completed = scheduled + latency
    outcome = rng.choice([0, 0, 0, 0, 1, 2, 3, 4, 255], size=n).astype(np.int64)
    ok = (outcome == 0) | ((outcome == 255) & (rng.random(n) < 0.8))
    issued[outcome == 4] = 0
    completed[(outcome == 4) | (outcome == 3)] = 0
    cols = query_columns(
        eval_id,
        scheduled,
        completed,
        batch_size=rng.choice([1, 4, 8], size=n),
        issued_ns=issued,
        agent_received_ns=issued,
        predict_start_ns=issued,
        paced_ns=issued,
        ok=ok.astype(int),
        label=rng.integers(0, 4, size=n),
        outcome=outcome,
        warmup=(np.arange(n) < 15).astype(int),
    )
    insert_queries(db, cols)


@pytest.fixture(scope="module")
def stored(span_db: DirectSource) -> dict[str, int]:
    rng = np.random.default_rng(7)
    sizes = {"ev-sql-1": 1, "ev-sql-2": 17, "ev-sql-3": 2500, "ev-sql-4": 401}
    for eval_id, n in sizes.items():
        _store(span_db.db, eval_id, rng, n)
    return sizes


def test_sql_outcome_is_the_classify_definition(span_db: DirectSource, stored: Any) -> None:
    got = span_db.frame(
        f"SELECT issued_ns, completed_ns, ok, outcome, {sqlstats.OUTCOME} AS o "
        "FROM queries WHERE evaluation_id = 'ev-sql-3'"
    )
    want = classify(issued=got["issued_ns"], completed=got["completed_ns"], ok=got["ok"])
    legacy = got["outcome"].to_numpy() == 255
    assert legacy.any() and (want[legacy] == Outcome.FAILED).any()
    assert got["o"].to_numpy()[legacy].tolist() == want[legacy].tolist()
    assert got["o"].to_numpy()[~legacy].tolist() == got["outcome"].to_numpy()[~legacy].tolist()


def test_summary_in_sql_equals_the_pandas_computation(
    span_db: DirectSource, stored: dict[str, int]
) -> None:
    ids = list(stored)
    got = sample_stats(span_db, ids)
    raw = queries(span_db, ids)
    for eval_id in ids:
        want = reference.summarize_samples(raw[raw["evaluation_id"] == eval_id])
        mine = got[eval_id]
        tm, want_tm = mine.pop("trimmed_mean_ms"), want.pop("trimmed_mean_ms")
        assert mine == want, eval_id  # percentiles, counts and throughput: exactly
        assert tm == (None if want_tm is None else pytest.approx(want_tm, rel=1e-12))
    assert got["ev-sql-1"]["queries"] == 0 and got["ev-sql-1"]["p50_ms"] is None  # warm-up


@pytest.mark.parametrize("window_s", [0.25, 1.0, 0.1])
def test_latency_windows_in_sql_equal_the_pandas_computation(
    span_db: DirectSource, stored: dict[str, int], window_s: float
) -> None:
    raw = queries(span_db, ["ev-sql-3"])
    want = reference.latency_windows(raw, window_s)
    got = latency_windows(span_db, "ev-sql-3", window_s=window_s)
    assert len(got) >= 3 and got.attrs["window_s"] == window_s
    pd.testing.assert_frame_equal(
        got.drop(columns="trimmed_mean_ms"),
        want.drop(columns="trimmed_mean_ms"),
        check_dtype=False,
    )
    assert got["trimmed_mean_ms"].tolist() == pytest.approx(
        want["trimmed_mean_ms"].tolist(), nan_ok=True
    )


def _store_evaluation(db: Database, eval_id: str, at_ms: int, **fields: Any) -> None:
    summary = {
        "scenario": {"name": fields["scenario"], "batch_size": fields["batch"]},
        "throughput_ips": fields.get("tput"),
        "accuracy": {"top1": fields.get("top1")},
        "queries": 10,
    }
    spec = {"agent": {"cpu_model": fields.get("cpu", "cpu-a"), "cpu_cores": 2}}
    row = evaluation_row(
        eval_id,
        created_at=datetime.fromtimestamp(at_ms / 1000, UTC).replace(tzinfo=None),
        model=fields["model"],
        framework=fields["framework"],
        scenario=fields["scenario"],
        trace_level="model",
        valid=int(fields.get("valid", True)),
        spec=json.dumps(spec),
        summary=json.dumps(summary),
    )
    insert_evaluation(db, row)


def test_the_suite_reads_only_the_runs_table_2_shows(span_db: DirectSource) -> None:
    """Table 2 of the evaluations the database picks equals Table 2 of every stored
    evaluation, while older runs and other models are never read."""
    rng = np.random.default_rng(5)
    at = 1_700_000_000_000
    n = 0
    for model, fw in [("m1", "onnxruntime"), ("m1", "pytorch"), ("m2", "onnxruntime"), ("x", "tf")]:
        for _ in range(6):  # older and newer runs of every key, some invalid, some tied
            for scenario, batch in [("online", 1), ("batched", 1), ("batched", 4)]:
                n += 1
                _store_evaluation(
                    span_db.db,
                    f"ev-suite-{n:03d}",
                    at + int(rng.integers(0, 40)) * 1000,
                    model=model,
                    framework=fw,
                    scenario=scenario,
                    batch=batch,
                    valid=rng.random() < 0.6,
                    tput=None if rng.random() < 0.2 else float(rng.integers(100, 900)),
                    top1=None if rng.random() < 0.5 else float(rng.random()),
                    cpu=str(rng.choice(["cpu-a", "cpu-b"])),
                )
    pairs = [("m1", "onnxruntime"), ("m1", "pytorch"), ("m2", "onnxruntime")]
    every = evaluations(span_db)
    every = every[every["evaluation_id"].str.startswith("ev-suite-")]
    every = every[
        [(m, f) in pairs for m, f in zip(every["model"], every["framework"], strict=True)]
    ]
    shown = suite.shown_evaluations(span_db, pairs)
    assert 0 < len(shown) < len(every)
    want = suite.table2(summary(span_db, list(every["evaluation_id"])))
    got = suite.table2(summary(span_db, shown))
    assert len(want) >= 3
    pd.testing.assert_frame_equal(got, want)
