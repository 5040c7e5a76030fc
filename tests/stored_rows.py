"""Rows of the evaluations and queries tables as a test stores them straight into a
database, and span batches as an agent publishes them: every column with a plain
default, the ones a test is about given."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import numpy as np

from broker.db import EVALUATION_COLUMNS, QUERY_COLUMNS, Database
from mlscope.contracts import SpanBatch, new_id

__all__ = [
    "evaluation_row",
    "insert_evaluation",
    "insert_queries",
    "query_columns",
    "span_batch",
]


def evaluation_row(evaluation_id: str, **fields: Any) -> dict[str, Any]:
    """One ``evaluations`` row: a completed, VALID run of model ``m`` unless ``fields``
    say otherwise (a field the table does not have is a KeyError)."""
    row: dict[str, Any] = {
        "evaluation_id": evaluation_id,
        "job_id": evaluation_id,
        "rerun_of": "",
        "created_at": datetime(2026, 1, 1),
        "model": "m",
        "model_version": "1.0.0",
        "framework": "onnxruntime",
        "framework_version": "1",
        "agent_id": "a",
        "host": "h",
        "device": "cpu",
        "scenario": "online",
        "trace_level": "none",
        "status": "completed",
        "valid": 1,
        "t0_ns": 0,
        "clock_offset_ns": 0,
        "spec": "{}",
        "summary": "{}",
    }
    unknown = set(fields) - set(row)
    if unknown or set(row) != set(EVALUATION_COLUMNS):
        raise KeyError(f"not columns of evaluations: {sorted(unknown)}")
    return {**row, **fields}


def insert_evaluation(db: Database, row: dict[str, Any]) -> None:
    db.insert("evaluations", [[row[c]] for c in EVALUATION_COLUMNS], EVALUATION_COLUMNS)


def query_columns(
    evaluation_id: str,
    scheduled_ns: np.ndarray,
    completed_ns: np.ndarray,
    **columns: Sequence[Any] | np.ndarray,
) -> dict[str, list[Any]]:
    """The ``queries`` rows of one evaluation as columns: each query issued, received,
    predicted from its scheduled time and answered at its completion, ok, batch 1,
    label 0, not warm-up, unless ``columns`` say otherwise."""
    n = len(scheduled_ns)
    sched, done = np.asarray(scheduled_ns).tolist(), np.asarray(completed_ns).tolist()
    cols: dict[str, list[Any]] = {
        "evaluation_id": [evaluation_id] * n,
        "query_index": list(range(n)),
        "batch_size": [1] * n,
        "scheduled_ns": sched,
        "issued_ns": sched,
        "completed_ns": done,
        "agent_received_ns": sched,
        "predict_start_ns": sched,
        "predict_end_ns": done,
        "agent_replied_ns": done,
        "ok": [1] * n,
        "error": [""] * n,
        "label": [0] * n,
        "prediction": [0] * n,
        "outcome": [0] * n,
        "warmup": [0] * n,
        "paced_ns": sched,
    }
    unknown = set(columns) - set(cols)
    if unknown or set(cols) != set(QUERY_COLUMNS):
        raise KeyError(f"not columns of queries: {sorted(unknown)}")
    cols.update({k: np.asarray(v).tolist() for k, v in columns.items()})
    return cols


def insert_queries(db: Database, cols: dict[str, list[Any]]) -> None:
    db.insert("queries", [cols[c] for c in QUERY_COLUMNS], QUERY_COLUMNS)


def span_batch(
    eval_id: str, start: int, n: int, *, agent_id: str = "a1", host: str = "h"
) -> SpanBatch:
    """``n`` one-nanosecond ``predict`` spans of queries ``start`` .. ``start + n - 1``
    (their span ids and times the query index), as agent ``agent_id`` publishes them."""
    ids = list(range(start, start + n))
    return SpanBatch(
        evaluation_id=eval_id,
        agent_id=agent_id,
        host=host,
        batch_id=new_id("sb"),
        columns={
            "span_id": ids,
            "parent_id": [0] * n,
            "query_index": ids,
            "level": [1] * n,
            "kind": ["step"] * n,
            "name": ["predict"] * n,
            "start_ns": ids,
            "end_ns": ids,
            "attrs": [""] * n,
        },
    )
