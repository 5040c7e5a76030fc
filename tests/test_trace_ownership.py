"""An agent's own credentials let it publish trace batches, in its own name, under any
evaluation id. An evaluation's spans and system samples are those of the agent it ran
on: every reader (the timeline, the layer tables, an export, ``mlscope trace``, the
API) leaves out another agent's forged under its id, and once its row is stored the
ingester dead-letters another agent's batches naming it, and goes on.

Real nats-server with per-agent users (``mlscope auth add-agent``), the server (its
ingester and SQL responder) in this process, real chDB, agents' real tracers."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pandas as pd
import pytest

from agent.tracer import Tracer
from analysis.layers import layer_kinds, layer_spans_left_out, layer_types, top_layers
from analysis.rows import spans, spans_of
from analysis.source import BusSource, joined
from analysis.trace import system_samples, timeline
from broker.db import Database
from broker.server import Server
from cli import trace_cmd
from mlscope import api
from mlscope import bus as busmod
from mlscope.agentauth import agent_creds
from mlscope.contracts import TraceLevel
from mlscope.natsserver import NatsServer
from mlscope.serving import dead_letters
from mlscope.settings import Settings
from mlscope.tracerows import trace_rows
from tests.conftest import make_data_dir
from tests.security_fixtures import issued_auth, secured_nats
from tests.stored_rows import evaluation_row, insert_evaluation

pytestmark = pytest.mark.timeout(180)

VICTIM = "ev-alice"
"""An evaluation that ran on agent alice; mallory publishes under its id too."""
QUERIES = 3
LAYERS = ("conv1", "relu1", "fc1")


@pytest.fixture
def auth(tmp_path: Path) -> Path:
    return issued_auth(tmp_path / "auth", ("add-agent", "alice"), ("add-agent", "mallory"))


@pytest.fixture
def hub(tmp_path: Path, auth: Path) -> Iterator[NatsServer]:
    with secured_nats(tmp_path / "nats", auth) as srv:
        yield srv


def _trace(tracer: Tracer, eval_id: str, prefix: str, *, op_type: str, t0: int = 0) -> None:
    """Per query a predict span and a layer span of each of :data:`LAYERS` (named
    ``prefix`` + layer) under it, and one system sample, from ``t0`` on."""
    buf = tracer.buffer(eval_id)
    for q in range(QUERIES):
        t = t0 + 1_000_000 * (q + 1)
        predict = buf.add(
            parent=0,
            query_index=q,
            level=TraceLevel.MODEL,
            kind="step",
            name="predict",
            start_ns=t,
            end_ns=t + 900_000,
        )
        for i, layer in enumerate(LAYERS):
            buf.add(
                parent=predict,
                query_index=q,
                level=TraceLevel.FRAMEWORK,
                kind="layer",
                name=prefix + layer,
                start_ns=t + 100_000 * i,
                end_ns=t + 100_000 * (i + 1),
                attrs={"op_type": op_type, "shape": [1, 8], "device": "cpu"},
            )
        tracer.samples(eval_id).add(t, "cpu.util", "cpu", 10.0 + q)


def _forge(tracer: Tracer, eval_id: str) -> None:
    """mallory's spans and samples under ``eval_id``: layers of its own names and type."""
    _trace(tracer, eval_id, "forged_", op_type="Forged", t0=5 * 10**8)


def _analysis_reads(reader: Settings) -> dict[str, Any]:
    """What the dashboard and reports read of :data:`VICTIM` (through the server, as
    they do on chDB)."""
    with BusSource(reader) as src:
        return {
            "spans": spans(src, VICTIM),
            "timeline": timeline(src, VICTIM, depth="layer", queries=QUERIES),
            "top": top_layers(src, VICTIM, n=20),
            "types": layer_types(src, VICTIM),
            "left_out": layer_spans_left_out(src, VICTIM),
            "kinds": layer_kinds(src, [VICTIM]),
            "samples": system_samples(src, VICTIM),
            "export": joined(spans_of(src, [VICTIM])),
        }


def _agents(frame: pd.DataFrame) -> set[str]:
    return set(frame["agent_id"]) if len(frame) else set()


def _stored(db: Database, table: str, eval_id: str, agent: str) -> int:
    return int(
        db.rows(
            f"SELECT count() FROM {table} FINAL WHERE evaluation_id = {{e:String}} "
            "AND agent_id = {a:String}",
            {"e": eval_id, "a": agent},
        )[0][0]
    )


def test_an_agent_cannot_add_spans_to_another_agents_evaluation(
    tmp_path: Path, hub: NatsServer, auth: Path, zoo_dir: Path
) -> None:
    settings = Settings(
        nats_url=hub.url,
        data_dir=make_data_dir(tmp_path / "data", zoo_dir),
        nats_creds=(auth / "server.creds").resolve(),
    )
    reader = settings.with_(nats_creds=(auth / "reader.creds").resolve())
    as_agent = {a: settings.with_(nats_creds=agent_creds(auth, a)) for a in ("alice", "mallory")}

    async def main() -> dict[str, Any]:
        got: dict[str, Any] = {}
        server = Server(settings)
        async with anyio.create_task_group() as tg:
            await tg.start(server.run)
            async with (
                busmod.connect(as_agent["alice"], name="alice") as alice_bus,
                busmod.connect(as_agent["mallory"], name="mallory") as mallory_bus,
            ):
                alice = Tracer(alice_bus, agent_id="alice", host="h-alice")
                mallory = Tracer(mallory_bus, agent_id="mallory", host="h-mallory")
                # While the evaluation runs (no row yet), its spans are read as stored.
                _trace(alice, VICTIM, "", op_type="Conv")
                _forge(mallory, VICTIM)
                await alice.flush()
                await mallory.flush()
                assert await server.ingester.drained(60)
                with BusSource(reader) as src:
                    running = await anyio.to_thread.run_sync(spans, src, VICTIM)
                got["running"] = _agents(running)
                # The run ends on alice: its row is stored.
                with Database(settings.dsn) as db:
                    row = evaluation_row(VICTIM, agent_id="alice", trace_level="framework")
                    insert_evaluation(db, row)
                got["reads"] = await anyio.to_thread.run_sync(_analysis_reads, reader)
                async with busmod.connect(reader, name="mlscope trace") as bus:
                    got["trace"] = await trace_cmd.fetch(bus, VICTIM)
                async with api.Client(reader) as client:
                    got["api"] = await client.spans(VICTIM)
                # Now the ingester knows whose evaluation it is: mallory's later batches
                # under it are refused, the service goes on with everyone else's.
                rejected = server.ingester.rejected
                _forge(mallory, VICTIM)
                _trace(mallory, "ev-mallory", "", op_type="Conv")  # its own: stored
                _trace(alice, VICTIM, "late_", op_type="Conv", t0=10**9)
                await mallory.flush()
                await alice.flush()
                assert await server.ingester.drained(60)
                got["refused"] = server.ingester.rejected - rejected
                got["dead"] = [d.error for d in (await dead_letters(server.bus))[1]]
                with Database(settings.dsn) as db:
                    got["stored"] = {
                        (t, e, a): _stored(db, t, e, a)
                        for t in ("spans", "system_samples")
                        for e, a in (
                            (VICTIM, "alice"),
                            (VICTIM, "mallory"),
                            ("ev-mallory", "mallory"),
                        )
                    }
            tg.cancel_scope.cancel()
        return got

    got = anyio.run(main, backend="asyncio")
    per_query = 1 + len(LAYERS)
    assert "alice" in got["running"]  # an evaluation in progress: its spans readable

    reads = got["reads"]
    assert _agents(reads["spans"]) == {"alice"} and len(reads["spans"]) == QUERIES * per_query
    assert _agents(reads["export"]) == {"alice"}
    assert not any(str(n).startswith("forged") for n in reads["timeline"]["name"])
    assert len(reads["timeline"]) == QUERIES * per_query
    top = reads["top"]
    assert sorted(top["layer"]) == sorted(LAYERS) and set(top["calls"]) == {QUERIES}
    assert list(reads["types"]["op_type"]) == ["Conv"]
    assert int(reads["types"]["calls"].sum()) == QUERIES * len(LAYERS)
    assert reads["left_out"] == 0 and reads["kinds"] == {VICTIM: "layer"}
    assert _agents(reads["samples"]) == {"alice"} and len(reads["samples"]) == QUERIES

    _, _, trace_spans, trace_samples = got["trace"]
    assert {s["agent_id"] for s in trace_spans} == {"alice"}
    assert len(trace_spans) == QUERIES * per_query
    assert {s["agent_id"] for s in trace_samples} == {"alice"}
    assert _agents(got["api"]) == {"alice"} and len(got["api"]) == QUERIES * per_query

    stored = got["stored"]
    assert got["refused"] == 2  # mallory's later span and sample batch under alice's run
    assert stored[("spans", VICTIM, "mallory")] == QUERIES * per_query  # the first only
    assert stored[("system_samples", VICTIM, "mallory")] == QUERIES
    assert stored[("spans", VICTIM, "alice")] == 2 * QUERIES * per_query  # late ones too
    assert stored[("system_samples", VICTIM, "alice")] == 2 * QUERIES
    assert stored[("spans", "ev-mallory", "mallory")] == QUERIES * per_query
    assert stored[("system_samples", "ev-mallory", "mallory")] == QUERIES
    refusals = [e for e in got["dead"] if f"evaluation {VICTIM} ran on agent alice" in e]
    assert len(refusals) == 2 and all("not on mallory" in e for e in refusals)


def test_every_reader_of_trace_rows_goes_through_trace_rows() -> None:
    """No product module names a trace table in a read of its own: each takes an
    evaluation's rows through :func:`mlscope.tracerows.trace_rows`."""
    root = Path(__file__).resolve().parent.parent
    direct = re.compile(r"\bFROM\s+(spans|system_samples)\b", re.IGNORECASE)
    found = [
        f"{path.relative_to(root)}:{n}"
        for package in ("mlscope", "agent", "broker", "analysis", "dashboard", "cli")
        for path in sorted((root / package).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if direct.search(line)
    ]
    assert found == []
    assert trace_rows("spans").startswith("spans FINAL WHERE evaluation_id = {e:String} AND (")
    with pytest.raises(ValueError, match="not a trace table"):
        trace_rows("queries")
