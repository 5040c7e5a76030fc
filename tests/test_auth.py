"""Least privilege per role: each role is denied what it must not do, on a real server
configured by ``mlscope auth init``, and the whole stack runs under those users."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import nats
import nats.aio.client
import nats.aio.msg
import nats.errors
import pytest

from cli.main import main as mlscope_main
from cli.stack import Stack
from mlscope import artifact_bucket, codec, names, remote
from mlscope import bus as busmod
from mlscope.agentauth import add_agent
from mlscope.auth import INBOX_PREFIXES, REPLY_WINDOW_S, ROLES
from mlscope.auth_files import inbox_prefix_for
from mlscope.contracts import JobRequest, ScenarioSpec
from mlscope.errors import BusError
from mlscope.jobs import submit
from mlscope.natsserver import NatsServer
from mlscope.provision import provisioned
from mlscope.registry import list_agents
from mlscope.settings import Settings
from tests.conftest import child_env, make_data_dir, python, wait_agents, wait_loadgens

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def auth_dir(tmp_path: Path) -> Path:
    out = tmp_path / "auth"
    assert mlscope_main(["auth", "init", "--out", str(out), "--edge-id", "edge-7"]) == 0
    return out


@pytest.fixture
def secured(tmp_path: Path, auth_dir: Path) -> Iterator[NatsServer]:
    with NatsServer(store_dir=tmp_path / "nats", config_file=auth_dir / "server.conf") as srv:
        settings = Settings(nats_url=srv.url, nats_creds=auth_dir / "server.creds")

        async def provision() -> None:
            async with provisioned(settings, name="test"):
                pass

        anyio.run(provision, backend="asyncio")
        yield srv


class Probe:
    """A client of one role that records the server's permission violations."""

    def __init__(self, url: str, creds: Path) -> None:
        self.url, self.creds = url, creds
        self.violations: list[str] = []

    async def __aenter__(self) -> Probe:
        async def on_error(exc: Exception) -> None:
            if "permissions violation" in str(exc).lower():
                self.violations.append(str(exc))

        self.nc = await nats.connect(
            self.url,
            nkeys_seed=str(self.creds),
            error_cb=on_error,
            allow_reconnect=False,
            inbox_prefix=inbox_prefix_for(self.creds) or "_INBOX",
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.nc.close()

    async def denied_publish(self, subject: str, payload: bytes = b"x") -> bool:
        before = len(self.violations)
        await self.nc.publish(subject, payload)
        await self.nc.flush()
        await anyio.sleep(0.1)
        return any(subject.lower() in v.lower() for v in self.violations[before:])

    async def denied_subscribe(self, subject: str, queue: str = "") -> bool:
        before = len(self.violations)
        await self.nc.subscribe(subject, queue=queue)
        await self.nc.flush()
        await anyio.sleep(0.1)
        return any(subject.lower() in v.lower() for v in self.violations[before:])


def test_each_role_hears_only_its_own_replies(secured: NatsServer, auth_dir: Path) -> None:
    """Replies (request/reply, JetStream and KV answers) arrive under the requester's
    inbox prefix; no other role may subscribe there or publish into it."""

    async def main() -> None:
        for role in ROLES:
            async with Probe(secured.url, auth_dir / f"{role}.creds") as probe:
                own = INBOX_PREFIXES[role]
                assert not await probe.denied_subscribe(f"{own}.>"), role
                for other, prefix in INBOX_PREFIXES.items():
                    if other == role:
                        continue
                    assert await probe.denied_subscribe(f"{prefix}.>"), (role, other)
                    assert await probe.denied_subscribe(f"{prefix}.abc.*"), (role, other)
                    # Not a reply to anything delivered to it: a forged answer.
                    forged = f"{prefix}.abc.1"
                    if role == "edge" and other == "server":
                        # Across a leaf link the edge answers the server's queries by
                        # an explicit allow (the leaf knows no allow_responses).
                        assert not await probe.denied_publish(forged)
                    else:
                        assert await probe.denied_publish(forged), (role, other)

    anyio.run(main, backend="asyncio")


def test_responders_may_only_answer_what_they_were_asked(
    secured: NatsServer, auth_dir: Path
) -> None:
    """The load generator's pattern: many queries with one reply subject, answered
    after they overlap. Every reply arrives; a reply subject never delivered is not
    writable."""
    shared = f"{INBOX_PREFIXES['server']}.lg-probe"

    async def main() -> None:
        async with (
            Probe(secured.url, auth_dir / "server.creds") as server,
            Probe(secured.url, auth_dir / "agent.creds") as agent,
        ):
            asked: list[nats.aio.msg.Msg] = []

            async def held(msg: nats.aio.msg.Msg) -> None:
                asked.append(msg)

            await agent.nc.subscribe(names.agent_ctl("a1"), cb=held)
            replies = await server.nc.subscribe(shared)
            await agent.nc.flush()
            for i in range(20):
                await server.nc.publish(names.agent_ctl("a1"), b"%d" % i, reply=shared)
            await server.nc.flush()
            # a lost query fails here, not at the test's timeout, saying what was lost
            with anyio.move_on_after(30):
                while len(asked) < 20:
                    await anyio.sleep(0.05)
            assert len(asked) == 20, (
                f"the agent got {sorted(int(m.data) for m in asked)} of 0..19",
                server.violations,
                agent.violations,
                server.nc.last_error,
                agent.nc.last_error,
            )
            for msg in asked:
                await msg.respond(msg.data)
            await agent.nc.flush()
            got = [(await replies.next_msg(timeout=2)).data for _ in range(20)]
            assert sorted(got) == sorted(b"%d" % i for i in range(20))
            assert not agent.violations
            assert await agent.denied_publish(f"{INBOX_PREFIXES['server']}.lg-other")
            # The server answers its clients the same way, and no more.
            assert await server.denied_publish(f"{INBOX_PREFIXES['submitter']}.x.1")
            assert await server.denied_subscribe(f"{INBOX_PREFIXES['reader']}.>")

    anyio.run(main, backend="asyncio")


def test_reply_grant_outlives_the_longest_request() -> None:
    from broker.evalprep import PREPARE_TIMEOUT_S

    assert PREPARE_TIMEOUT_S < REPLY_WINDOW_S


async def _jobs_in_stream(url: str, auth: Path) -> int:
    async with busmod.connect(
        Settings(nats_url=url, nats_creds=auth / "server.creds"), name="test"
    ) as bus:
        return (await bus.js.stream_info(names.JOBS_STREAM)).state.messages


def test_auth_init_writes_one_seed_per_role(auth_dir: Path) -> None:
    for role in ROLES:
        seed = (auth_dir / f"{role}.creds").read_text().strip()
        assert seed.startswith("SU") and (auth_dir / f"{role}.creds").stat().st_mode & 0o077 == 0
    conf = (auth_dir / "server.conf").read_text()
    assert "max_payload" in conf and "$KV.mlscope_agents.edge-7" in conf


def test_no_credentials_no_connection(secured: NatsServer) -> None:
    async def main() -> None:
        nc = nats.aio.client.Client()
        try:
            await nc.connect(
                secured.url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0
            )
        finally:  # a refused connect leaves its transport open: closed here, not by GC
            await nc.close()

    with pytest.raises(nats.errors.Error, match=r"(?i)authori"):
        anyio.run(main, backend="asyncio")


def test_each_role_is_denied_what_it_must_not_do(secured: NatsServer, auth_dir: Path) -> None:
    url = secured.url
    job = codec.encode_model(JobRequest(model="noop", framework="noop"))

    async def main() -> None:
        async with Probe(url, auth_dir / "edge.creds") as edge:
            # cannot submit jobs, read results or others' traces, or write others' keys
            assert await edge.denied_publish(names.JOBS_SUBJECT, job)
            assert await edge.denied_publish(names.SQL_SUBJECT)
            assert await edge.denied_publish(names.EVALUATION_SUBJECT)
            assert await edge.denied_publish(f"$JS.API.STREAM.MSG.GET.{names.TRACES_STREAM}")
            assert await edge.denied_subscribe(names.traces_wildcard())
            assert await edge.denied_subscribe(names.job_events("someone-elses"))
            assert await edge.denied_subscribe(names.agent_query("other-agent"))
            assert await edge.denied_publish(f"$KV.{names.AGENTS_BUCKET}.other-agent")
            # ... but may write its own key and serve its own subjects
            assert not await edge.denied_publish(f"$KV.{names.AGENTS_BUCKET}.edge-7", b"{}")
            assert not await edge.denied_subscribe(names.agent_query("edge-7"))
            # ... and publish spans only on its own trace subjects
            assert not await edge.denied_publish(names.traces("ev-1", "edge-7"))
            assert await edge.denied_publish(names.traces("ev-1", "other-agent"))
        async with Probe(url, auth_dir / "reader.creds") as reader:
            for subject in (
                names.JOBS_SUBJECT,
                names.traces("ev-1", "a"),
                f"$KV.{names.AGENTS_BUCKET}.x",
                names.agent_query("a"),
                names.capability("noop", "noop"),
                names.job_events("j"),
                f"$JS.API.STREAM.DELETE.{names.JOBS_STREAM}",
            ):
                assert await reader.denied_publish(subject), subject
        async with Probe(url, auth_dir / "agent.creds") as agent:
            assert await agent.denied_publish(names.JOBS_SUBJECT, job)
            assert await agent.denied_publish(names.SQL_SUBJECT)
            assert await agent.denied_publish(f"$JS.API.STREAM.PURGE.{names.TRACES_STREAM}")
            assert await agent.denied_subscribe(names.traces_wildcard())
            # capability queries only as a member of the capability's queue group
            cap = names.capability("noop", "noop")
            assert await agent.denied_subscribe(cap)
            assert not await agent.denied_subscribe(cap, queue=cap)
        async with Probe(url, auth_dir / "loadgen.creds") as loadgen:
            for subject in (
                names.JOBS_SUBJECT,
                names.SQL_SUBJECT,
                names.EVALUATION_SUBJECT,
                names.traces("ev-1", "a"),
                f"$KV.{names.AGENTS_BUCKET}.x",
                f"$JS.API.STREAM.MSG.GET.{names.TRACES_STREAM}",
                f"$JS.API.STREAM.PURGE.{names.JOBS_STREAM}",
                f"{INBOX_PREFIXES['server']}.x",
                names.job_events("j"),
            ):
                assert await loadgen.denied_publish(subject, job), subject
            assert await loadgen.denied_subscribe(names.traces_wildcard())
            assert await loadgen.denied_subscribe(names.agent_query("a"))
            assert await loadgen.denied_subscribe(names.job_events("j"))
            # ... but may send queries, report progress and keep its own registry key
            assert not await loadgen.denied_publish(names.agent_query("a"))
            assert not await loadgen.denied_publish(names.capability("noop", "noop"))
            assert not await loadgen.denied_publish(names.loadgen_progress("lg-1"))
            assert not await loadgen.denied_subscribe(names.loadgen_run("lg-1"))
        async with Probe(url, auth_dir / "submitter.creds") as submitter:
            assert await submitter.denied_publish(names.traces("ev-1", "a"))
            assert await submitter.denied_publish(f"$KV.{names.AGENTS_BUCKET}.x")
            assert await submitter.denied_subscribe(names.capability("noop", "noop"))
            assert not await submitter.denied_publish(names.JOBS_SUBJECT, job)
        # Nothing the denied roles published reached the job stream: only the submitter's.
        assert await _jobs_in_stream(url, auth_dir) == 1
        # The reader can still read the registry (and the edge key it wrote is there).
        reader_settings = Settings(nats_url=url, nats_creds=auth_dir / "reader.creds")
        async with busmod.connect(reader_settings, name="reader") as bus:
            assert await list_agents(bus, include_stale=True) == []
            assert [k async for k in _keys(bus)] == ["edge-7"]

    anyio.run(main, backend="asyncio")


async def _keys(bus: busmod.Bus):  # type: ignore[no-untyped-def]
    kv = await bus.kv(names.AGENTS_BUCKET)
    for key in await kv.keys():
        yield key


def test_stack_runs_an_evaluation_under_role_credentials(
    tmp_path: Path, auth_dir: Path, zoo_dir: Path
) -> None:
    data = make_data_dir(tmp_path / "data", zoo_dir)
    stack = Stack(Settings(data_dir=data), nats_port=0, frameworks=["noop"], auth=auth_dir)
    client = stack.start()
    try:
        assert client.nats_creds == (auth_dir / "submitter.creds").resolve()
        anyio.run(wait_agents, client, 1)
        summary = anyio.run(
            lambda: submit(
                client,
                JobRequest(
                    model="noop",
                    framework="noop",
                    scenario=ScenarioSpec(name="online", qps=50, duration_s=1),
                ),
            ),
            backend="asyncio",
        )
        assert summary.status == "completed" and summary.errors == 0 and summary.queries >= 40
        # Placement agent: the run's rows are many replies to one run request, which the
        # agent's own user may send (allow_responses), and nothing else.
        local = anyio.run(
            lambda: submit(
                client,
                JobRequest(
                    model="noop",
                    framework="noop",
                    scenario=ScenarioSpec(name="single-stream", duration_s=30, max_queries=300),
                    placement="agent",
                ),
            ),
            backend="asyncio",
        )
        assert (local.placement, local.errors, local.queries) == ("agent", 0, 300)

        async def read_back() -> dict[str, object]:
            # The dashboard's way: the server answers into the reader's own inbox.
            reader = client.with_(nats_creds=(auth_dir / "reader.creds").resolve())
            async with busmod.connect(reader, name="reader") as bus:
                return (await remote.evaluation(bus, summary.evaluation_id))[1]

        assert anyio.run(read_back, backend="asyncio")["queries"] == summary.queries
        assert not stack.dead()
    finally:
        stack.stop()


def test_agents_fetch_artifacts_from_the_bus_under_their_own_users(
    auth_dir: Path, zoo_dir: Path, tmp_path: Path
) -> None:
    """The server pushes a model's files to the artifact bucket; an agent of the
    role-wide user and one issued by ``add-agent`` each fetch them into their zoo."""
    users = {
        "role-wide": auth_dir / "agent.creds",
        "named": add_agent(auth_dir, "agent-fetch", frameworks=["onnxruntime"]),
    }

    async def main(url: str) -> None:
        server = Settings(nats_url=url, nats_creds=auth_dir / "server.creds")
        async with provisioned(server, name="server") as bus:
            assert await artifact_bucket.push(bus, zoo_dir / "digits_cnn" / "1.0.0")
        for who, creds in users.items():
            zoo = tmp_path / who
            agent = Settings(nats_url=url, nats_creds=creds)
            async with busmod.connect(agent, name=who) as bus:
                lock = await artifact_bucket.fetch(bus, zoo, "digits_cnn", "1.0.0")
            assert lock is not None and lock.origin["by"] == "bus", who
            assert all((zoo / "digits_cnn" / "1.0.0" / f).is_file() for f in lock.files), who

    with NatsServer(store_dir=tmp_path / "nats", config_file=auth_dir / "server.conf") as srv:
        anyio.run(main, srv.url, backend="asyncio")


def test_a_local_run_outlasts_the_reply_grant(tmp_path: Path, zoo_dir: Path) -> None:
    """A local run's rows are answers to its one run request; with a reply grant of
    3 s an 8 s run still delivers every row, because the server renews the grant."""
    auth_dir = tmp_path / "auth-3s"
    assert mlscope_main(["auth", "init", "--out", str(auth_dir), "--reply-window", "3"]) == 0
    assert '"expires": "3s"' in (auth_dir / "server.conf").read_text()
    data = make_data_dir(tmp_path / "data", zoo_dir)
    stack = Stack(Settings(data_dir=data), nats_port=0, frameworks=["noop"], auth=auth_dir)
    client = stack.start()
    try:
        anyio.run(wait_agents, client, 1)
        spec = ScenarioSpec(name="online", qps=100, duration_s=8, min_duration_s=0, min_queries=1)
        job = JobRequest(
            model="noop", framework="noop", scenario=spec, placement="agent", trace_level="none"
        )
        summary = anyio.run(lambda: submit(client, job, timeout=120), backend="asyncio")
        assert summary.placement == "agent" and summary.errors == 0
        assert summary.queries >= 700, summary.invalid_reasons
        assert not any("lost" in r for r in summary.invalid_reasons), summary.invalid_reasons
        assert not stack.dead()
    finally:
        stack.stop()


def test_load_generator_services_run_under_their_own_user(
    tmp_path: Path, auth_dir: Path, zoo_dir: Path
) -> None:
    """An ``mlscope loadgen`` with ``loadgen.creds`` registers, takes its dealt slice,
    sends the queries, reports progress and stores its result; the run is whole."""
    dealt_run(tmp_path, auth_dir, zoo_dir, auth_dir / "loadgen.creds", "lg-secure")


def dealt_run(tmp_path: Path, auth_dir: Path, zoo_dir: Path, creds: Path, lg_id: str) -> None:
    """A stack with ``--auth auth_dir`` runs a job dealt whole to one ``mlscope loadgen
    --id lg_id`` service connected with ``creds``."""
    data = make_data_dir(tmp_path / "data", zoo_dir)
    stack = Stack(Settings(data_dir=data), nats_port=0, frameworks=["noop"], auth=auth_dir)
    client = stack.start()
    as_loadgen = client.with_(nats_creds=creds.resolve())
    service = subprocess.Popen(
        [python(), "-m", "cli.main", "loadgen", "--id", lg_id], env=child_env(as_loadgen)
    )
    try:
        anyio.run(wait_agents, client, 1)
        assert [d.loadgen_id for d in anyio.run(wait_loadgens, as_loadgen, 1)] == [lg_id]
        progress: list[int] = []
        spec = ScenarioSpec(
            name="online",
            qps=200,
            duration_s=2.0,
            loadgen_hosts=(lg_id,),
            min_duration_s=0,
            min_queries=1,
            max_issue_lag_us=1e6,
        )
        summary = anyio.run(
            lambda: submit(
                client,
                JobRequest(model="noop", framework="noop", scenario=spec, trace_level="none"),
                on_event=lambda e: (
                    progress.append(e.queries_done) if e.event == "progress" else None
                ),
                timeout=120,
            ),
            backend="asyncio",
        )
        assert summary.status == "completed" and summary.errors == 0, summary.invalid_reasons
        assert summary.queries > 300
        assert summary.loadgen_cost is not None
        ran = summary.loadgen_cost["services"]
        assert [(r["loadgen_id"], r["pid"]) for r in ran] == [(lg_id, service.pid)]
        assert ran[0]["completed"] == summary.queries
        assert max(progress, default=0) > 0, progress  # its progress subject reached the job
        assert service.poll() is None and not stack.dead()
    finally:
        service.terminate()
        service.wait(20)
        stack.stop()


def test_settings_carry_credentials_tls_cluster_and_domain(tmp_path: Path, auth_dir: Path) -> None:
    jwt = tmp_path / "user.creds"
    jwt.write_text("-----BEGIN NATS USER JWT-----\neyJ0\n------END NATS USER JWT------\n")
    env = {
        "MLSCOPE_NATS_URL": "nats://a:4222, nats://b:4222,nats://c:4222",
        "MLSCOPE_NATS_CREDS": str(auth_dir / "agent.creds"),
        "MLSCOPE_JS_REPLICAS": "3",
        "MLSCOPE_JS_DOMAIN": "hub",
        "MLSCOPE_NATS_TLS_CA": str(tmp_path / "ca.pem"),
    }
    s = Settings.from_env(env)
    assert s.nats_servers == ["nats://a:4222", "nats://b:4222", "nats://c:4222"]
    assert (s.js_replicas, s.js_domain) == (3, "hub")
    assert Settings.from_env(s.as_env()) == s  # a child process sees the same settings
    options = busmod.connect_options(s.with_(nats_tls_ca=None))
    assert options["nkeys_seed"] == str(auth_dir / "agent.creds")
    assert options["inbox_prefix"] == "_INBOX_agent"  # the role's, from roles.json
    assert "user_credentials" not in options and "tls" not in options
    explicit = s.with_(nats_tls_ca=None, nats_inbox_prefix="_INBOX_edge")
    assert busmod.connect_options(explicit)["inbox_prefix"] == "_INBOX_edge"
    assert Settings.from_env(explicit.as_env()) == explicit
    jwt_options = busmod.connect_options(s.with_(nats_creds=jwt, nats_tls_ca=None))
    assert jwt_options["user_credentials"] == str(jwt) and "inbox_prefix" not in jwt_options
    with pytest.raises(BusError, match="TLS"):  # a missing CA file is not ignored
        busmod.connect_options(s)
