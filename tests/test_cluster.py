"""A 3-node NATS cluster with JetStream replicas 3: one node is killed in the middle of
an evaluation, and no job, result or span is lost."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import nats.errors
import pytest

from mlscope import bus as busmod
from mlscope import names, remote
from mlscope.contracts import EvaluationSummary, JobEvent, JobRequest, ScenarioSpec
from mlscope.errors import BusError
from mlscope.jobs import submit
from mlscope.natsserver import NatsServer, cluster_config, free_port
from mlscope.provision import provisioned
from mlscope.settings import Settings
from tests.conftest import make_data_dir, wait_agents, wait_server
from tests.scale_fixtures import start, stop

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[NatsServer]]:
    ports = [free_port() for _ in range(3)]
    nodes = []
    for i in range(3):
        conf = tmp_path / f"n{i}.conf"
        conf.write_text(
            cluster_config(
                name="mlscope",
                node=f"n{i}",
                cluster_port=ports[i],
                host="127.0.0.1",
                routes=[f"nats-route://127.0.0.1:{p}" for j, p in enumerate(ports) if j != i],
            )
        )
        nodes.append(NatsServer(store_dir=tmp_path / f"n{i}", config_file=conf))
    try:
        for node in nodes:
            node.start()
        yield nodes
    finally:
        for node in nodes:
            node.stop()


async def provision(settings: Settings, timeout: float = 30.0) -> None:
    """Until the cluster has a JetStream leader and every stream/bucket exists (R3)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with provisioned(settings, name="test") as bus:
                info = await bus.js.stream_info(names.TRACES_STREAM)
                assert info.config.num_replicas == 3
                return
        except BusError:
            if time.monotonic() > deadline:
                raise
            await anyio.sleep(0.5)


LED = (names.JOBS_STREAM, names.TRACES_STREAM)
"""Streams whose leader the test kills: jobs (the work queue) and spans."""


async def leaders(settings: Settings, timeout: float = 30.0) -> dict[str, str]:
    """The leader of every stream of ``LED``, once each has one (after a node loss the
    survivors may still be electing)."""
    deadline = time.monotonic() + timeout
    out: dict[str, str] = {}
    async with busmod.connect(settings, name="test") as bus:
        for stream in LED:
            while stream not in out:
                with contextlib.suppress(nats.errors.Error):
                    info = await bus.js.stream_info(stream)
                    if info.cluster is not None and info.cluster.leader:
                        out[stream] = info.cluster.leader
                        continue
                assert time.monotonic() < deadline, f"{stream} has no leader"
                await anyio.sleep(0.5)
    return out


async def lead_from(settings: Settings, node: str, tries: int = 40) -> None:
    """Until ``node`` leads every stream of ``LED`` (leaders step down; the cluster
    elects a new one among the replicas)."""
    async with busmod.connect(settings, name="test") as bus:
        for stream in LED:
            for _ in range(tries):
                info = await bus.js.stream_info(stream)
                if info.cluster is not None and info.cluster.leader == node:
                    break
                with contextlib.suppress(nats.errors.Error):  # mid-election: ask again
                    await bus.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
                await anyio.sleep(0.5)
            else:
                raise AssertionError(f"{node} did not become the leader of {stream}")


def test_a_killed_node_loses_no_job_result_or_span(
    cluster: list[NatsServer], tmp_path: Path, zoo_dir: Path
) -> None:
    url = ",".join(n.url for n in cluster)
    settings = Settings(
        nats_url=url, js_replicas=3, data_dir=make_data_dir(tmp_path / "data", zoo_dir)
    )
    anyio.run(provision, settings)
    # Node n0 leads the job and trace streams, so killing it forces their failover
    # (and any process connected to it reconnects to a survivor).
    anyio.run(lead_from, settings, "n0")
    server = start(settings, "server")
    agent = start(settings, "agent", "--framework", "noop", "--agent-id", "c1")
    # The client that watches talks to the nodes that survive.
    client = settings.with_(nats_url=",".join(n.url for n in cluster[1:]))
    try:
        anyio.run(wait_server, client)
        anyio.run(wait_agents, client, 1)

        async def work_replicas() -> int:  # the server made it, at the cluster's replicas
            async with busmod.connect(client, name="test") as bus:
                info = await bus.js.stream_info(f"OBJ_{names.LOADGEN_WORK_BUCKET}")
                return int(info.config.num_replicas or 1)

        assert anyio.run(work_replicas, backend="asyncio") == 3
        job = JobRequest(
            model="noop",
            framework="noop",
            trace_level="model",
            scenario=ScenarioSpec(name="online", qps=40, duration_s=10),
        )
        killed: list[float] = []

        def on_event(e: JobEvent) -> None:
            if e.event == "progress" and not killed and (e.elapsed_s or 0) > 3:
                cluster[0].kill()
                killed.append(time.time())

        first = anyio.run(
            lambda: submit(client, job, on_event=on_event, timeout=150), backend="asyncio"
        )
        assert killed and first.status == "completed"
        moved = anyio.run(leaders, client)
        assert "n0" not in moved.values(), moved  # new leaders were elected
        # A job submitted after the loss runs too (the job stream kept its quorum).
        second = anyio.run(
            lambda: submit(
                client,
                JobRequest(
                    model="noop",
                    framework="noop",
                    scenario=ScenarioSpec(name="online", qps=40, duration_s=1),
                ),
                timeout=120,
            ),
            backend="asyncio",
        )
        assert second.status == "completed" and second.errors == 0

        async def check(s: EvaluationSummary) -> None:
            async with busmod.connect(client, name="test") as bus:
                _spec, stored = await remote.evaluation(bus, s.evaluation_id)
                assert stored["evaluation_id"] == s.evaluation_id  # the result
                p = {"e": s.evaluation_id}
                missing = -1
                for _ in range(100):  # spans arrive through the R3 trace stream
                    _, rows = await remote.sql(
                        bus,
                        (
                            "SELECT count() FROM queries FINAL WHERE evaluation_id = {e:String} "
                            "AND ok = 1 AND query_index NOT IN (SELECT query_index FROM spans "
                            "FINAL WHERE evaluation_id = {e:String} AND kind = 'query')"
                        ),
                        p,
                    )
                    missing = int(rows[0][0])
                    if missing == 0:
                        break
                    await anyio.sleep(0.2)
                assert missing == 0  # every answered query has its spans
                _, rows = await remote.sql(
                    bus,
                    (
                        "SELECT count(), countIf(kind = 'query') FROM spans FINAL "
                        "WHERE evaluation_id = {e:String}"
                    ),
                    p,
                )
                total, roots = int(rows[0][0]), int(rows[0][1])
                assert roots >= s.queries - s.errors > 0 and total == 4 * roots

        for s in (first, second):
            anyio.run(check, s, backend="asyncio")
    finally:
        stop(agent, server)
