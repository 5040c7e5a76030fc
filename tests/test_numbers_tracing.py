"""Tracing does not change what it measures without saying so: ONNX Runtime's profiler
is opened once per evaluation, its start and stop stay out of the predict span, and the
layers of a query account for its predict span."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.profiling import profiler_for
from mlscope.contracts import TraceLevel
from tests.tracing_fixtures import check_tree, ensure_built, open_model, run_queries

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def effnet_zoo(zoo_dir: Path) -> Path:
    ensure_built(zoo_dir, "efficientnet_lite0")
    return zoo_dir


def test_ort_layers_add_up_to_the_predict_span_with_one_profiling_session(effnet_zoo: Path) -> None:
    model = open_model(effnet_zoo, "efficientnet_lite0", "onnxruntime")
    try:
        model.warmup()
        n = 6
        rows = run_queries(model, TraceLevel.FRAMEWORK, n)
        assert set(check_tree(rows)) == set(range(n))
        prof = profiler_for(model.predictor)
        assert getattr(prof, "sessions_opened", None) == 1  # once, not once per query
        predict = {r["query_index"]: r for r in rows if r["name"] == "predict"}
        ratios = []
        for p in predict.values():
            span = p["end_ns"] - p["start_ns"]
            layers = sum(
                r["end_ns"] - r["start_ns"]
                for r in rows
                if r["kind"] == "layer" and r["parent_id"] == p["span_id"]
            )
            ratios.append(layers / span)
            assert json.loads(p["attrs"])["profiler_ns"] >= 0  # measured, reported apart
        # The first run of a session is cold; the others' layers fill their predict.
        warm = sorted(ratios)[1:]
        assert all(0.8 <= r <= 1.0 for r in warm), ratios
    finally:
        model.predictor.close()
