"""Accuracy, cross-framework divergence and cold start through live agents over the bus.

One stack (nats-server, server, one agent per framework) for the module; the zoo's
digits_cnn and efficientnet_lite0 on all four frameworks.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from broker import coldstart
from broker.compare import Outputs, compare, compare_evaluations
from cli.summary_text import format_summary
from mlscope import bus as busmod
from mlscope import remote
from mlscope.contracts import EvaluationSummary, JobRequest, ScenarioSpec
from mlscope.errors import EvaluationError
from mlscope.jobs import submit
from mlscope.settings import Settings
from mlscope.zoo.build import build
from tests.conftest import child_env, python, running_stack

pytestmark = pytest.mark.timeout(300)

FRAMEWORKS = ["onnxruntime", "pytorch", "tensorflow", "tflite"]
QUICK = ScenarioSpec(name="batched", batch_size=4, duration_s=5, max_queries=8)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[Settings]:
    """A stack with one agent per framework; the zoo holds both models."""
    build(zoo_dir, only=["digits_cnn", "efficientnet_lite0"], log=lambda _: None)
    with running_stack(tmp_path_factory.mktemp("four"), zoo_dir, FRAMEWORKS, timeout=120.0) as s:
        yield s.settings


def evaluate(settings: Settings, model: str, samples: int | None = None) -> list[EvaluationSummary]:
    async def go() -> list[EvaluationSummary]:
        out = []
        for fw in FRAMEWORKS:  # one at a time: 2 cores
            job = JobRequest(
                model=model,
                framework=fw,
                scenario=QUICK,
                accuracy=True,
                accuracy_samples=samples,
                trace_level="none",
            )
            out.append(await submit(settings, job, timeout=240))
        return out

    return anyio.run(go, backend="asyncio")


def comparison(settings: Settings, summaries: list[EvaluationSummary]) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with busmod.connect(settings, name="test") as bus:
            c = await compare_evaluations(
                bus, [(s.framework["name"], s.evaluation_id, s.accuracy) for s in summaries]
            )
            return c.to_dict()

    return anyio.run(go, backend="asyncio")


def test_digits_cnn_accuracy_and_divergence_on_four_frameworks(four: Settings) -> None:
    summaries = evaluate(four, "digits_cnn", samples=300)
    for s in summaries:
        assert s.status == "completed" and s.errors == 0, s.framework
        acc = s.accuracy or {}
        assert acc["samples"] == 300 and acc["failed_queries"] == 0
        assert 0.95 < acc["top1"] <= acc["top5"] <= 1.0, (s.framework, acc)
    # The same weights in every format: the same answers, outputs equal to float error.
    assert len({s.accuracy["top1"] for s in summaries if s.accuracy}) == 1
    doc = comparison(four, summaries)
    assert doc["reference"] == "onnxruntime" and doc["kind"] == "logits"
    assert [r["label"] for r in doc["rows"]] == FRAMEWORKS
    for r in doc["rows"]:
        assert r["samples"] == 300
        assert r["top1_agreement"] == 1.0
        assert r["max_abs_diff"] < 1e-3 and 0 <= r["mean_kl"] < 1e-6, r
    assert doc["rows"][0]["max_abs_diff"] == 0.0

    # The per-sample outputs are stored with the data-set row and its label.
    async def stored() -> list[list[object]]:
        async with busmod.connect(four, name="test") as bus:
            return (
                await remote.sql(
                    bus,
                    "SELECT count(), uniqExact(sample), "
                    "sum(label = prediction) FROM outputs FINAL WHERE "
                    "evaluation_id = {e:String}",
                    {"e": summaries[0].evaluation_id},
                )
            )[1]

    n, distinct, right = anyio.run(stored, backend="asyncio")[0]
    assert n == distinct == 300
    assert right == round(summaries[0].accuracy["top1"] * 300)  # type: ignore[index]


def test_a_traced_run_keeps_only_its_own_spans_when_it_also_measures_accuracy(
    four: Settings,
) -> None:
    """The data-set pass shares the evaluation id but is not traced: each query of the
    load run has exactly one predict span, and no other query index has one."""
    job = JobRequest(
        model="digits_cnn",
        framework="onnxruntime",
        scenario=QUICK,
        accuracy=True,
        accuracy_samples=100,  # 25 data-set queries of 4, more than the load run's 8
        trace_level="model",
    )
    s = anyio.run(lambda: submit(four, job, timeout=240), backend="asyncio")
    assert s.status == "completed" and (s.accuracy or {}).get("samples") == 100

    async def predict_spans() -> list[list[Any]]:
        async with busmod.connect(four, name="test") as bus:
            for _ in range(50):  # spans are ingested after the summary is stored
                _, rows = await remote.sql(
                    bus,
                    "SELECT query_index, count() FROM spans FINAL WHERE evaluation_id = "
                    "{e:String} AND name = 'predict' GROUP BY query_index ORDER BY query_index",
                    {"e": s.evaluation_id},
                )
                if len(rows) >= s.queries:
                    return rows
                await anyio.sleep(0.2)
            return rows

    rows = anyio.run(predict_spans, backend="asyncio")
    assert [r[0] for r in rows] == list(range(s.queries)), rows
    assert all(r[1] == 1 for r in rows), rows


def test_a_data_set_pass_reads_any_answer_without_failing() -> None:
    """What arrives on the pass's inbox: a reply, an error naming its query or none,
    and bytes that are not an answer (a WireError, which the pass skips)."""
    from broker.accuracy import _reply_of
    from mlscope import codec
    from mlscope.contracts import ErrorReply, QueryReply
    from mlscope.errors import MLScopeError

    ok = QueryReply(index=3, ok=True, outputs=np.zeros((1, 5), np.int32))
    assert _reply_of(codec.encode_model(ok))[0] == 3
    named = ErrorReply(error={"message": "bad", "fields": {"index": 2}})
    assert _reply_of(codec.encode_model(named)) == (2, "bad")
    for fields in (None, [1], {"index": "2"}, {"index": [2]}):
        anon = ErrorReply(error={"message": "worse", "fields": fields})
        assert _reply_of(codec.encode_model(anon)) == (-1, "worse")
    for junk in (b"", b"\xc1", codec.encode([1, 2]), codec.encode({"kind": "reply"})):
        with pytest.raises(MLScopeError):
            _reply_of(junk)


@pytest.mark.parametrize(
    ("raw", "outputs", "why"),
    [
        (np.zeros(5, np.float32), np.zeros((2, 1), np.int64), "one row per sample"),
        (np.zeros((2, 0, 3), np.float32), np.zeros((2, 1), np.int64), "one row per sample"),
        (np.zeros((2, 4), np.float32), np.zeros((2, 1), np.int64), "wide"),
        (np.zeros((2, 3), np.float32), np.zeros((2, 2), np.int64), "wide"),
        (np.zeros((2, 3), np.float32), np.array([["a"], ["b"]]), "not numbers"),
    ],
)
def test_a_reply_whose_outputs_are_not_a_row_per_sample_fails_only_its_samples(
    raw: np.ndarray, outputs: np.ndarray, why: str
) -> None:
    """The rows of every reply are joined into one table: one reply of another shape
    used to fail the whole pass (and its job) when they were joined."""
    from broker.accuracy import _collect
    from mlscope.contracts import QueryReply

    def reply(q: int, raw: np.ndarray, outputs: np.ndarray) -> QueryReply:
        return QueryReply(index=q, ok=True, raw_outputs=raw, outputs=outputs)

    good = (np.ones((2, 3), np.float32), np.zeros((2, 1), np.int64))
    replies: dict[int, QueryReply | str] = {
        0: reply(0, *good),
        1: reply(1, raw, outputs),
        2: reply(2, *good),
    }
    run = _collect(replies, [0, 2, 4], 6, np.arange(6) % 3, "logits", 2)
    assert run.indices.tolist() == [0, 1, 4, 5] and run.raw.shape == (4, 3)
    assert list(run.errors) == [1] and why in run.errors[1]


def test_efficientnet_lite0_accuracy_and_divergence_on_four_frameworks(four: Settings) -> None:
    summaries = evaluate(four, "efficientnet_lite0")
    for s in summaries:
        acc = s.accuracy or {}
        assert s.status == "completed" and s.errors == 0, s.framework
        # the sanity set right on every framework through its agent, as in test_zoo
        assert acc["samples"] == 6 and acc["top1"] == 1.0 and acc["top5"] == 1.0, acc
    doc = comparison(four, summaries)
    for r in doc["rows"]:
        assert r["samples"] == 6 and r["top1_agreement"] == 1.0, r
        assert r["mean_kl"] < 1e-2, r  # Keras port vs PyTorch weights: close, not equal


def test_cli_compares_frameworks_in_one_command(four: Settings) -> None:
    out = subprocess.run(
        [
            python(),
            "-m",
            "cli.submit",
            "digits_cnn",
            "--framework",
            "onnxruntime,tflite",
            "--accuracy",
            "--accuracy-samples",
            "100",
            "--scenario",
            "batched",
            "--batch-size",
            "8",
            "--max-queries",
            "4",
            "--trace-level",
            "none",
            "--json",
        ],
        env=child_env(four),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [s["framework"]["name"] for s in doc["summaries"]] == ["onnxruntime", "tflite"]
    rows = doc["comparison"]["rows"]
    assert rows[1]["label"] == "tflite" and rows[1]["samples"] == 100
    assert rows[1]["top1_agreement"] == 1.0 and rows[1]["accuracy"]["top1"] > 0.95
    text = subprocess.run(
        [
            python(),
            "-m",
            "cli.submit",
            "digits_cnn",
            "--framework",
            "onnxruntime,pytorch",
            "--accuracy",
            "--accuracy-samples",
            "50",
            "--scenario",
            "batched",
            "--max-queries",
            "4",
            "--trace-level",
            "none",
        ],
        env=child_env(four),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert text.returncode == 0, text.stderr
    assert "divergence from onnxruntime (logits)" in text.stdout
    assert "pytorch" in text.stdout.splitlines()[-1]


def test_cold_start_measures_every_load_apart_from_warm_inference(four: Settings) -> None:
    spec = ScenarioSpec(name="cold-start", repetitions=3, warm_queries=10, batch_size=1)
    s = anyio.run(
        lambda: submit(
            four,
            JobRequest(
                model="digits_cnn", framework="onnxruntime", scenario=spec, trace_level="none"
            ),
            timeout=240,
        ),
        backend="asyncio",
    )
    c = s.cold_start or {}
    assert s.status == "completed" and s.errors == 0
    assert s.scenario["name"] == "cold-start" and s.queries == 30
    assert c["repetitions"] == 3 and c["cold_loads"] == 3  # loaded again every time
    runs = c["runs"]
    assert [r["cold"] for r in runs] == [True, True, True]
    assert all(r["load_ms"] > 0 and r["first_inference_ms"] > 0 for r in runs)
    assert all(r["warm_predict_ms_p50"] > 0 for r in runs)
    assert c["load_ms"] == sorted(r["load_ms"] for r in runs)[1]  # the median
    assert c["first_over_warm"] == c["first_inference_ms"] / c["warm_predict_ms"]
    assert "cold start" in format_summary(s) and "(3/3 loads)" in format_summary(s)
    assert not any("repetitions loaded" in r for r in s.invalid_reasons)
    assert coldstart.reasons({**c, "cold_loads": 2}) == (
        "only 2 of 3 repetitions loaded the model (another evaluation kept it loaded)",
    )


def test_compare_rejects_runs_without_common_ground() -> None:
    a = Outputs("a", "ev-a", np.arange(3), np.zeros(3), np.eye(3, dtype=np.float32), "logits")
    b = Outputs("b", "ev-b", np.arange(3, 6), np.zeros(3), np.eye(3, dtype=np.float32), "logits")
    with pytest.raises(EvaluationError, match="share no sample"):
        compare([a, b])
    with pytest.raises(EvaluationError, match="at least two"):
        compare([a])
    c = Outputs(
        "c", "ev-c", np.arange(3), np.zeros(3), np.eye(3, dtype=np.float32), "probabilities"
    )
    with pytest.raises(EvaluationError, match="output kind"):
        compare([a, c])
    # Partly overlapping samples: only the common ones count.
    d = Outputs(
        "d",
        "ev-d",
        np.array([1, 2, 7]),
        np.zeros(3),
        np.array([[0, 1, 0], [0, 0, 1], [1, 0, 0]], np.float32),
        "logits",
    )
    row = compare([a, d]).rows[1]
    assert row.samples == 2 and row.max_abs_diff == 0.0 and row.top1_agreement == 1.0
