"""A cancelled sweep keeps what it made, as a finished one would as far as it got:
each run that finished before the cancel is its own evaluation with its verdict, the
run in progress is stored under its own id as ``cancelled`` (its issued query rows;
its spans have their evaluation), and the parent, ``cancelled``, names every run and
which one was in progress.

Real stack (nats-server, server owning chDB, a noop agent) serving ``noop_gate``: the
noop model behind a custom step that holds one query of the sweep's last batch size
until the test lets it go, so the cancel lands while that run is in progress, after
the runs before it finished, whatever the machine's speed. Timing is never asserted.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from broker.cancel import IN_FLIGHT, cancelled_summary
from cli.main import main as mlscope_main
from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import remote
from mlscope.api import Client, cancel_job
from mlscope.contracts import (
    EvaluationSummary,
    JobRequest,
    Placement,
    ScenarioSpec,
    evaluation_id_for,
)
from mlscope.jobs import submit
from mlscope.settings import Settings
from tests.conftest import LOOSE, child_env, noop_step_stack, python, wait_agents

pytestmark = pytest.mark.timeout(300)

SIZES = (1, 2, 4)
QUERIES = 12
HELD = 4
"""The query of the last size (its HELD-th pre-processing) held until the test says."""
STEPS = f"""import threading
import time
from pathlib import Path

GATE = Path({{gate!r}})
_lock = threading.Lock()
_seen = 0


def step(env, data):
    \"\"\"Armed (GATE/armed), hold the {HELD}th query of batch size {SIZES[-1]} until GATE/go.\"\"\"
    global _seen
    if len(data) != {SIZES[-1]} or not (GATE / "armed").exists():
        return data
    with _lock:
        _seen += 1
        mine = _seen
        if mine == {HELD}:  # disarmed: a later sweep is held only once armed again
            _seen = 0
            (GATE / "armed").unlink()
    if mine == {HELD}:
        (GATE / "held").touch()
        end = time.monotonic() + 120  # never for ever: the test may have failed
        while not (GATE / "go").exists() and time.monotonic() < end:
            time.sleep(0.02)
    return data
"""


@pytest.fixture(scope="module")
def gate_stack(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[Stack]:
    """nats-server, server and a noop agent (custom code allowed) serving noop_gate."""
    base = tmp_path_factory.mktemp("cancelsweep")
    (base / "gate").mkdir()
    steps = STEPS.format(gate=str(base / "gate"))
    with noop_step_stack(base, zoo_dir, name="noop_gate", steps=steps) as s:
        try:
            yield s
        finally:  # a step still held lets go before the agent stops
            (base / "gate" / "go").touch()


def sql(settings: Settings, query: str, evaluation_id: str) -> list[list[Any]]:
    async def go() -> list[list[Any]]:
        async with busmod.connect(settings, name="test") as bus:
            return (await remote.sql(bus, query, {"e": evaluation_id}))[1]

    return anyio.run(go, backend="asyncio")


def stored(settings: Settings, evaluation_id: str) -> tuple[str, dict[str, Any]]:
    """(status, summary) of a stored evaluation row."""
    q = "SELECT status, summary FROM evaluations FINAL WHERE evaluation_id = {e:String}"
    rows = sql(settings, q, evaluation_id)
    assert len(rows) == 1, (evaluation_id, rows)
    return str(rows[0][0]), json.loads(rows[0][1])


def query_rows(settings: Settings, evaluation_id: str) -> list[list[Any]]:
    """(query_index, batch_size, completed_ns, error) of an evaluation's stored queries."""
    q = (
        "SELECT query_index, batch_size, completed_ns, error FROM queries FINAL "
        "WHERE evaluation_id = {e:String} ORDER BY query_index"
    )
    return sql(settings, q, evaluation_id)


def spans_of(settings: Settings, evaluation_id: str) -> Any:
    """The stored spans of one evaluation, once there are some (or 30 s passed)."""

    async def go() -> Any:
        async with Client(settings, name="test") as client:
            got = await client.spans(evaluation_id)
            with anyio.move_on_after(30):
                while got.empty:
                    await anyio.sleep(0.3)
                    got = await client.spans(evaluation_id)
            return got

    return anyio.run(go, backend="asyncio")


def cancelled_in_last_run(
    settings: Settings, gate: Path, placement: Placement
) -> EvaluationSummary:
    """A sweep over SIZES cancelled (as ``mlscope cancel`` does) while its last run holds
    a query: the runs before it have finished. Its summary, as the submitter hears it."""
    for name in ("held", "go"):
        (gate / name).unlink(missing_ok=True)
    (gate / "armed").touch()
    job = JobRequest(
        model="noop_gate",
        framework="noop",
        trace_level="model",
        placement=placement,
        scenario=ScenarioSpec(
            name="batched",
            batch_sizes=SIZES,
            duration_s=120,
            max_queries=QUERIES,
            preprocess="timed",
            **LOOSE,
        ),
    )

    async def submit() -> EvaluationSummary:
        async with Client(settings, name="test") as client:
            return await client.submit(job, timeout=240)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(lambda: anyio.run(submit, backend="asyncio"))
        deadline = time.monotonic() + 180
        while not (gate / "held").exists():
            assert not waiting.done(), waiting.result()
            assert time.monotonic() < deadline, "never held"
            time.sleep(0.05)
        try:
            reply = anyio.run(
                lambda: cancel_job(settings, job.job_id, reason="test", timeout=30.0),
                backend="asyncio",
            )
        finally:
            (gate / "go").touch()
        assert reply is not None, "no server confirmed the cancel"
        summary = waiting.result(timeout=60)
    assert summary.evaluation_id == evaluation_id_for(job.job_id)
    return summary


@pytest.mark.parametrize("placement", ["server", "agent"])
def test_a_cancelled_sweep_keeps_its_finished_runs_and_the_one_in_progress(
    gate_stack: Stack, placement: Placement, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = gate_stack.settings
    gate = settings.data_dir.parent / "gate"
    parent = cancelled_in_last_run(settings, gate, placement)
    ids = [f"{parent.evaluation_id}-{k}" for k in range(len(SIZES))]
    *done, held = ids

    # The parent: cancelled, naming every run (as a finished sweep's does) and which
    # one was in progress; no query rows of its own.
    status, doc = stored(settings, parent.evaluation_id)
    assert status == "cancelled" and doc["status"] == "cancelled" and not doc["valid"]
    assert parent.status == "cancelled" and parent.points == tuple(doc["points"])
    assert [p["evaluation_id"] for p in doc["points"]] == ids
    assert [p["batch_size"] for p in doc["points"]] == list(SIZES)
    assert [p.get("status") for p in doc["points"]] == [None, None, "cancelled"]
    assert doc["invalid_reasons"][0].startswith("cancelled: test")
    assert f"during run {held}" in doc["invalid_reasons"][-1], doc["invalid_reasons"]
    assert query_rows(settings, parent.evaluation_id) == []

    # Each run that finished: its own evaluation, stored as a finished sweep stores it
    # (completed, its verdict, every query), the parent's point agreeing.
    for run_id, size, point in zip(done, SIZES, doc["points"], strict=False):
        status, run = stored(settings, run_id)
        assert status == "completed" and run["status"] == "completed", run
        assert run["valid"] == point["valid"] and run["invalid_reasons"] == list(
            point["invalid_reasons"]
        )
        assert run["scenario"]["batch_size"] == size and run["queries"] == QUERIES
        rows = query_rows(settings, run_id)
        assert [r[0] for r in rows] == list(range(QUERIES))
        assert {r[1] for r in rows} == {size} and all(r[2] > 0 for r in rows)

    # The run in progress: under its own id, cancelled, no figures, the queries it had
    # issued (the held one in flight, lost), and its spans now have an evaluation.
    status, run = stored(settings, held)
    assert status == "cancelled" and run["status"] == "cancelled" and not run["valid"]
    assert run["scenario"]["batch_size"] == SIZES[-1]
    assert run["latency_ms"]["p50"] is None and run["throughput_ips"] is None
    rows = query_rows(settings, held)
    assert len(rows) == run["queries"] > 1, (len(rows), run["queries"])
    assert [r[0] for r in rows] == list(range(len(rows)))
    assert {r[1] for r in rows} == {SIZES[-1]}
    lost = [r for r in rows if r[2] == 0]
    assert 1 <= len(lost) == run["lost"] < len(rows), rows
    assert all(r[3] == IN_FLIGHT for r in lost), rows
    spans = spans_of(settings, held)
    assert not spans.empty and set(spans["evaluation_id"]) == {held}

    # A user's view of those runs works as for a finished sweep's.
    for key, value in settings.as_env().items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "held.json"
    assert mlscope_main(["trace", held, "-o", str(out)]) == 0
    assert json.loads(out.read_text())["traceEvents"]
    report = tmp_path / "report.json"
    assert mlscope_main(["report", parent.evaluation_id, *ids, "-o", str(report)]) == 0
    assert report.read_text()


def test_a_cancelled_single_run_is_stored_under_its_job() -> None:
    """A job of one run (a sweep of one point included) tracks no runs: what a cancel
    stores is that run alone, under the job's id, as it was."""
    from broker.cancel import cancelled_rows
    from broker.run import RunsSoFar

    job = JobRequest(
        model="noop", framework="noop", scenario=ScenarioSpec(name="batched", batch_sizes=(4,))
    )
    s = cancelled_summary(job, None, reason="test", started_at=time.time())
    assert cancelled_rows(s, RunsSoFar(), None) == [(s, None)]


def test_a_cancel_heard_while_a_finished_sweep_is_stored_comes_too_late(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a sweep's runs are over, a cancel does not cut their storing short: every
    run and the parent are stored as a finished sweep's, not some runs under a
    cancelled parent. The cancel is made to land exactly when the runs are being
    stored (the server's own store, wrapped), whatever the machine's speed."""
    from broker import evalstore
    from broker.server import Server

    job = JobRequest(
        model="noop",
        framework="noop",
        trace_level="none",
        scenario=ScenarioSpec(
            name="batched", batch_sizes=SIZES, duration_s=120, max_queries=QUERIES, **LOOSE
        ),
    )
    server = Server(settings)
    store_separate = evalstore.store_separate

    async def cancelled_while_storing(*args: Any) -> None:
        server.cancels.request(job.job_id, "too late", taken=True)
        await store_separate(*args)

    monkeypatch.setattr(evalstore, "store_separate", cancelled_while_storing)
    agent = subprocess.Popen(
        [python(), "-m", "cli.main", "agent", "--framework", "noop"], env=child_env(settings)
    )

    async def main() -> tuple[EvaluationSummary, list[list[Any]]]:
        async with anyio.create_task_group() as tg:
            await tg.start(server.run)
            await wait_agents(settings, 1)
            summary = await submit(settings, job, timeout=120)
            async with busmod.connect(settings, name="test") as bus:
                _, got = await remote.sql(
                    bus,
                    "SELECT evaluation_id, status FROM evaluations FINAL "
                    "WHERE evaluation_id LIKE {p:String} ORDER BY evaluation_id",
                    {"p": f"{summary.evaluation_id}%"},
                )
            tg.cancel_scope.cancel()
        return summary, got

    try:
        summary, got = anyio.run(main, backend="asyncio")
    finally:
        agent.terminate()
        agent.wait(20)
    ev = evaluation_id_for(job.job_id)
    assert summary.status != "cancelled" and summary.evaluation_id == ev
    runs = [f"{ev}-{k}" for k in range(len(SIZES))]
    assert [p["evaluation_id"] for p in summary.points] == runs
    assert [(str(e), str(s)) for e, s in got] == [(e, summary.status) for e in [ev, *runs]]
