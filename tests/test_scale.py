"""Many agents and server replicas on one bus: queue groups share load, --all-agents
runs one evaluation per agent, and replicas never run a job twice."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from cli.all_agents import comparison_table, submit_all
from cli.submit import main as submit_main
from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.contracts import EvaluationSummary, JobRequest, Query, ScenarioSpec, SpanBatch
from mlscope.natsserver import NatsServer
from mlscope.settings import Settings
from tests.conftest import make_data_dir, wait_agents, wait_server
from tests.scale_fixtures import count, start, stop

pytestmark = pytest.mark.timeout(240)
AGENTS = 8


@pytest.fixture(scope="module")
def farm(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[dict[str, Any]]:
    """8 noop agents and 2 server replicas, each replica with its own chDB directory."""
    base = tmp_path_factory.mktemp("farm")
    with NatsServer(store_dir=base / "nats") as nats_server:
        settings = Settings(nats_url=nats_server.url, data_dir=make_data_dir(base / "c", zoo_dir))
        replicas = [
            settings.with_(data_dir=make_data_dir(base / f"s{i}", zoo_dir)) for i in range(2)
        ]
        servers = [start(s, "server") for s in replicas]
        agents = []
        try:
            anyio.run(wait_server, settings)
            agents = [
                start(settings, "agent", "--framework", "noop", "--agent-id", f"n{i}")
                for i in range(AGENTS)
            ]
            anyio.run(wait_agents, settings, AGENTS, 120.0)
            yield {"settings": settings, "replicas": replicas, "servers": servers}
        finally:
            stop(*agents, *servers)


def test_agents_share_load_through_their_queue_group(farm: dict[str, Any]) -> None:
    settings: Settings = farm["settings"]
    eval_id = "ev-queue-group"

    async def main() -> Counter[str]:
        per_agent: Counter[str] = Counter()
        async with busmod.connect(settings, name="test") as bus:
            spans = await bus.nc.subscribe(names.evaluation_traces(eval_id))
            for i in range(AGENTS):
                await busmod.request(
                    bus,
                    names.agent_ctl(f"n{i}"),
                    codec.encode(
                        {
                            "op": "prepare",
                            "evaluation_id": eval_id,
                            "model": "noop",
                            "model_version": "1.0.0",
                            "batch_size": 1,
                            "trace_level": "model",
                        }
                    ),
                    timeout=30,
                )
            subject = names.capability("noop", "noop")
            limit = anyio.Semaphore(32)

            async def one(i: int) -> None:
                async with limit:
                    q = Query(evaluation_id=eval_id, index=i, inputs=np.zeros((1, 16), np.float32))
                    reply = codec.decode(
                        (await bus.nc.request(subject, codec.encode_model(q), timeout=10)).data
                    )
                    assert reply["ok"] is True

            async with anyio.create_task_group() as tg:
                for i in range(800):
                    tg.start_soon(one, i)
            queries: set[int] = set()
            with anyio.move_on_after(10):
                while len(queries) < 800:
                    batch = codec.decode_model(SpanBatch, (await spans.next_msg(5)).data)
                    roots = [
                        q
                        for q, k in zip(
                            batch.values("query_index"), batch.values("kind"), strict=True
                        )
                        if k == "query"
                    ]
                    per_agent[batch.agent_id] += len(roots)
                    queries.update(roots)
            assert len(queries) == 800
        return per_agent

    per_agent = anyio.run(main, backend="asyncio")
    assert sum(per_agent.values()) == 800  # each query answered by exactly one member
    assert len(per_agent) == AGENTS, per_agent  # and every member took a share


def test_all_agents_runs_one_evaluation_per_agent_and_replicas_run_each_once(
    farm: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings: Settings = farm["settings"]
    for var, value in settings.as_env().items():
        monkeypatch.setenv(var, value)
    job = JobRequest(
        model="noop", framework="noop", scenario=ScenarioSpec(name="online", qps=20, duration_s=1)
    )
    results = anyio.run(lambda: submit_all(settings, job, timeout=120), backend="asyncio")
    summaries = [r for r in results if isinstance(r, EvaluationSummary)]
    assert len(summaries) == AGENTS, results
    assert sorted(s.agent_id for s in summaries) == [f"n{i}" for i in range(AGENTS)]
    assert all(s.status == "completed" and s.errors == 0 for s in summaries)
    table = comparison_table(results)
    assert all(f"n{i}" in table for i in range(AGENTS))
    jobs = {s.job_id for s in summaries}
    assert len(jobs) == AGENTS
    # The command line: the same, as one table.
    assert (
        submit_main(
            ["noop", "--framework", "noop", "--all-agents", "--qps", "10", "--duration", "1"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert sum(f"n{i} " in out for i in range(AGENTS)) == AGENTS, out
    # Both replicas consumed the one job stream; together they stored each job once.
    stop(*farm["servers"])
    stored = [
        count(r.data_dir / "chdb", "SELECT count() FROM evaluations FINAL")
        for r in farm["replicas"]
    ]
    assert sum(stored) == 2 * AGENTS, stored
