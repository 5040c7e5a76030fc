"""Helpers for the tracing tests: a model's executor driven directly, span-tree checks."""

from __future__ import annotations

import queue
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from agent.job import Job
from agent.pipeline import Executor
from agent.tracer import COLUMNS, SpanBuffer
from agent.worker import LoadedModel
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.contracts import QueryReply, TraceLevel
from mlscope.predictor import PredictorOptions


def ensure_built(zoo: Path, *models: str) -> None:
    from mlscope.zoo.build import build

    build(zoo, only=list(models), log=lambda _m: None)


def open_model(zoo: Path, model: str, framework: str) -> LoadedModel:
    cat = Catalog.load(default_manifest_dirs(None))
    entry = next(
        e
        for e in cat.entries
        if e.manifest.name == model and e.manifest.framework.name == framework
    )
    return LoadedModel.open(entry, entry.graph(zoo), PredictorOptions(threads=1))


def sample(model: LoadedModel) -> np.ndarray:
    """One raw query input: uint8 image bytes-like arrays for image models, else zeros."""
    if model.name == "efficientnet_lite0":
        return np.zeros((1, 64, 64, 3), np.uint8)
    return np.zeros((1, *model.sample_shape), np.float32)


def run_queries(
    model: LoadedModel, level: TraceLevel, n: int, first_index: int = 0
) -> list[dict[str, Any]]:
    """n queries through a real Executor; the spans they produced, as rows."""
    worker = Executor(model)
    buf = SpanBuffer()
    replies: queue.Queue[QueryReply] = queue.Queue()
    try:
        for i in range(first_index, first_index + n):
            spans = buf if level > TraceLevel.NONE else None
            assert worker.submit(
                Job(
                    index=i,
                    inputs=sample(model),
                    received_ns=time.perf_counter_ns(),
                    level=level,
                    spans=spans,
                    reply=replies.put,
                )
            )
            reply = replies.get(timeout=60)
            assert reply.ok, reply.error
    finally:
        worker.stop(close=False)  # the model is reused by the next call
    cols = buf.take()
    return [
        dict(zip(COLUMNS, row, strict=True))
        for row in zip(*(cols[c] for c in COLUMNS), strict=True)
    ]


def check_tree(rows: list[dict[str, Any]]) -> Counter[int]:
    """Every layer under a predict span of its own query, inside it; kernels under a layer.

    Returns the number of layer spans per query.
    """
    by_id = {r["span_id"]: r for r in rows}
    layers: Counter[int] = Counter()
    for r in rows:
        if r["kind"] == "layer":
            parent = by_id[r["parent_id"]]
            assert parent["kind"] == "step" and parent["name"] == "predict", r
            assert parent["query_index"] == r["query_index"]
            assert parent["start_ns"] <= r["start_ns"] <= r["end_ns"] <= parent["end_ns"]
            assert r["level"] == TraceLevel.FRAMEWORK
            layers[r["query_index"]] += 1
        elif r["kind"] in ("kernel", "op"):
            parent = by_id[r["parent_id"]]
            assert parent["kind"] == "layer", r
            if r["kind"] == "op":  # an op runs on the host inside the layer that called it
                assert parent["start_ns"] <= r["start_ns"] <= r["end_ns"] <= parent["end_ns"]
    return layers
