"""The report's figures and tables on stored rows: which runs a figure counts, how runs
measured differently are told apart, what a table prints, what a curve shows.

Rows are written straight into a real chDB of this module's own (chDB opens one data
directory per process at a time) and read through :class:`analysis.source.DirectSource`,
as ``analysis`` reads a server's database.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd
import pytest

from analysis import compare, figures, layers, plots, regression, report, report_render, suite
from analysis.source import DirectSource
from analysis.summary import SUMMARY_COLUMNS, latency_windows, summary
from broker.db import SPAN_COLUMNS, Database
from mlscope.stats import nearest_rank
from tests.stored_rows import evaluation_row, insert_evaluation, insert_queries, query_columns

pytestmark = pytest.mark.timeout(120)

T0 = 1_700_000_000_000  # ms: every stored run is created some seconds after this


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DirectSource]:
    db = Database(f"chdb:///{tmp_path_factory.mktemp('report-figures') / 'chdb'}")
    db.migrate()
    try:
        yield DirectSource(db)
    finally:
        db.close()


def store(
    src: DirectSource,
    ev: str,
    *,
    age_s: int,
    scenario: str = "online",
    batch: int = 1,
    model: str = "m",
    framework_version: str = "1",
    top1: float | None = None,
    placement: str | None = None,
    preprocess: str | None = None,
    tput: float | None = None,
    queries: int | None = None,
    warmup_queries: int | None = None,
    latency_ms: np.ndarray | None = None,
    warmup: int = 0,
    correct: int = 0,
    gap_ms: float = 10.0,
    status: str = "completed",
    valid: int = 1,
) -> None:
    """An evaluation row (created ``age_s`` seconds before T0 + 1000 s) and, with
    ``latency_ms``, its query rows (the first ``warmup`` of them warm-up, one every
    ``gap_ms``, each answering ``correct`` samples right)."""
    summ: dict[str, Any] = {
        "scenario": {"name": scenario, "batch_size": batch},
        "accuracy": {"top1": top1},
        "throughput_ips": tput,
        "requested_qps": 100.0 if scenario == "online" else None,
    }
    extra = {
        "placement": placement,
        "preprocess": preprocess,
        "queries": queries,
        "warmup_queries": warmup_queries,
    }
    summ.update({k: v for k, v in extra.items() if v is not None})
    created = datetime.fromtimestamp((T0 + (1000 - age_s) * 1000) / 1000, UTC)
    row = evaluation_row(
        ev,
        created_at=created.replace(tzinfo=None),
        model=model,
        framework_version=framework_version,
        scenario=scenario,
        trace_level="framework",
        status=status,
        valid=valid,
        spec=json.dumps({"agent": {"cpu_model": "cpu-a", "cpu_cores": 2}}),
        summary=json.dumps(summ),
    )
    insert_evaluation(src.db, row)
    if latency_ms is None:
        return
    n = latency_ms.size
    scheduled = (np.arange(n) * gap_ms * 1e6).astype(np.int64)
    completed = scheduled + (latency_ms * 1e6).astype(np.int64)
    cols = query_columns(
        ev,
        scheduled,
        completed,
        batch_size=[batch] * n,
        label=[correct] * n,
        warmup=[int(i < warmup) for i in range(n)],
    )
    insert_queries(src.db, cols)


def ms(n: int, value: float = 2.0) -> np.ndarray:
    return np.full(n, value)


def section(rep: report_render.Report, title: str) -> report_render.Section:
    return next(s for s in rep.sections if s.title.startswith(title))


# ------------------------------------------------------------------ 1. top-1 of no labels


def test_a_run_without_labels_has_no_top1_beside_a_labelled_one(src: DirectSource) -> None:
    """A latency-only model (stored top-1 null) read in one frame with a labelled run:
    its top-1 is missing, not 0.0, in the summary, the report and Table 2."""
    store(src, "ev-t1-labels", age_s=20, model="digits", top1=0.75, latency_ms=ms(8), correct=1)
    store(src, "ev-t1-noop", age_s=10, model="noop", latency_ms=ms(8))
    summ = summary(src, ["ev-t1-noop", "ev-t1-labels"]).set_index("evaluation_id")
    assert summ.loc["ev-t1-labels", "top1"] == 1.0  # every sample right in its rows
    assert pd.isna(summ.loc["ev-t1-noop", "top1"])
    rep = report.build(src, ["ev-t1-noop", "ev-t1-labels"])
    acc = section(rep, "Accuracy").tables[0][1]
    assert list(acc["model"]) == ["digits"]
    table = suite.table2(summary(src, ["ev-t1-noop", "ev-t1-labels"])).set_index("model")
    assert pd.isna(table.loc["noop", "top1"]) and table.loc["digits", "top1"] == 1.0


# ------------------------------------------------------------------ 2. throughput tables


def test_throughput_tables_count_the_newest_run_and_keep_placements_apart(
    src: DirectSource,
) -> None:
    """Batch 1 measured twice (the older run named first on the command line), and a
    batch-4 run placed on the agent: the newest batch-1 run counts, and the agent-placed
    run is a row (and a series) of its own, labelled."""
    store(src, "ev-tp-old1", age_s=300, model="tp", scenario="batched", tput=500.0)
    store(src, "ev-tp-new1", age_s=200, model="tp", scenario="batched", tput=100.0)
    store(src, "ev-tp-srv4", age_s=150, model="tp", scenario="batched", batch=4, tput=300.0)
    store(
        src,
        "ev-tp-agt4",
        age_s=100,
        model="tp",
        scenario="batched",
        batch=4,
        tput=900.0,
        placement="agent",
    )
    server_only = figures.max_throughput(summary(src, ["ev-tp-old1", "ev-tp-new1", "ev-tp-srv4"]))
    assert server_only["max_throughput_ips"].tolist() == [300.0]  # newest batch 1: 100/s
    ids = ["ev-tp-old1", "ev-tp-new1", "ev-tp-srv4", "ev-tp-agt4"]
    rep = report.build(src, ids)
    tables = dict(section(rep, "Throughput").tables)
    best = tables["Maximum throughput and optimal batch size"].set_index("placement")
    assert best.loc["server", "max_throughput_ips"] == 300.0  # not the old 500/s run
    assert best.loc["server", "optimal_batch_size"] == 4
    assert best.loc["agent", "max_throughput_ips"] == 900.0
    assert best.loc["agent", "batch_sizes"] == [4]
    heat = tables["Speed-up over the smallest batch size"].set_index("model/framework@system")
    server = next(r for r in heat.index if "placement" not in r)
    assert heat.loc[server, 4] == pytest.approx(3.0)  # 300 / 100, the newest batch 1
    assert any(r.endswith("[placement agent]") for r in heat.index)
    labels = [m.label for m in plots.throughput_by_batch(summary(src, ids)).panels[0].marks]
    assert sum("[placement agent]" in label for label in labels) == 1


def test_suite_and_regressions_keep_placements_apart(src: DirectSource) -> None:
    """Table 2 reads both a server-placed and an agent-placed online run and says where
    each row's online figures were measured; a regression step never crosses
    placements."""
    rng = np.random.default_rng(3)
    store(src, "ev-rg-srv", age_s=60, model="rg", latency_ms=rng.lognormal(0.7, 0.1, 300))
    store(
        src,
        "ev-rg-agt",
        age_s=50,
        model="rg",
        framework_version="2",
        placement="agent",
        latency_ms=rng.lognormal(1.4, 0.1, 300),
    )
    shown = suite.shown_evaluations(src, [("rg", "onnxruntime")])
    assert set(shown) == {"ev-rg-srv", "ev-rg-agt"}
    table = suite.table2(summary(src, shown))
    assert sorted(table["online_placement"]) == ["agent", "server"]  # two versions: two rows
    assert " (agent)" in suite.format_table(table)
    steps = regression.regressions(src, summary(src, shown), n_boot=200)
    assert steps.empty  # version 1 on the server, 2 on the agent: no step to judge


def test_suite_never_shows_a_cancelled_run_in_place_of_a_measured_one(src: DirectSource) -> None:
    """An INVALID online run, then a newer one of the same model cancelled early: Table 2
    shows the measured run's figures, not the cancelled run's none."""
    store(src, "ev-cx-done", age_s=40, model="cx", valid=0, latency_ms=ms(30, 3.0))
    store(src, "ev-cx-stop", age_s=30, model="cx", valid=0, status="cancelled", latency_ms=ms(5))
    shown = suite.shown_evaluations(src, [("cx", "onnxruntime")])
    assert shown == ["ev-cx-done"]
    table = suite.table2(summary(src, shown))
    assert len(table) == 1 and table["online_trimmed_mean_ms"].iloc[0] == pytest.approx(3.0)


# ------------------------------------------------------------------ 3. comparable runs


def test_the_report_flags_runs_that_differ_in_placement_or_preprocessing(
    src: DirectSource,
) -> None:
    store(src, "ev-cp-a", age_s=40, model="cp", latency_ms=ms(50))
    store(src, "ev-cp-b", age_s=30, model="cp", placement="agent", latency_ms=ms(50, 2.1))
    store(src, "ev-cp-c", age_s=20, model="cp", preprocess="ahead", latency_ms=ms(50, 2.2))
    rep = report.build(src, ["ev-cp-a", "ev-cp-b", "ev-cp-c"])
    notes = section(rep, "Comparison").notes
    assert any(
        n.startswith("ev-cp-b vs ev-cp-a: NOT COMPARABLE") and "placement" in n for n in notes
    )
    assert any(
        n.startswith("ev-cp-c vs ev-cp-a: NOT COMPARABLE") and "preprocess" in n for n in notes
    )
    table = section(rep, "Comparison").tables[0][1]
    assert not table["comparable"].any()
    assert set(compare.COMPARED_FIELDS) <= set(SUMMARY_COLUMNS)  # one definition, both frames


# ------------------------------------------------------------------ 4. layers of warm-up


def _layer_spans(src: DirectSource, ev: str, queries: int) -> None:
    """Per query: a predict step of 1 ms holding one conv layer of 0.5 ms."""
    cols: dict[str, list[Any]] = {c: [] for c in SPAN_COLUMNS}
    sid = 0
    for q in range(queries):
        t = 1_000_000_000 + q * 10_000_000
        for kind, name, start, end, parent in (
            ("step", "predict", t, t + 1_000_000, 0),
            ("layer", "conv", t, t + 500_000, sid + 1),
        ):
            sid += 1
            for c, v in (
                ("evaluation_id", ev),
                ("agent_id", "a"),
                ("span_id", sid),
                ("parent_id", parent),
                ("query_index", q),
                ("level", 2),
                ("kind", kind),
                ("name", name),
                ("start_ns", start),
                ("end_ns", end),
                ("attrs", json.dumps({"op_type": "Conv"})),
                ("host", "h"),
                ("batch_id", "b"),
            ):
                cols[c].append(v)
    src.db.insert("spans", [cols[c] for c in SPAN_COLUMNS], SPAN_COLUMNS)


def test_layer_tables_leave_out_warm_up_queries(src: DirectSource) -> None:
    store(src, "ev-ly", age_s=5, model="ly", latency_ms=ms(5), warmup=2)
    _layer_spans(src, "ev-ly", 5)
    top = layers.top_layers(src, "ev-ly", 5)
    assert top["calls"].tolist() == [3]  # queries 2, 3, 4: the measured ones
    assert top["total_ms"].tolist() == [pytest.approx(1.5)]
    assert top["predict_share"].tolist() == [pytest.approx(0.5)]
    types = layers.layer_types(src, "ev-ly")
    assert types["calls"].tolist() == [3]


# ------------------------------------------------------------------ 5. percentile curve


@pytest.mark.parametrize("n", [1, 2, 7, 10, 37, 100, 101, 999, 1000])
def test_the_percentile_curve_reads_nearest_rank_at_its_ticks(n: int) -> None:
    """The level of the step that reaches each tick (p50, p90, p99) is the sample that
    every table shows there (mlscope.stats' nearest rank)."""
    samples = np.arange(1.0, n + 1.0)  # sample i (0-based) is i + 1
    chart = plots.latency_percentiles({"e": samples[::-1]})
    mark = chart.panels[0].marks[0]
    x, y = np.asarray(mark.x), np.asarray(mark.y)
    for q, tick in ((50.0, 2.0), (90.0, 10.0), (99.0, 100.0)):
        if tick > 2 * n:
            continue
        reaching = int(np.flatnonzero(x < tick)[-1])  # the step drawn up to the tick
        assert y[reaching] == samples[nearest_rank(n, q) - 1], (n, q)
    assert x[-1] >= 2 * n - 1e-9 and y[-1] == samples[-1]  # the largest sample is drawn


# ------------------------------------------------------------------ 6. numbers in tables


def test_markdown_and_html_print_counts_whole_and_rates_readably() -> None:
    table = pd.DataFrame(
        {
            "queries": [123456.0, float("nan")],
            "throughput_ips": [12345.678, 98.7654],
            "p50_ms": [1.23456, 0.0001234],
            "batch_sizes": [[1, 4], [16]],
        }
    )
    md = report_render.markdown_table(table)
    assert "| 123456 | 12346 | 1.235 | 1, 4 |" in md, md
    assert "| – | 98.77 | 0.0001234 | 16 |" in md, md
    html = report_render.to_html(
        report_render.Report("t", [report_render.Section("s", tables=[("c", table)])])
    )
    assert "<td>123456</td><td>12346</td>" in html
    assert "e+" not in md and "e+" not in html


# ------------------------------------------------------------------ 7. windows' tail


def test_windows_keep_the_completions_of_the_tail(src: DirectSource) -> None:
    """Queries scheduled in the first 0.2 s that complete up to 0.6 s later: every
    completion is in a window, those after the last scheduled one included."""
    lat = np.linspace(10.0, 600.0, 20)
    store(src, "ev-win", age_s=3, model="win", latency_ms=lat, gap_ms=10.0)
    w = latency_windows(src, "ev-win", window_s=0.1)
    assert round(float((w["completed_per_s"] * 0.1).sum())) == 20
    assert int(w["queries"].sum()) == 20
    tail = w[w["queries"] == 0]
    assert len(tail) > 0 and tail["p50_ms"].isna().all()
    assert w["start_s"].max() >= 0.7


# ------------------------------------------------------------------ 8. which queries


def test_queries_are_the_measured_ones_and_warm_up_is_counted_apart(src: DirectSource) -> None:
    store(
        src,
        "ev-q-rows",
        age_s=2,
        model="q",
        queries=10,
        warmup_queries=3,
        latency_ms=ms(10),
        warmup=3,
    )
    store(src, "ev-q-lost", age_s=1, model="q", queries=10, warmup_queries=3)  # rows lost
    summ = summary(src, ["ev-q-rows", "ev-q-lost"]).set_index("evaluation_id")
    assert summ.loc["ev-q-rows", ["queries", "warmup_queries"]].tolist() == [7, 3]
    assert summ.loc["ev-q-lost", ["queries", "warmup_queries"]].tolist() == [7, 3]
    rep = report.build(src, ["ev-q-rows"])
    summary_section = section(rep, "Summary")
    assert "warmup_queries" in summary_section.tables[0][1].columns
    assert any(n.startswith("queries: the measured queries") for n in summary_section.notes)


# ------------------------------------------------------------------ 9. prices


def test_a_price_that_costs_nothing_is_said(src: DirectSource) -> None:
    """A cost per million inferences comes from a system's batched runs: a price for a
    system no batched run is on, or prices for runs none of which is batched, are said
    (``mlscope report`` prints them on stderr) rather than left as empty columns."""
    store(src, "ev-pr-batched", age_s=4, model="pr", scenario="batched", batch=4, tput=400.0)
    store(src, "ev-pr-online", age_s=3, model="pr", latency_ms=ms(10))
    system = str(summary(src, ["ev-pr-batched"])["system"].iloc[0])
    both = ["ev-pr-batched", "ev-pr-online"]

    rep = report.build(src, both, prices_per_hour={system: 0.5, "NoSuchSystem": 0.1})
    assert rep.warnings == [
        f"no cost for 'NoSuchSystem': prices apply to batched runs, and these are on "
        f"{system!r} only"
    ]
    costs = dict(section(rep, "Throughput").tables)["pr across systems"]
    assert costs["cost_per_million"].tolist() == [pytest.approx(0.5 / (400.0 * 3600) * 1e6)]

    assert report.build(src, both, prices_per_hour={system: 0.5}).warnings == []
    assert report.build(src, both).warnings == []
    online_only = report.build(src, ["ev-pr-online"], prices_per_hour={system: 0.5})
    assert online_only.warnings == [
        "prices ignored: a cost per million inferences comes from batched (throughput) "
        "runs, and none of these runs is batched"
    ]
