"""A sweep's runs are traced apart: each run's spans (and system samples) are stored
under its own id (``<evaluation_id>-<k>``), with its own query indices from 0, in
either placement; the parent keeps none of its runs' spans. An agent takes a query or
a local run naming a run id only for a run the evaluation it was prepared for makes.

Real nats-server, server and noop agent processes; everything is read back the way a
user reads it (the Python API, ``mlscope trace``). Timing is never asserted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pandas as pd
import pytest

from analysis.layers import span_attrs
from cli.main import main as mlscope_main
from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import codec, names, wire
from mlscope.api import Client
from mlscope.contracts import (
    EvaluationSummary,
    JobRequest,
    Placement,
    PrepareOp,
    ReleaseOp,
    RunOp,
    ScenarioSpec,
    TraceLevel,
    new_id,
)
from mlscope.errors import EvaluationError, error_from_wire
from mlscope.registry import list_agents
from mlscope.settings import Settings
from tests.conftest import LOOSE

pytestmark = pytest.mark.timeout(300)

SIZES = (1, 4)
SPANS_PER_QUERY = 4
"""query, preprocess, predict, postprocess: a query's spans at level model."""


def sweep(settings: Settings, placement: Placement, level: str, **spec: Any) -> EvaluationSummary:
    job = JobRequest(
        model="noop",
        framework="noop",
        trace_level=level,
        placement=placement,
        scenario=ScenarioSpec(name="batched", batch_sizes=SIZES, **spec, **LOOSE),
    )
    return submit(settings, job)


def submit(settings: Settings, job: JobRequest) -> EvaluationSummary:
    """``job`` submitted through the Python API; its summary (completed, no errors)."""

    async def go() -> EvaluationSummary:
        async with Client(settings, name="test") as client:
            return await client.submit(job, timeout=180)

    summary = anyio.run(go, backend="asyncio")
    assert summary.status == "completed" and summary.errors == 0, summary
    return summary


def spans_of(settings: Settings, evaluation_id: str, want: int = 0) -> pd.DataFrame:
    """The stored spans of one evaluation through the Python API, once ``want`` of them
    are ingested (or 30 s passed)."""

    async def go() -> pd.DataFrame:
        async with Client(settings, name="test") as client:
            got = await client.spans(evaluation_id)
            with anyio.move_on_after(30):
                while len(got) < want:
                    await anyio.sleep(0.3)
                    got = await client.spans(evaluation_id)
            return got

    return anyio.run(go, backend="asyncio")


def samples_of(settings: Settings, evaluation_id: str) -> pd.DataFrame:
    async def go() -> pd.DataFrame:
        async with Client(settings, name="test") as client:
            return await client.frame(
                "SELECT ts_ns, metric FROM system_samples FINAL "
                "WHERE evaluation_id = {e:String} ORDER BY ts_ns",
                {"e": evaluation_id},
            )

    return anyio.run(go, backend="asyncio")


def check_runs_apart(settings: Settings, s: EvaluationSummary) -> dict[str, pd.DataFrame]:
    """Each run's spans are its own: indices 0 .. queries-1, one query span each, its
    own batch size; the parent has none of them. The runs' spans by run id."""
    ids = [p["evaluation_id"] for p in s.points]
    assert ids == [f"{s.evaluation_id}-{k}" for k in range(len(SIZES))]
    out = {}
    for point, size in zip(s.points, SIZES, strict=True):
        run_id, n = point["evaluation_id"], int(point["queries"])
        assert n > 0 and point["batch_size"] == size
        spans = spans_of(settings, run_id, n * SPANS_PER_QUERY)
        assert len(spans) == n * SPANS_PER_QUERY, (run_id, len(spans), n)
        roots = spans[spans["kind"] == "query"]
        assert sorted(roots["query_index"]) == list(range(n)), run_id  # 0 .. n-1, once each
        assert set(spans["query_index"]) == set(range(n))
        assert {span_attrs(a)["batch_size"] for a in roots["attrs"]} == {size}
        out[run_id] = spans
    # Read once the runs' spans are in (one flush of the agent publishes every buffer):
    # the parent mixes in none of them.
    assert spans_of(settings, s.evaluation_id).empty
    return out


@pytest.mark.parametrize("placement", ["server", "agent"])
def test_each_run_of_a_sweep_keeps_its_own_spans(
    noop_stack: Stack, placement: Placement, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = noop_stack.settings
    s = sweep(settings, placement, "model", duration_s=5.0, max_queries=60)
    assert s.placement == placement
    runs = check_runs_apart(settings, s)
    # A user's own view of a run: `mlscope trace <id>-1` holds that run's queries alone.
    for key, value in settings.as_env().items():
        monkeypatch.setenv(key, value)
    run_id = s.points[1]["evaluation_id"]
    out = tmp_path / "run.json"
    assert mlscope_main(["trace", run_id, "-o", str(out)]) == 0
    events = json.loads(out.read_text())["traceEvents"]
    begun = [  # the agent's query spans (the load generator's slices carry no span id)
        e["args"]["query_index"]
        for e in events
        if e.get("ph") == "b" and "span_id" in e.get("args", {})
    ]
    assert sorted(begun) == sorted(runs[run_id][runs[run_id]["kind"] == "query"]["query_index"])
    # The parent is still readable: its runs are listed, its own trace holds no span.
    parent = tmp_path / "parent.json"
    assert mlscope_main(["trace", s.evaluation_id, "-o", str(parent)]) == 0
    assert not [e for e in json.loads(parent.read_text())["traceEvents"] if e.get("ph") == "X"]


def test_a_sweeps_system_samples_follow_its_runs(noop_stack: Stack) -> None:
    """At level system each run has the samples taken while it ran, under its own id:
    the first run's all before the second's."""
    settings = noop_stack.settings
    s = sweep(settings, "server", "system", duration_s=0.8)
    check_runs_apart(settings, s)
    first, second = (samples_of(settings, p["evaluation_id"]) for p in s.points)
    assert not first.empty and not second.empty, (len(first), len(second))
    assert first["ts_ns"].max() < second["ts_ns"].min()


def test_a_sweep_of_one_point_is_traced_as_the_evaluation(noop_stack: Stack) -> None:
    """One point is the evaluation itself: its spans are under the job's id, as any
    single run's."""
    job = JobRequest(
        model="noop",
        framework="noop",
        trace_level="model",
        placement="server",
        scenario=ScenarioSpec(name="batched", batch_sizes=(4,), max_queries=30, **LOOSE),
    )
    s = submit(noop_stack.settings, job)
    assert [p["evaluation_id"] for p in s.points] == [s.evaluation_id]
    spans = spans_of(noop_stack.settings, s.evaluation_id, s.queries * SPANS_PER_QUERY)
    assert sorted(spans[spans["kind"] == "query"]["query_index"]) == list(range(s.queries))
    assert spans_of(noop_stack.settings, f"{s.evaluation_id}-0").empty


# ------------------------------------------------------------------ hostile ids


def test_an_agent_traces_only_the_runs_of_what_it_was_prepared_for(noop_stack: Stack) -> None:
    """A query or local run naming a run id the prepared evaluation does not make (a
    run past its count, another evaluation's, one of an evaluation of one run, not a
    run at all) is refused with a typed EvaluationError, and no span is kept for it;
    one naming a run it makes is answered and traced under that run."""
    settings = noop_stack.settings
    ev, single = new_id("ev"), new_id("ev")

    async def go() -> None:
        async with busmod.connect(settings, name="test") as bus:
            agent = next(a for a in await list_agents(bus) if a.frameworks[0].name == "noop")
            ctl = names.agent_ctl(agent.agent_id)

            async def ask(op: Any) -> dict[str, Any]:
                msg = await bus.nc.request(ctl, codec.encode_model(op), timeout=60)
                reply: dict[str, Any] = codec.decode(msg.data)
                return reply

            async def query(evaluation_id: str) -> dict[str, Any]:
                data = wire.encode_query(
                    evaluation_id, 0, np.ones((1, 16), np.float32), int(TraceLevel.MODEL)
                )
                msg = await bus.nc.request(names.agent_query(agent.agent_id), data, timeout=30)
                reply: dict[str, Any] = codec.decode(msg.data)
                return reply

            for e, runs in ((ev, 2), (single, 1)):
                prep = PrepareOp(evaluation_id=e, model="noop", model_version="1.0.0", runs=runs)
                assert (await ask(prep)).get("kind") != "error"
            try:
                for good in (f"{ev}-0", f"{ev}-1", ev, single):
                    assert (await query(good))["ok"], good
                for bad in (f"{ev}-2", f"{ev}-x", f"{ev}--1", f"{single}-0", "ev-other-0"):
                    reply = await query(bad)
                    assert reply.get("kind") == "error", (bad, reply)
                    err = error_from_wire(reply["error"])
                    assert isinstance(err, EvaluationError) and bad in err.message, (bad, err)
                spec = ScenarioSpec(name="single-stream", duration_s=0.2, max_queries=5)
                for bad in (f"{ev}-2", f"{single}-0", f"{single}-x"):
                    evaluation = single if bad.startswith(single) else ev
                    op = RunOp(evaluation_id=evaluation, run_id=bad, scenario=spec)
                    reply = await ask(op)
                    assert reply.get("kind") == "error", (bad, reply)
                    err = error_from_wire(reply["error"])
                    assert isinstance(err, EvaluationError) and bad in err.message, (bad, err)
            finally:
                for e in (ev, single):
                    await ask(ReleaseOp(evaluation_id=e))  # every span published first

    anyio.run(go, backend="asyncio")
    for good in (f"{ev}-0", f"{ev}-1", ev, single):
        spans = spans_of(settings, good, SPANS_PER_QUERY)
        assert list(spans["query_index"]) == [0] * SPANS_PER_QUERY, good
    for bad in (f"{ev}-2", f"{ev}-x", f"{ev}--1", f"{single}-0", "ev-other-0", f"{single}-x"):
        assert spans_of(settings, bad).empty, bad
