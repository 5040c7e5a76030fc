"""Per-agent identities (`mlscope auth add-agent`): an agent's user hears only its own
query and control subjects, writes only its own registry key, and a rogue agent cannot
receive another agent's queries or answer them, on a real stack with ``--auth``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import nats
import nats.aio.msg
import nats.errors
import pytest

from cli.main import main as mlscope_main
from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import codec, names, remote
from mlscope.agentauth import add_agent, agent_creds, agent_inbox_prefix, reload_server
from mlscope.auth import INBOX_PREFIXES
from mlscope.auth_files import inbox_prefix_for
from mlscope.contracts import EvaluationSummary, JobRequest, ScenarioSpec
from mlscope.jobs import submit
from mlscope.natsserver import NatsServer, cluster_config, free_port, hub_config
from mlscope.registry import list_agents
from tests.security_fixtures import auth_stack, issued_auth, role, secured_nats
from tests.test_auth import Probe

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def auth_dir(tmp_path: Path) -> Path:
    mallory = ("add-agent", "mallory", "--framework", "noop")
    return issued_auth(tmp_path / "auth", ("add-agent", "alice"), mallory)


@pytest.fixture
def server(tmp_path: Path, auth_dir: Path) -> Iterator[NatsServer]:
    with secured_nats(tmp_path / "nats", auth_dir) as srv:
        yield srv


def test_an_agent_user_is_bound_to_its_own_subjects(server: NatsServer, auth_dir: Path) -> None:
    mallory = agent_creds(auth_dir, "mallory")
    assert mallory.stat().st_mode & 0o077 == 0
    assert inbox_prefix_for(mallory) == agent_inbox_prefix("mallory")

    async def main() -> None:
        async with Probe(server.url, mallory) as probe:
            for subject in (
                names.agent_query("alice"),
                names.agent_ctl("alice"),
                names.agent_query("*"),
                "mlscope.agent.>",
            ):
                assert await probe.denied_subscribe(subject), subject
                assert await probe.denied_subscribe(subject, queue="q"), subject
            for inbox in (
                agent_inbox_prefix("alice"),
                INBOX_PREFIXES["server"],
                INBOX_PREFIXES["agent"],
            ):
                assert await probe.denied_subscribe(f"{inbox}.>"), inbox
            assert await probe.denied_publish(f"$KV.{names.AGENTS_BUCKET}.alice", b"{}")
            assert await probe.denied_publish(f"{INBOX_PREFIXES['server']}.lg-run.1")
            other_cap = names.capability("onnxruntime", "digits_cnn")
            assert await probe.denied_subscribe(other_cap, queue=other_cap)
            own_cap = names.capability("noop", "noop")
            assert await probe.denied_subscribe(own_cap)  # only as its queue group
            assert not await probe.denied_subscribe(own_cap, queue=own_cap)
            assert not await probe.denied_subscribe(names.agent_query("mallory"))
            assert not await probe.denied_subscribe(names.agent_ctl("mallory"))
            assert not await probe.denied_publish(f"$KV.{names.AGENTS_BUCKET}.mallory", b"{}")
            # the rows of its own local runs only: no forged rows in alice's name
            assert await probe.denied_publish(names.agent_rows("alice", "ev-1"))
            assert not await probe.denied_publish(names.agent_rows("mallory", "ev-1"))

    anyio.run(main, backend="asyncio")


async def _connect(url: str, creds: Path) -> None:
    nc = await nats.connect(
        url,
        nkeys_seed=str(creds),
        allow_reconnect=False,
        connect_timeout=2,
        max_reconnect_attempts=0,
        inbox_prefix=inbox_prefix_for(creds) or "_INBOX",
    )
    await nc.close()


async def _admitted(url: str, creds: Path, timeout: float = 5.0) -> None:
    """Until ``creds`` may connect (a reload is applied asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await _connect(url, creds)
        except (nats.errors.Error, OSError):
            if time.monotonic() > deadline:
                raise
            await anyio.sleep(0.1)


def test_a_new_agent_is_admitted_on_reload(server: NatsServer, auth_dir: Path) -> None:
    carol = add_agent(auth_dir, "carol")
    with pytest.raises((nats.errors.Error, OSError)):  # not loaded yet: refused
        anyio.run(_connect, server.url, carol, backend="asyncio")
    assert server.proc is not None
    assert (
        mlscope_main(
            ["auth", "add-agent", "carol", "--out", str(auth_dir), "--reload", str(server.proc.pid)]
        )
        == 0
    )
    anyio.run(_admitted, server.url, agent_creds(auth_dir, "carol"), backend="asyncio")
    roles = json.loads((auth_dir / "roles.json").read_text())
    assert set(roles["agents"]) == {"alice", "mallory", "carol"}
    with pytest.raises(ValueError, match="one subject token"):
        add_agent(auth_dir, "a.b")


def test_a_hub_or_cluster_node_follows_add_agent_on_reload(tmp_path: Path, auth_dir: Path) -> None:
    """A hub (edge leaf listener) or a cluster node runs a config of its own that
    includes the auth directory's server.conf: a reload admits an agent added since,
    and a key replaced by adding the name again stops working (revocation)."""
    hub_conf = tmp_path / "hub" / "hub.conf"
    hub_conf.parent.mkdir()
    hub_conf.write_text(
        hub_config(
            leaf_port=free_port(), host="127.0.0.1", include=auth_dir / "server.conf", at=hub_conf
        )
    )
    node_conf, route_port = tmp_path / "node.conf", free_port()
    node_conf.write_text(
        cluster_config(
            name="c",
            node="n1",
            cluster_port=route_port,
            routes=[f"nats-route://127.0.0.1:{route_port}"],  # itself: JetStream needs one
            host="127.0.0.1",
            include=auth_dir / "server.conf",
            at=node_conf,
        )
    )
    with pytest.raises(ValueError, match="at"):
        hub_config(leaf_port=1, include=auth_dir / "server.conf")
    for i, conf in enumerate((hub_conf, node_conf)):
        with NatsServer(store_dir=tmp_path / f"nats{i}", config_file=conf) as srv:
            assert srv.proc is not None
            old = (agent_creds(auth_dir, "alice")).read_bytes()
            anyio.run(_connect, srv.url, agent_creds(auth_dir, "alice"), backend="asyncio")
            name = f"dave{i}"
            add_agent(auth_dir, name)
            reload_server(srv.proc.pid)
            anyio.run(_admitted, srv.url, agent_creds(auth_dir, name), backend="asyncio")
            stale = tmp_path / f"stale{i}" / "alice.creds"  # the key alice held before
            stale.parent.mkdir()
            stale.write_bytes(old)
            add_agent(auth_dir, "alice")  # re-issued: the old key must stop working
            reload_server(srv.proc.pid)
            anyio.run(_admitted, srv.url, agent_creds(auth_dir, "alice"), backend="asyncio")
            with pytest.raises((nats.errors.Error, OSError)):
                anyio.run(_connect, srv.url, stale, backend="asyncio")


def test_a_rogue_agent_cannot_take_another_agents_queries(
    tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path
) -> None:
    base = tmp_path_factory.mktemp("rogue")
    with auth_stack(base, zoo_dir, ["noop"]) as (stack, auth):
        assert stack.nats.proc is not None
        assert (
            mlscope_main(
                [
                    "auth",
                    "add-agent",
                    "rogue",
                    "--out",
                    str(auth),
                    "--framework",
                    "noop",
                    "--reload",
                    str(stack.nats.proc.pid),
                ]
            )
            == 0
        )
        rogue = agent_creds(auth, "rogue")
        submitter = role(stack, auth, "submitter")
        heard: list[str] = []

        async def record(msg: nats.aio.msg.Msg) -> None:
            heard.append(msg.subject)
            await msg.respond(b"forged")  # it would answer first if it could hear

        async def main() -> EvaluationSummary:
            # The reload is over once the new user is admitted: a connection made while
            # nats-server reloads its users may be closed by it.
            await _admitted(stack.settings.nats_url, rogue)
            async with busmod.connect(submitter, name="test") as bus:
                (victim,) = await list_agents(bus)
            assert victim.agent_id.endswith("-noop")  # its own identity, from `up --auth`
            async with Probe(stack.settings.nats_url, rogue) as probe:
                for subject in (
                    names.agent_query(victim.agent_id),
                    names.agent_ctl(victim.agent_id),
                ):
                    before = len(probe.violations)
                    await probe.nc.subscribe(subject, cb=record)
                    await probe.nc.subscribe(subject, queue=subject, cb=record)
                    await probe.nc.flush()
                    await anyio.sleep(0.1)
                    assert len(probe.violations) == before + 2, subject
                assert await probe.denied_publish(
                    f"$KV.{names.AGENTS_BUCKET}.{victim.agent_id}", b"{}"
                )
                return await submit(
                    submitter,
                    JobRequest(
                        model="noop",
                        framework="noop",
                        scenario=ScenarioSpec(name="online", qps=100, duration_s=1, seed=1),
                    ),
                )

        summary = anyio.run(main, backend="asyncio")
        assert heard == []
        assert summary.status == "completed" and summary.errors == 0
        assert summary.queries >= 80
        assert anyio.run(_forge_spans, stack, auth, rogue, summary, backend="asyncio") == [
            "their own"
        ]
        assert not stack.dead()


async def _forge_spans(
    stack: Stack, auth: Path, rogue: Path, summary: EvaluationSummary
) -> list[str]:
    """The rogue rewrites one of the victim's stored spans, on the victim's trace subject
    (refused by the server) and on its own (refused by the ingester); then an honest
    batch of its own, under an evaluation of its own (the victim's, stored as run on the
    victim, takes no other agent's), follows as a control. Returns the control span's
    stored names, once it landed, after checking that the victim's span is as it was."""
    ev, victim = summary.evaluation_id, summary.agent_id
    own_ev = f"{ev}-rogue"
    one = (
        "SELECT span_id, name FROM spans FINAL WHERE evaluation_id = {e:String} "
        "AND agent_id = {a:String} AND span_id >= {s:UInt64} ORDER BY span_id LIMIT 1"
    )

    def batch(agent_id: str, span_id: int, name: str, batch_id: str, e: str = ev) -> bytes:
        cols: dict[str, list[object]] = {"span_id": [span_id], "parent_id": [0]}
        cols |= {
            "query_index": [0],
            "level": [1],
            "kind": ["query"],
            "name": [name],
            "start_ns": [1],
            "end_ns": [2],
            "attrs": [""],
        }
        msg = {"kind": "spans", "evaluation_id": e, "agent_id": agent_id, "host": "h"}
        return codec.encode({**msg, "batch_id": batch_id, "columns": cols})

    async with busmod.connect(role(stack, auth, "reader"), name="test") as reader:
        rows: list[list[Any]] = []
        with anyio.fail_after(60):  # the victim's spans are stored after its summary
            while not rows:
                _, rows = await remote.sql(reader, one, {"e": ev, "a": victim, "s": 0})
                await anyio.sleep(0.2)
        (span_id, name), *_ = rows
        async with Probe(stack.settings.nats_url, rogue) as probe:
            forged = batch(victim, span_id, "FORGED", "sb-forged-1")
            assert await probe.denied_publish(names.traces(ev, victim), forged)
            assert not await probe.denied_publish(names.traces(ev, "rogue"), forged)
            own = batch("rogue", 1, "their own", "sb-own-1", own_ev)
            assert not await probe.denied_publish(names.traces(own_ev, "rogue"), own)
        control: list[list[object]] = []
        with anyio.fail_after(60):  # batches are stored in order: the forged one was seen
            while not control:
                _, control = await remote.sql(reader, one, {"e": own_ev, "a": "rogue", "s": 0})
                await anyio.sleep(0.2)
        _, after = await remote.sql(reader, one, {"e": ev, "a": victim, "s": span_id})
        assert after == [[span_id, name]]
        return [str(r[1]) for r in control]


def test_an_agent_takes_its_credentials_id_and_refuses_another(auth_dir: Path) -> None:
    """Before it connects: an agent run with another agent's own credentials is
    refused naming the id they belong to; with no --agent-id it takes theirs."""
    from agent.service import Agent, AgentConfig
    from mlscope.catalog import Catalog, default_manifest_dirs
    from mlscope.errors import ConfigError
    from mlscope.settings import Settings

    catalog = Catalog.load(default_manifest_dirs())
    as_alice = Settings(nats_url="nats://127.0.0.1:1", nats_creds=agent_creds(auth_dir, "alice"))
    with pytest.raises(ConfigError, match="--agent-id alice"):
        Agent(as_alice, AgentConfig(framework="noop", agent_id="mallory"), catalog)
    assert Agent(as_alice, AgentConfig(framework="noop", agent_id="alice"), catalog).agent_id == (
        "alice"
    )
    assert Agent(as_alice, AgentConfig(framework="noop"), catalog).agent_id == "alice"
    shared = as_alice.with_(nats_creds=auth_dir / "agent.creds")  # the role-wide user
    assert Agent(shared, AgentConfig(framework="noop", agent_id="mallory"), catalog).agent_id == (
        "mallory"
    )
