"""Fixtures for the analysis, report and dashboard tests (registered in conftest.py).

``analysis_runs``: a real stack (nats-server, server owning chDB, onnxruntime agent)
with a few real evaluations of digits_cnn, started once per session and shared by
the test_analysis*, test_report* and test_dashboard* modules.

``span_db``: a fresh chDB (this process owns it; module scope, as chDB allows one
open data directory per process) holding spans that follow the
tracing convention (layer spans under predict, kernel spans under layers), for the
layer analysis independently of which framework profilers exist.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from mlscope.contracts import JobRequest, ScenarioSpec
from mlscope.jobs import submit
from mlscope.settings import Settings

REPO = Path(__file__).resolve().parent.parent
BATCH_SIZES = (1, 4, 16)


@dataclass(frozen=True)
class AnalysisRuns:
    settings: Settings
    online: tuple[str, str]
    """Two online runs of digits_cnn at the same rate (batch 1)."""
    batched: dict[int, str]
    """Batched runs of digits_cnn by batch size."""

    @property
    def all(self) -> list[str]:
        return [*self.online, *self.batched.values()]


async def _evaluate(settings: Settings) -> tuple[tuple[str, str], dict[int, str]]:
    def job(scenario: ScenarioSpec) -> JobRequest:
        return JobRequest(model="digits_cnn", framework="onnxruntime", scenario=scenario)

    online = []
    for seed in (1, 2):
        s = await submit(
            settings, job(ScenarioSpec(name="online", qps=150, duration_s=1.0, seed=seed))
        )
        online.append(s.evaluation_id)
    batched = {}
    for b in BATCH_SIZES:
        s = await submit(settings, job(ScenarioSpec(name="batched", batch_size=b, duration_s=0.7)))
        batched[b] = s.evaluation_id
    return (online[0], online[1]), batched


@pytest.fixture(scope="session")
def analysis_runs(
    tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path
) -> Iterator[AnalysisRuns]:
    from tests.conftest import running_stack

    with running_stack(tmp_path_factory.mktemp("analysis"), zoo_dir, ["onnxruntime"]) as s:
        online, batched = anyio.run(_evaluate, s.settings, backend="asyncio")
        yield AnalysisRuns(settings=s.settings, online=online, batched=batched)


# -------------------------------------------------------------- synthetic spans

SPAN_EVAL = "ev-layers"
# (layer name, op_type, shape, µs per call, kernels: (name, share of the layer's time))
LAYERS = (
    ("conv1", "Conv", [1, 8, 26, 26], 400, (("implicit_gemm", 0.7), ("im2col", 0.3))),
    ("conv2", "Conv", [1, 16, 24, 24], 900, (("implicit_gemm", 0.8), ("bias_add", 0.2))),
    ("relu1", "Relu", [1, 8, 26, 26], 50, ()),
    ("fc", "Gemm", [1, 10], 120, (("sgemm", 1.0),)),
)
QUERIES = 5


def span_columns() -> dict[str, list[object]]:
    """QUERIES queries: query → predict step → layers → kernels, back to back."""
    cols: dict[str, list[object]] = {
        c: []
        for c in (
            "evaluation_id",
            "agent_id",
            "span_id",
            "parent_id",
            "query_index",
            "level",
            "kind",
            "name",
            "start_ns",
            "end_ns",
            "host",
            "attrs",
            "batch_id",
        )
    }
    next_id = iter(range(1, 10_000))

    def add(
        parent: int,
        q: int,
        level: int,
        kind: str,
        name: str,
        start: int,
        end: int,
        attrs: dict[str, object] | None = None,
    ) -> int:
        sid = next(next_id)
        for c, v in (
            ("evaluation_id", SPAN_EVAL),
            ("agent_id", "agent-1"),
            ("span_id", sid),
            ("parent_id", parent),
            ("query_index", q),
            ("level", level),
            ("kind", kind),
            ("name", name),
            ("start_ns", start),
            ("end_ns", end),
            ("host", "h"),
            ("attrs", json.dumps(attrs) if attrs else ""),
            ("batch_id", "b1"),
        ):
            cols[c].append(v)
        return sid

    t = 1_000_000_000
    for q in range(QUERIES):
        total = sum(x[3] for x in LAYERS) * 1000
        qid = add(0, q, 1, "query", "query", t, t + total + 20_000)
        pid = add(qid, q, 1, "step", "predict", t + 10_000, t + 10_000 + total)
        at = t + 10_000
        for name, op, shape, us, kernels in LAYERS:
            lid = add(
                pid,
                q,
                2,
                "layer",
                name,
                at,
                at + us * 1000,
                {"op_type": op, "shape": shape, "device": "cpu"},
            )
            k_at = at
            for kname, share in kernels:
                dur = int(us * 1000 * share)
                add(lid, q, 3, "kernel", kname, k_at, k_at + dur, {"device": "cpu"})
                k_at += dur
            at += us * 1000
        t += total + 100_000
    return cols


@pytest.fixture(scope="module")
def span_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A DirectSource on a fresh chDB with the synthetic spans of SPAN_EVAL."""
    from analysis.source import DirectSource
    from broker.db import SPAN_COLUMNS, Database

    db = Database(f"chdb:///{tmp_path_factory.mktemp('spans-chdb')}")
    db.migrate()
    cols = span_columns()
    db.insert("spans", [cols[c] for c in SPAN_COLUMNS], SPAN_COLUMNS)
    try:
        yield DirectSource(db)
    finally:
        db.close()
