"""An edge agent behind a leaf node: its link to the hub is cut for 10 seconds in the
middle of an evaluation, and every span it recorded reaches the hub's database; and
``mlscope edge up`` stopped by SIGTERM leaves neither its leaf nor its agent behind."""

from __future__ import annotations

import signal
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import psutil
import pytest
from nats.js.api import ExternalStream, StreamSource

from broker.db import Database
from broker.ingest import Ingester
from cli.edge_cmd import EDGE_AGENT_ID, attach_agent_id, create_edge_stream, read_env
from cli.main import main as mlscope_main
from mlscope import bus as busmod
from mlscope import codec, names, provision, remote
from mlscope.auth import INBOX_PREFIXES
from mlscope.contracts import (
    AgentDescription,
    JobEvent,
    JobRequest,
    Query,
    ScenarioSpec,
    SpanBatch,
)
from mlscope.errors import ConfigError
from mlscope.jobs import submit
from mlscope.natsserver import NatsServer, free_port, hub_config
from mlscope.provision import provisioned
from mlscope.serving import dead_letters
from mlscope.settings import Settings
from tests.conftest import child_env, make_data_dir, python, wait_agents, wait_server
from tests.scale_fixtures import CuttableLink, start, stop
from tests.stored_rows import span_batch

pytestmark = pytest.mark.timeout(200)
CUT_S = 10.0


async def leaf_spans(leaf_url: str, eval_id: str) -> int:
    """Spans of one evaluation buffered in the leaf's own stream."""
    total = 0
    async with busmod.connect(Settings(nats_url=leaf_url), name="test-leaf") as bus:
        sub = await bus.js.subscribe(
            names.evaluation_traces(eval_id),
            stream=provision.EDGE_TRACES_STREAM,
            ordered_consumer=True,
        )
        pending = (await bus.js.stream_info(provision.EDGE_TRACES_STREAM)).state.messages
        for _ in range(pending):
            try:
                msg = await sub.next_msg(timeout=2)
            except TimeoutError:
                break
            total += len(codec.decode_model(SpanBatch, msg.data))
    return total


@contextmanager
def edge_agent(
    server_settings: Settings, client: Settings, edge_settings: Settings, leaf_url: str
) -> Iterator[list[AgentDescription]]:
    """The hub's server, the leaf's span buffer sourced by the hub, and the noop agent
    ``edge-1`` on the device; yields the registry once the hub sees the agent, and
    stops the agent and the server after."""
    server = start(server_settings, "server")
    agent = None
    try:
        anyio.run(wait_server, client)
        anyio.run(create_edge_stream, leaf_url)
        anyio.run(_attach, server_settings)
        agent = start(edge_settings, "agent", "--framework", "noop", "--agent-id", "edge-1")
        yield anyio.run(wait_agents, client, 1)
    finally:
        stop(agent, server)


async def hub_spans(settings: Settings, eval_id: str, at_least: int) -> int:
    """Spans of one evaluation in the hub's database, once there are ``at_least`` (or
    what there is after 30 s)."""
    async with busmod.connect(settings, name="test") as bus:
        for _ in range(150):
            _, rows = await remote.sql(
                bus,
                "SELECT count() FROM spans FINAL WHERE evaluation_id = {e:String}",
                {"e": eval_id},
            )
            if int(rows[0][0]) >= at_least:
                break
            await anyio.sleep(0.2)
        return int(rows[0][0])


def test_spans_recorded_while_the_link_is_down_arrive_after(tmp_path: Path, zoo_dir: Path) -> None:
    leaf_port = free_port()
    (tmp_path / "hub.conf").write_text(hub_config(leaf_port=leaf_port, host="127.0.0.1"))
    link = CuttableLink(leaf_port)
    edge_dir = tmp_path / "edge"
    assert (
        mlscope_main(
            [
                "edge",
                "init",
                "--hub",
                f"nats-leaf://127.0.0.1:{link.port}",
                "--out",
                str(edge_dir),
                "--domain",
                "e1",
                "--port",
                "0",
            ]
        )
        == 0
    )
    hub = NatsServer(store_dir=tmp_path / "hub", config_file=tmp_path / "hub.conf").start()
    leaf = NatsServer(store_dir=tmp_path / "leaf", config_file=edge_dir / "leaf.conf").start()
    hub_settings = Settings(nats_url=hub.url, data_dir=make_data_dir(tmp_path / "d", zoo_dir))
    edge_settings = hub_settings.with_(
        nats_url=leaf.url, js_domain="hub", data_dir=make_data_dir(tmp_path / "e", zoo_dir)
    )
    try:
        with edge_agent(hub_settings, hub_settings, edge_settings, leaf.url) as agents:
            assert agents[0].agent_id == "edge-1" and agents[0].arch and agents[0].cpu_model

            job = JobRequest(
                model="noop",
                framework="noop",
                trace_level="model",
                scenario=ScenarioSpec(name="online", qps=40, duration_s=18),
            )
            seen: dict[str, str] = {}
            offline = {"sent": 0, "answered": 0}

            def on_event(e: JobEvent) -> None:
                if e.event == "progress" and e.evaluation_id:
                    seen.setdefault("eval", e.evaluation_id)

            async def cut_mid_run() -> None:
                while "eval" not in seen:
                    await anyio.sleep(0.1)
                await anyio.sleep(3)
                link.cut()
                # The device keeps working locally while the hub is unreachable.
                async with busmod.connect(edge_settings, name="local-driver") as bus:
                    t_end = anyio.current_time() + CUT_S
                    i = 1_000_000
                    while anyio.current_time() < t_end:
                        q = Query(
                            evaluation_id=seen["eval"],
                            index=i,
                            inputs=np.zeros((1, 16), np.float32),
                            trace_level=1,
                        )
                        offline["sent"] += 1
                        reply = codec.decode(
                            (
                                await bus.nc.request(
                                    names.agent_query("edge-1"), codec.encode_model(q), timeout=5
                                )
                            ).data
                        )
                        offline["answered"] += reply.get("ok") is True
                        i += 1
                        await anyio.sleep(0.1)
                link.restore()

            async def main() -> object:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(cut_mid_run)
                    summary = await submit(hub_settings, job, on_event=on_event, timeout=150)
                return summary

            summary = anyio.run(main, backend="asyncio")
            assert summary.status == "completed"  # type: ignore[attr-defined]
            assert offline["answered"] == offline["sent"] >= 50
            eval_id = seen["eval"]
            expected = anyio.run(leaf_spans, leaf.url, eval_id)
            # 4 spans per answered query, the offline ones among them
            assert expected >= 4 * offline["answered"]
            assert anyio.run(hub_spans, hub_settings, eval_id, expected) == expected
    finally:
        link.cut()
        leaf.stop()
        hub.stop()


async def _attach(settings: Settings) -> None:
    async with busmod.connect(settings, name="test") as bus:
        await provision.attach_edge(bus, "e1", "edge-1")


def test_edge_agent_behind_its_leaf_runs_under_edge_credentials(
    tmp_path: Path, zoo_dir: Path
) -> None:
    """The hub has the users of ``mlscope auth init``; the leaf links with edge.creds.

    The agent on the device connects to its leaf without credentials, with the edge
    role's inbox prefix from edge.env: its registry writes, its replies to the hub's
    queries and its buffered spans all cross the link under the edge user's
    permissions, and the hub logs no permission violation.
    """
    auth = tmp_path / "auth"
    assert (
        mlscope_main(
            ["auth", "init", "--out", str(auth), "--edge-id", "edge-1", "--edge-domain", "e1"]
        )
        == 0
    )
    leaf_port = free_port()
    (tmp_path / "hub.conf").write_text(
        hub_config(
            leaf_port=leaf_port,
            host="127.0.0.1",
            include=auth / "server.conf",
            at=tmp_path / "hub.conf",
        )
    )
    edge_dir = tmp_path / "edge"
    assert (
        mlscope_main(
            [
                "edge",
                "init",
                "--hub",
                f"nats-leaf://127.0.0.1:{leaf_port}",
                "--out",
                str(edge_dir),
                "--domain",
                "e1",
                "--port",
                "0",
                "--creds",
                str(auth / "edge.creds"),
            ]
        )
        == 0
    )
    edge_env = read_env(edge_dir)
    assert edge_env["MLSCOPE_NATS_INBOX_PREFIX"] == INBOX_PREFIXES["edge"]
    # leaf.conf carries the edge seed, so only its owner (and the leaf it runs) reads it
    assert stat.S_IMODE((edge_dir / "leaf.conf").stat().st_mode) == 0o600
    hub_log = tmp_path / "hub.log"
    hub = NatsServer(
        store_dir=tmp_path / "hub", config_file=tmp_path / "hub.conf", log_file=hub_log
    ).start()
    leaf = NatsServer(store_dir=tmp_path / "leaf", config_file=edge_dir / "leaf.conf").start()
    data = make_data_dir(tmp_path / "d", zoo_dir)
    server_settings = Settings(nats_url=hub.url, data_dir=data, nats_creds=auth / "server.creds")
    client = server_settings.with_(nats_creds=auth / "submitter.creds")
    edge_settings = Settings(
        nats_url=leaf.url,
        js_domain=edge_env["MLSCOPE_JS_DOMAIN"],
        nats_inbox_prefix=edge_env["MLSCOPE_NATS_INBOX_PREFIX"],
        data_dir=make_data_dir(tmp_path / "e", zoo_dir),
    )
    try:
        with edge_agent(server_settings, client, edge_settings, leaf.url):
            job = JobRequest(
                model="noop",
                framework="noop",
                trace_level="model",
                scenario=ScenarioSpec(name="online", qps=40, duration_s=2),
            )
            summary = anyio.run(lambda: submit(client, job, timeout=60), backend="asyncio")
            assert summary.status == "completed" and summary.errors == 0
            assert summary.queries >= 60

            assert (
                anyio.run(hub_spans, client, summary.evaluation_id, 4 * summary.queries)
                >= 4 * summary.queries
            )
            assert "violation" not in hub_log.read_text().lower()
    finally:
        leaf.stop()
        hub.stop()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_edge_up_stopped_or_killed_stops_its_agent_and_its_leaf(
    tmp_path: Path, signum: int
) -> None:
    """systemd, ``docker stop`` and ``kill`` send SIGTERM: ``edge up`` stops its agent
    and its leaf (a session of its own, which no signal to ``edge up`` reaches) first.
    Killed outright (``kill -9``, the OOM killer), it leaves neither running."""
    leaf_port = free_port()
    (tmp_path / "hub.conf").write_text(hub_config(leaf_port=leaf_port, host="127.0.0.1"))
    edge_dir = tmp_path / "edge"
    hub_link = f"nats-leaf://127.0.0.1:{leaf_port}"
    init = ["edge", "init", "--hub", hub_link, "--out", str(edge_dir), "--domain", "e1"]
    assert mlscope_main([*init, "--port", str(free_port())]) == 0
    hub = NatsServer(store_dir=tmp_path / "hub", config_file=tmp_path / "hub.conf").start()
    hub_settings = Settings(nats_url=hub.url, data_dir=tmp_path / "hubdata")
    edge = None
    children: list[psutil.Process] = []
    try:
        anyio.run(_provision, hub_settings)
        up = ["edge", "up", "--dir", str(edge_dir), "--framework", "noop", "--agent-id", "edge-1"]
        edge = subprocess.Popen(
            [python(), "-m", "cli.main", *up],
            env=child_env(Settings(data_dir=tmp_path / "edgedata")),
        )
        anyio.run(wait_agents, hub_settings, 1)
        children = psutil.Process(edge.pid).children()
        assert len(children) == 2  # the leaf and the agent
        edge.send_signal(signum)
        assert edge.wait(40) == (128 + signum if signum == signal.SIGTERM else -signum)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"left running: {[p.cmdline()[:4] for p in alive]}"
    finally:
        for p in children:
            if p.is_running():
                p.kill()
        if edge is not None and edge.poll() is None:
            edge.kill()
            edge.wait()
        hub.stop()


async def _provision(settings: Settings) -> None:
    """The hub's streams and buckets, as its server would create them."""
    async with provisioned(settings, name="test"):
        pass


def _secured_hub(tmp_path: Path, edge_id: str) -> tuple[Path, int, Path]:
    """``mlscope auth init`` for edge ``edge_id`` of domain e1, and a hub config that
    includes its server.conf: the auth directory, the hub's leaf port, its config."""
    auth = tmp_path / "auth"
    init_auth = ["auth", "init", "--out", str(auth), "--edge-id", edge_id, "--edge-domain", "e1"]
    assert mlscope_main(init_auth) == 0
    leaf_port = free_port()
    hub_conf = tmp_path / "hub.conf"
    hub_conf.write_text(
        hub_config(leaf_port=leaf_port, host="127.0.0.1", include=auth / "server.conf", at=hub_conf)
    )
    return auth, leaf_port, hub_conf


def test_edge_up_under_edge_credentials_runs_the_agent_under_their_id(tmp_path: Path) -> None:
    """The edge user may write only its own id's registry key and spans: ``edge init
    --creds`` records that id and ``edge up`` runs the agent under it, as its printed
    hint (``mlscope edge up --dir DIR``) says; another ``--agent-id`` is refused before
    anything starts, instead of an agent that is never advertised."""
    auth, leaf_port, hub_conf = _secured_hub(tmp_path, "dev-7")
    edge_dir = tmp_path / "edge"
    hub_link = f"nats-leaf://127.0.0.1:{leaf_port}"
    init = ["edge", "init", "--hub", hub_link, "--out", str(edge_dir), "--domain", "e1"]
    assert (
        mlscope_main([*init, "--port", str(free_port()), "--creds", str(auth / "edge.creds")]) == 0
    )
    assert read_env(edge_dir)[EDGE_AGENT_ID] == "dev-7"
    up = ["edge", "up", "--dir", str(edge_dir), "--framework", "noop"]
    assert mlscope_main([*up, "--agent-id", "dev-8"]) == 1  # refused, nothing started
    hub = NatsServer(store_dir=tmp_path / "hub", config_file=hub_conf).start()
    server = Settings(
        nats_url=hub.url, data_dir=tmp_path / "hubdata", nats_creds=auth / "server.creds"
    )
    edge = None
    try:
        anyio.run(_provision, server)
        edge = subprocess.Popen(
            [python(), "-m", "cli.main", *up],
            env=child_env(Settings(data_dir=tmp_path / "edgedata")),
        )
        reader = server.with_(nats_creds=auth / "reader.creds")
        (agent,) = anyio.run(wait_agents, reader, 1)
        assert agent.agent_id == "dev-7"
    finally:
        if edge is not None:
            edge.send_signal(signal.SIGTERM)
            edge.wait(40)
        hub.stop()


def _batch(eval_id: str, agent_id: str, first: int, n: int = 3) -> bytes:
    return codec.encode_model(span_batch(eval_id, first, n, agent_id=agent_id, host="device"))


async def _forge(leaf_url: str, eval_id: str) -> None:
    """What a hostile device can put in its own buffer: its leaf takes any subject."""
    async with busmod.connect(Settings(nats_url=leaf_url), name="device") as bus:
        for subject, agent_id, first in (
            (names.traces(eval_id, "victim-agent"), "victim-agent", 100),  # another's subject
            (names.traces(eval_id, "edge-1"), "edge-1", 1),  # its own, honest
            (names.traces(eval_id, "edge-1"), "victim-agent", 200),  # its own, naming another
        ):
            await bus.js.publish(subject, _batch(eval_id, agent_id, first))


async def _ingest(settings: Settings, db: Database, eval_id: str) -> tuple[list[Any], list[str]]:
    """Run the hub's ingester until the honest batch is stored and one batch is
    dead-lettered (or 30 s passed); (rows per agent, dead letters' reasons)."""
    query = "SELECT agent_id, count() FROM spans FINAL WHERE evaluation_id = {e:String}"
    async with busmod.connect(settings, name="test") as bus:
        async with anyio.create_task_group() as tg:
            tg.start_soon(Ingester(bus, db).run)
            with anyio.move_on_after(30):
                while (
                    not db.rows(query + " GROUP BY agent_id", {"e": eval_id})
                    or not (await dead_letters(bus))[0]
                ):
                    await anyio.sleep(0.2)
            await anyio.sleep(1.0)  # a forged batch sourced late would be stored by now
            tg.cancel_scope.cancel()
        _, dead = await dead_letters(bus)
    return db.rows(query + " GROUP BY agent_id ORDER BY agent_id", {"e": eval_id}), [
        d.error for d in dead
    ]


def test_an_edge_device_cannot_store_spans_under_another_agents_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device owns its leaf, so its span buffer takes batches on any agent's
    subject; ``mlscope edge attach`` sources only the subjects of the agent its
    credentials are bound to (from ``roles.json``), replacing the unfiltered source of
    an older install. A batch on the edge's own subject that names another agent is
    dead-lettered by the hub's ingester; the honest batch is stored."""
    auth, leaf_port, hub_conf = _secured_hub(tmp_path, "edge-1")
    edge_dir = tmp_path / "edge"
    init = ["edge", "init", "--hub", f"nats-leaf://127.0.0.1:{leaf_port}", "--out", str(edge_dir)]
    assert mlscope_main([*init, "--domain", "e1", "--creds", str(auth / "edge.creds")]) == 0
    hub = NatsServer(store_dir=tmp_path / "hub", config_file=hub_conf).start()
    leaf = NatsServer(store_dir=tmp_path / "leaf", config_file=edge_dir / "leaf.conf").start()
    server = Settings(nats_url=hub.url, data_dir=tmp_path / "d", nats_creds=auth / "server.creds")
    try:
        anyio.run(_provision, server)
        anyio.run(create_edge_stream, leaf.url)
        anyio.run(_attach_unfiltered, server)  # as an older install attached it
        monkeypatch.setenv("MLSCOPE_NATS_URL", hub.url)
        monkeypatch.setenv("MLSCOPE_NATS_CREDS", str(auth / "server.creds"))
        assert mlscope_main(["edge", "attach", "e1"]) == 0
        (source,) = anyio.run(_sources, server)
        assert source.filter_subject == names.agent_traces("edge-1")
        anyio.run(_forge, leaf.url, "ev-forged")
        with Database(f"chdb:///{tmp_path / 'db'}") as db:
            db.migrate()
            rows, reasons = anyio.run(_ingest, server, db, "ev-forged")
        assert rows == [("edge-1", 3)]
        assert len(reasons) == 1 and "not under the trace subject of the agent" in reasons[0]
    finally:
        leaf.stop()
        hub.stop()


async def _attach_unfiltered(settings: Settings) -> None:
    """The source an older ``mlscope edge attach e1`` added: the whole buffer."""
    async with busmod.connect(settings, name="test") as bus:
        cfg = (await bus.js.stream_info(names.TRACES_STREAM)).config
        cfg.sources = [
            StreamSource(
                name=provision.EDGE_TRACES_STREAM, external=ExternalStream(api="$JS.e1.API")
            )
        ]
        await bus.js.update_stream(cfg)


async def _sources(settings: Settings) -> list[Any]:
    async with busmod.connect(settings, name="test") as bus:
        return list((await bus.js.stream_info(names.TRACES_STREAM)).config.sources or [])


def test_edge_attach_under_credentials_needs_the_devices_agent_id(tmp_path: Path) -> None:
    """Credentials without a recorded edge id and no ``--agent-id``: refused, since
    nothing would bind what the device's buffer holds."""
    creds = tmp_path / "server.creds"
    with pytest.raises(ConfigError, match="--agent-id"):
        attach_agent_id(None, Settings(nats_creds=creds))
    assert attach_agent_id("dev-7", Settings(nats_creds=creds)) == "dev-7"
    assert attach_agent_id(None, Settings()) is None
