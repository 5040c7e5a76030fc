"""Real runs through a real stack checked against what they stored, read back with SQL:
the top-N layer table (paper Table 3) from ONNX Runtime's framework-level trace of
efficientnet_lite0, and the per-query labels of a run following the one sample order
(:mod:`mlscope.samples`)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

from analysis.layers import top_layers
from analysis.source import open_source
from mlscope import bus as busmod
from mlscope import remote
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.contracts import EvaluationSummary, JobRequest, ScenarioSpec
from mlscope.jobs import submit
from mlscope.loadgens import list_loadgens
from mlscope.samples import sample_indices
from mlscope.settings import Settings
from tests.conftest import child_env, python

pytestmark = pytest.mark.timeout(300)


def run_job(settings: Settings, model: str, level: str, spec: ScenarioSpec) -> EvaluationSummary:
    job = JobRequest(model=model, framework="onnxruntime", trace_level=level, scenario=spec)
    summary = anyio.run(lambda: submit(settings, job, timeout=180), backend="asyncio")
    assert summary.status == "completed" and summary.errors == 0, summary
    return summary


def sql(settings: Settings, query: str, **params: Any) -> list[list[Any]]:
    async def go() -> list[list[Any]]:
        async with busmod.connect(settings, name="test") as bus:
            return (await remote.sql(bus, query, params))[1]

    return anyio.run(go, backend="asyncio")


def settled_layer_rows(settings: Settings, eval_id: str, queries: int) -> list[list[Any]]:
    """Per layer: name, count, mean and total ns, once the trace is in and stays so.

    ONNX Runtime's spans arrive when the evaluation is released (its profiler hands
    events over only at the end), so wait until every predict span is there and the
    layer rows stop changing."""
    q = (
        "SELECT name, count(), avg(end_ns - start_ns), sum(end_ns - start_ns) FROM spans FINAL "
        "WHERE evaluation_id = {e:String} AND kind = 'layer' "
        "GROUP BY name ORDER BY sum(end_ns - start_ns) DESC, name"
    )
    deadline, last = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        rows = sql(settings, q, e=eval_id)
        if rows and rows == last and all(int(r[1]) == queries for r in rows):
            return rows
        last = rows
        time.sleep(1.0)
    pytest.fail(f"layer spans of {eval_id} did not settle: {last}")


def test_top_layers_of_a_real_onnxruntime_trace_match_the_stored_spans(stack: Settings) -> None:
    queries, n = 4, 6
    spec = ScenarioSpec(name="online", qps=10, duration_s=30, max_queries=queries)
    eval_id = run_job(stack, "efficientnet_lite0", "framework", spec).evaluation_id
    rows = settled_layer_rows(stack, eval_id, queries)
    [[predict_ns, predicts]] = sql(
        stack,
        "SELECT sum(end_ns - start_ns), count() FROM spans FINAL WHERE evaluation_id = "
        "{e:String} AND kind = 'step' AND name = 'predict'",
        e=eval_id,
    )
    assert int(predicts) == queries
    layer_ns = sum(float(r[3]) for r in rows)

    top = top_layers(open_source(stack), eval_id, n=n)
    assert list(top["rank"]) == list(range(1, n + 1))
    assert list(top["layer"]) == [r[0] for r in rows[:n]]  # most time first, ties by name
    assert list(top["calls"]) == [queries] * n  # every node runs once per query
    assert np.all(np.diff(top["total_ms"].to_numpy()) <= 0)
    for got, (_, _, mean_ns, total_ns) in zip(top.to_dict("records"), rows, strict=False):
        assert got["mean_ms"] == pytest.approx(float(mean_ns) / 1e6, rel=1e-9)
        assert got["total_ms"] == pytest.approx(float(total_ns) / 1e6, rel=1e-9)
        assert got["share"] == pytest.approx(float(total_ns) / layer_ns, rel=1e-9)
        assert got["predict_share"] == pytest.approx(float(total_ns) / float(predict_ns))
        assert got["op_type"] and got["device"]
    # The whole table: every layer once, and together they explain most of predict
    # (what is left is the session's own work between nodes), never more than all of it.
    every = top_layers(open_source(stack), eval_id, n=len(rows) + 10)
    assert len(every) == len(rows)
    assert every["share"].sum() == pytest.approx(1.0)
    covered = float(every["predict_share"].sum())
    assert covered == pytest.approx(layer_ns / float(predict_ns))
    assert 0.3 < covered <= 1.0, covered


@pytest.fixture
def two_loadgens(stack: Settings) -> Iterator[tuple[str, ...]]:
    """Two load-generator services (``mlscope loadgen``) on the stack's bus."""
    ids = ("lg-1", "lg-2")
    procs = [
        subprocess.Popen([python(), "-m", "cli.main", "loadgen", "--id", i], env=child_env(stack))
        for i in ids
    ]
    try:

        async def registered() -> None:
            with anyio.fail_after(60):
                async with busmod.connect(stack, name="test") as bus:
                    while len(await list_loadgens(bus)) < len(ids):
                        await anyio.sleep(0.2)

        anyio.run(registered, backend="asyncio")
        yield ids
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(20)


def test_stored_labels_of_a_real_run_follow_the_sample_order(stack: Settings) -> None:
    check_labels_follow_the_sample_order(stack, loadgen_hosts=None)


def test_load_generator_services_send_and_score_the_same_samples(
    stack: Settings, two_loadgens: tuple[str, ...]
) -> None:
    """The slices dealt to services carry the rows and labels of the one sample order."""
    summary = check_labels_follow_the_sample_order(stack, loadgen_hosts=two_loadgens)
    assert summary.loadgen_cost is not None
    assert [r["loadgen_id"] for r in summary.loadgen_cost["services"]] == list(two_loadgens)


def check_labels_follow_the_sample_order(
    stack: Settings, *, loadgen_hosts: tuple[str, ...] | None
) -> EvaluationSummary:
    seed, queries = 7, 800  # over two cycles of the 360-row holdout set
    spec = ScenarioSpec(
        name="constant",
        qps=200,
        duration_s=4,
        max_queries=queries,
        seed=seed,
        loadgen_hosts=loadgen_hosts,
    )
    summary = run_job(stack, "digits_cnn", "none", spec)
    eval_id = summary.evaluation_id
    entry = Catalog.load(default_manifest_dirs(None)).find("digits_cnn", framework="onnxruntime")
    path = entry.dataset(stack.zoo_dir)
    assert path is not None
    with np.load(path) as npz:
        y = npz["y"]
    assert queries > 2 * len(y)
    got = np.asarray(
        sql(
            stack,
            "SELECT query_index, ok, label, prediction FROM queries FINAL "
            "WHERE evaluation_id = {e:String} ORDER BY query_index",
            e=eval_id,
        ),
        dtype=np.int64,
    )
    assert got.shape == (queries, 4) and np.array_equal(got[:, 0], np.arange(queries))
    assert got[:, 1].all()
    labels = y[sample_indices(queries, len(y), seed)]
    correct, prediction = got[:, 2], got[:, 3]  # `label` holds a query's correct answers
    # Scored against exactly the labels of the helper's rows, query by query ...
    np.testing.assert_array_equal(correct, (prediction == labels).astype(np.int64))
    # ... and the inputs were those rows too: the model is right on most of them,
    # and would be right on about a tenth under any other order.
    assert correct.mean() > 0.9
    other = y[sample_indices(queries, len(y), seed + 1)]
    assert (prediction == other).mean() < 0.3
    return summary
