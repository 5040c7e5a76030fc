"""Each agent's trace budget: the traces stream keeps at most
:data:`~mlscope.provision.AGENT_TRACE_BATCHES` batches of one agent not yet stored (its
subject transform stores every evaluation's batches of an agent under one subject, and
the per-subject limit refuses new ones). An agent flooding its own subject is refused
past its budget, and counts what was refused, while another agent's spans are all
stored; the ingester's purge below its ack floor frees the budget again. A stream made
by an older configuration is updated in place, its edge sources and batches kept.

Real nats-server, real chDB, the server's ingester."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from nats.js.api import (
    DiscardPolicy,
    ExternalStream,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamSource,
)

from agent.service import Agent, AgentConfig
from agent.tracer import Tracer
from broker.db import Database
from broker.evalsummary import budget_warnings
from broker.ingest import Ingester
from mlscope import bus as busmod
from mlscope import names, provision
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.contracts import TraceLevel
from mlscope.provision import AGENT_TRACE_BATCHES, ensure_infrastructure
from mlscope.settings import Settings
from tests.agent_fixtures import Ask, run_agent

pytestmark = pytest.mark.timeout(120)

EXTRA = 5
"""Batches the flooder publishes past its budget."""


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    with Database(f"chdb:///{tmp_path / 'db'}") as d:
        d.migrate()
        yield d


def _span(tracer: Tracer, eval_id: str, i: int) -> None:
    tracer.buffer(eval_id).add(
        parent=0,
        query_index=i,
        level=TraceLevel.MODEL,
        kind="model",
        name="predict",
        start_ns=i,
        end_ns=i + 1,
    )


async def _batches(tracer: Tracer, eval_id: str, n: int) -> None:
    """``n`` batches of one span each (one flush publishes one batch)."""
    for i in range(n):
        _span(tracer, eval_id, i)
        await tracer.flush()


async def _count(db: Database, eval_id: str, want: int, timeout: float = 30.0) -> int:
    query = "SELECT count() FROM spans FINAL WHERE evaluation_id = {e:String}"
    with anyio.move_on_after(timeout):
        while int(db.rows(query, {"e": eval_id})[0][0]) < want:
            await anyio.sleep(0.1)
    return int(db.rows(query, {"e": eval_id})[0][0])


def test_a_flooding_agent_is_refused_past_its_budget_and_no_one_else(
    settings: Settings, db: Database
) -> None:
    async def main() -> tuple[Tracer, Tracer, int, int, int]:
        async with provision.provisioned(settings, name="test") as bus:
            flooder = Tracer(bus, agent_id="flooder", host="h")
            honest = Tracer(bus, agent_id="honest", host="h")
            # No ingester yet: the flooder's batches stay in the stream; a second
            # evaluation of its own shares its budget.
            await _batches(flooder, "ev-flood-1", AGENT_TRACE_BATCHES // 2)
            await _batches(flooder, "ev-flood-2", AGENT_TRACE_BATCHES // 2 + EXTRA)
            await _batches(honest, "ev-honest", 20)
            ingester = Ingester(bus, db, trim_s=0.2)
            async with anyio.create_task_group() as tg:
                tg.start_soon(ingester.run)
                honest_stored = await _count(db, "ev-honest", 20)
                assert await ingester.drained(60)
                with anyio.fail_after(30):  # stored batches purged: the budget is free
                    while ingester.trimmed_below <= AGENT_TRACE_BATCHES + 20:
                        await anyio.sleep(0.1)
                await _batches(flooder, "ev-flood-3", 3)
                flooder_later = await _count(db, "ev-flood-3", 3)
                tg.cancel_scope.cancel()
            flooded = await _count(db, "ev-flood-2", 0, timeout=0)
            return flooder, honest, honest_stored, flooded, flooder_later

    flooder, honest, honest_stored, flooded, flooder_later = anyio.run(main, backend="asyncio")
    assert honest_stored == 20 and not honest.refused
    assert flooder.refused == {"ev-flood-2": EXTRA}
    assert flooded == AGENT_TRACE_BATCHES // 2 and flooder.published == AGENT_TRACE_BATCHES + 3
    assert flooder_later == 3 and flooder.refused == {"ev-flood-2": EXTRA}


def test_refused_batches_are_a_warning_of_the_evaluation() -> None:
    (warning,) = budget_warnings({"span_batches_refused": EXTRA})
    assert warning.startswith(f"{EXTRA} span batches refused: the agent's trace budget")
    assert f"({AGENT_TRACE_BATCHES} batches not yet stored) was full" in warning
    assert budget_warnings({}) == () and budget_warnings({"span_batches_refused": 0}) == ()


def _old_traces_stream() -> StreamConfig:
    """``MLSCOPE_TRACES`` as an older mlscope made it, with an edge source attached."""
    return StreamConfig(
        name=names.TRACES_STREAM,
        subjects=[names.traces_wildcard()],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        max_age=provision.TRACES_MAX_AGE_S,
        max_bytes=provision.TRACES_MAX_BYTES,
        duplicate_window=120.0,
        sources=[
            StreamSource(
                name=provision.EDGE_TRACES_STREAM,
                filter_subject=names.agent_traces("edge-1"),
                external=ExternalStream(api="$JS.e1.API"),
            )
        ],
    )


def test_a_traces_stream_of_an_older_configuration_is_updated_in_place(
    settings: Settings, db: Database
) -> None:
    async def main() -> tuple[StreamConfig, int, int]:
        async with busmod.connect(settings, name="test") as bus:
            await bus.js.add_stream(_old_traces_stream())
            tracer = Tracer(bus, agent_id="a1", host="h")
            await _batches(tracer, "ev-old", 2)  # stored under the old subjects
            await ensure_infrastructure(bus)
            info = await bus.js.stream_info(names.TRACES_STREAM)
            await _batches(tracer, "ev-old", 1)  # under the new one
            ingester = Ingester(bus, db)
            async with anyio.create_task_group() as tg:
                tg.start_soon(ingester.run)
                stored = await _count(db, "ev-old", 3)
                tg.cancel_scope.cancel()
            return info.config, info.state.messages, stored

    cfg, kept, stored = anyio.run(main, backend="asyncio")
    src, dest = names.STORED_TRACES_TRANSFORM
    assert cfg.subject_transform is not None
    assert (cfg.subject_transform.src, cfg.subject_transform.dest) == (src, dest)
    assert cfg.discard == DiscardPolicy.NEW and cfg.discard_new_per_subject
    assert cfg.max_msgs_per_subject == AGENT_TRACE_BATCHES
    assert cfg.max_msg_size == provision.TRACE_BATCH_MAX_BYTES
    (source,) = cfg.sources or []
    assert source.filter_subject == names.agent_traces("edge-1")
    assert kept == 2 and stored == 3


def test_an_evaluations_release_reports_its_refused_batches(settings: Settings) -> None:
    """What the tracer counted for an evaluation is in its release reply, once."""
    agent = Agent(settings, AgentConfig(framework="noop"), Catalog.load(default_manifest_dirs()))

    async def body(bus: busmod.Bus, ask: Ask) -> None:
        agent.tracer.refused["ev-r"] = EXTRA
        assert (await ask({"op": "release", "evaluation_id": "ev-r"}))[
            "span_batches_refused"
        ] == EXTRA
        assert (await ask({"op": "release", "evaluation_id": "ev-r"}))["span_batches_refused"] == 0

    anyio.run(_provision, settings)
    run_agent(settings, agent, body)


async def _provision(settings: Settings) -> None:
    async with provision.provisioned(settings, name="test"):
        pass
