"""Reported numbers end to end on a real stack (nats-server, server owning chDB, noop
agent): the paged reader at a page boundary, sweeps stored once per batch size, runs
sharing a host one at a time, warm-up flagged, and issue lag that sees a blocked event
loop. Timing is never asserted beyond what the test itself injects."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from typing import Any

import anyio
import numpy as np
import pytest

from analysis.compare import SINGLE_RUN_NOTE, compare_repeats, compare_runs
from analysis.figures import max_throughput, speedup_heatmap
from analysis.report import build
from analysis.report_render import to_markdown
from analysis.source import BusSource
from analysis.summary import summary
from broker.summary import figures
from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import names, remote
from mlscope.contracts import EvaluationSummary, JobRequest, ScenarioSpec
from mlscope.errors import ConfigError
from mlscope.jobs import submit
from mlscope.settings import Settings
from tests.conftest import LOOSE, child_env, python
from tests.loadgen_fixtures import open_loop, prepared_noop

pytestmark = pytest.mark.timeout(300)


def job(spec: ScenarioSpec, **extra: Any) -> JobRequest:
    return JobRequest(model="noop", framework="noop", scenario=spec, trace_level="none", **extra)


def run(settings: Settings, spec: ScenarioSpec, **extra: Any) -> EvaluationSummary:
    return anyio.run(lambda: submit(settings, job(spec, **extra), timeout=180), backend="asyncio")


def sql(settings: Settings, query: str, **params: Any) -> list[list[Any]]:
    async def go() -> list[list[Any]]:
        async with busmod.connect(settings, name="test") as bus:
            return (await remote.sql(bus, query, params))[1]

    return anyio.run(go, backend="asyncio")


def test_a_run_of_exactly_one_page_of_rows_reports(noop_stack: Stack) -> None:
    """The paged reader's last page is empty when the rows fill whole pages."""
    s = run(noop_stack.settings, ScenarioSpec(name="constant", qps=1000, duration_s=2.0, **LOOSE))
    assert s.queries == 2000
    source = BusSource(noop_stack.settings, page_rows=1000)
    summ = summary(source, [s.evaluation_id])
    assert int(summ["queries"].iloc[0]) == 2000
    report = build(source, [s.evaluation_id])
    assert s.evaluation_id in to_markdown(report)


def test_a_sweep_stores_one_run_per_batch_size_and_a_summary_parent(noop_stack: Stack) -> None:
    sizes = (1, 8, 32)
    s = run(
        noop_stack.settings,
        ScenarioSpec(name="batched", batch_sizes=sizes, duration_s=0.7, **LOOSE),
    )
    children = [p["evaluation_id"] for p in s.points]
    assert s.evaluation_id not in children
    stored = sql(
        noop_stack.settings,
        "SELECT evaluation_id, count() FROM queries FINAL "
        "WHERE evaluation_id LIKE {p:String} GROUP BY evaluation_id",
        p=f"{s.evaluation_id}%",
    )
    counts = {e: int(n) for e, n in stored}
    assert s.evaluation_id not in counts  # the parent holds no copied queries
    assert set(counts) == set(children) and all(n > 0 for n in counts.values())
    source = BusSource(noop_stack.settings)
    summ = summary(source, [s.evaluation_id, *children])
    best = max_throughput(summ).iloc[0]
    assert best["batch_sizes"] == list(sizes)  # batch 1 once, from its own run
    assert best["optimal_batch_size"] == s.optimal_batch_size
    by_batch = {p["batch_size"]: p["throughput_ips"] for p in s.points}
    heat = speedup_heatmap(summ)
    for b in sizes:
        assert heat.iloc[0][b] == pytest.approx(by_batch[b] / by_batch[1], rel=1e-6)
    # A report of the parent alone reads the sweep's runs.
    report = to_markdown(build(source, [s.evaluation_id]))
    assert all(c in report for c in children)
    # Its latency section says why it is empty, naming the runs that hold the queries.
    latency = report.split("## Latency", 1)[1].split("\n## ", 1)[0]
    assert "No latency to show" in latency and all(c in latency for c in children), latency


def _window(settings: Settings, evaluation_id: str) -> tuple[int, int]:
    """(first scheduled, last completed) of a run on the server's clock (ns)."""
    ((t0,),) = sql(
        settings,
        "SELECT t0_ns FROM evaluations FINAL WHERE evaluation_id = {e:String}",
        e=evaluation_id,
    )
    ((lo, hi),) = sql(
        settings,
        "SELECT min(scheduled_ns), max(completed_ns) FROM queries "
        "FINAL WHERE evaluation_id = {e:String}",
        e=evaluation_id,
    )
    return int(t0) + int(lo), int(t0) + int(hi)


def _two_at_once(settings: Settings, parallel: bool) -> list[EvaluationSummary]:
    spec = ScenarioSpec(name="online", qps=200, duration_s=1.5, **LOOSE)

    async def go() -> list[EvaluationSummary]:
        out: list[EvaluationSummary] = []

        async def one(seed: int) -> None:
            out.append(
                await submit(
                    settings,
                    job(spec.model_copy(update={"seed": seed}), parallel=parallel),
                    timeout=180,
                )
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, 1)
            tg.start_soon(one, 2)
        return out

    return anyio.run(go, backend="asyncio")


def test_runs_sharing_a_host_do_not_overlap_unless_parallel(noop_stack: Stack) -> None:
    settings = noop_stack.settings
    a, b = sorted(
        _window(settings, s.evaluation_id) for s in _two_at_once(settings, parallel=False)
    )
    assert a[1] < b[0], "serialized runs overlapped"
    together = _two_at_once(settings, parallel=True)
    a, b = sorted(_window(settings, s.evaluation_id) for s in together)
    assert b[0] < a[1], "--parallel runs did not overlap"
    assert all(s.parallel and any("--parallel" in w for w in s.warnings) for s in together)


def test_warmup_queries_are_stored_flagged_and_left_out(noop_stack: Stack) -> None:
    s = run(
        noop_stack.settings,
        ScenarioSpec(name="constant", qps=200, duration_s=1.0, warmup_queries=15, **LOOSE),
    )
    assert s.queries == 200 and s.warmup_queries == 15
    got = np.asarray(
        sql(
            noop_stack.settings,
            "SELECT query_index, warmup, outcome FROM "
            "queries FINAL WHERE evaluation_id = {e:String} ORDER BY "
            "query_index",
            e=s.evaluation_id,
        ),
        dtype=np.int64,
    )
    assert list(np.flatnonzero(got[:, 1])) == list(range(15))
    assert (got[:, 2] == 0).all()  # every one answered: outcome ok
    summ = summary(BusSource(noop_stack.settings), [s.evaluation_id]).iloc[0]
    assert int(summ["queries"]) == 185  # statistics over the measured queries
    assert s.loadgen_cost is not None and s.loadgen_cost["cpu_us_per_query"] > 0
    assert s.loadgen_cost["shared_host"]  # the test stack runs on one host


def test_a_blocked_event_loop_delays_neither_queries_nor_their_answers(
    noop_stack: Stack,
) -> None:
    """The event loop blocked for 250 ms: the pacer thread still writes each query when
    it is due and the link's reader still stamps each answer when it arrives, so
    neither the issue lag nor the latency of the queries due meanwhile shows the block."""
    block_s = 0.25

    async def go() -> Any:
        async with busmod.connect(noop_stack.settings, name="test lag") as bus:
            agent_id = await prepared_noop(bus, "ev-blocked-loop")
            subject = names.agent_query(agent_id)
            driver = open_loop(
                bus, "ev-blocked-loop", subject, qps=200, duration_s=1.5, scenario="constant"
            )
            asyncio.get_running_loop().call_later(0.6, time.sleep, block_s)
            return await driver.run()

    rec = anyio.run(go, backend="asyncio")
    f = figures(rec, has_labels=False)
    assert f.errors == 0 and f.not_issued == 0
    assert f.issue_lag_split_us["loop"]["max"] == 0  # the pacer's thread sends itself
    during = (rec.scheduled >= 0.6e9) & (rec.scheduled < (0.6 + block_s) * 1e9)
    assert during.sum() >= 0.8 * block_s * 200
    # Issued when due, answered as fast as the rest: nothing waited out the block.
    assert ((rec.issued - rec.scheduled)[during] < 0.5 * block_s * 1e9).all()
    latency = rec.completed - rec.scheduled
    assert latency[during].max() < 0.5 * block_s * 1e9


def test_an_identical_rerun_is_not_called_different_with_repeats(noop_stack: Stack) -> None:
    """Three runs of one configuration against three more (interleaved, so machine drift
    hits both sides): over runs, no significant change."""
    spec = ScenarioSpec(name="constant", qps=300, duration_s=1.0, **LOOSE)
    ids: dict[str, list[str]] = {"a": [], "b": []}
    for _ in range(3):
        for side in ids:
            ids[side].append(run(noop_stack.settings, spec).evaluation_id)
    table = compare_repeats(BusSource(noop_stack.settings), ids["a"], ids["b"], confidence=0.99)
    assert list(table["verdict"]) == ["no significant change"] * 2, table
    (note,) = set(table["note"])  # 300 queries each: too few for early stopping's p99
    assert all(f"{e} is INVALID (early stopping: " in note for e in ids["a"] + ids["b"]), note
    assert table["basis"].iloc[0] == "runs: 3 baseline, 3 candidate"
    one = compare_runs(BusSource(noop_stack.settings), ids["a"][0], ids["b"][0])
    assert one["basis"].iloc[0] == SINGLE_RUN_NOTE
    # Different rates are not compared.
    other = run(noop_stack.settings, spec.model_copy(update={"qps": 150.0})).evaluation_id
    with pytest.raises(ConfigError, match="requested qps"):
        compare_runs(BusSource(noop_stack.settings), ids["a"][0], other)


def test_cli_repeat_prints_run_level_statistics(noop_stack: Stack) -> None:
    out = subprocess.run(
        [
            python(),
            "-m",
            "cli.submit",
            "noop",
            "--framework",
            "noop",
            "--scenario",
            "constant",
            "--qps",
            "200",
            "--duration",
            "0.5",
            "--min-duration",
            "0",
            "--min-queries",
            "1",
            "--repeat",
            "2",
            "--json",
        ],
        env=child_env(noop_stack.settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert len(doc["summaries"]) == 2
    kept = [s for s in doc["summaries"] if s["status"] == "completed" and s["valid"]]
    assert doc["run_level_over"] == [s["evaluation_id"] for s in kept]
    p50s = [s["latency_ms"]["p50"] for s in kept]
    if p50s:  # only VALID runs count (a loaded machine may fail a rule)
        assert doc["run_level"]["p50_ms"]["mean"] == pytest.approx(sum(p50s) / len(p50s))
    if len(p50s) == 2:
        assert doc["run_level"]["p50_ms"]["ci_low"] <= doc["run_level"]["p50_ms"]["ci_high"]
