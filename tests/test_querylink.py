"""The load generator's query link on a real nats-server: whole replies in order, the
server's pings answered, credentials and TLS as the bus uses them, a link refused says
why and one that loses its server connects again (the runs served over it:
``tests/test_served_runs.py``)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import anyio
import nats
import nkeys
import pytest

from cli.main import main as mlscope_main
from mlscope import bus as busmod
from mlscope import names
from mlscope.auth import INBOX_PREFIXES
from mlscope.auth_files import inbox_prefix_for
from mlscope.errors import BusError
from mlscope.natsserver import NatsServer, free_port
from mlscope.querylink import QueryLink
from mlscope.settings import Settings

pytestmark = pytest.mark.timeout(120)

SUBJECT = "test.link"


class Replies:
    """What a link's reader hands over, for a test thread to wait on."""

    def __init__(self, *, poison: bytes = b"") -> None:
        self.got: list[tuple[bytes, int]] = []
        self.poison = poison
        self.ended = threading.Event()
        self._more = threading.Condition()

    def __call__(self, data: bytes, t: int) -> None:
        if self.poison and data.startswith(self.poison):
            raise ValueError("poisoned reply")
        with self._more:
            self.got.append((data, t))
            self._more.notify_all()

    def wait(self, n: int, timeout: float = 10.0) -> list[tuple[bytes, int]]:
        with self._more:
            if not self._more.wait_for(lambda: len(self.got) >= n, timeout):
                raise AssertionError(f"{len(self.got)} of {n} replies arrived")
            return list(self.got)


@asynccontextmanager
async def echo(url: str, subject: str = SUBJECT, **options: Any) -> AsyncIterator[None]:
    """A nats-py responder that answers each message with its own bytes."""
    nc = await nats.connect(url, **{"allow_reconnect": False, **options})

    async def back(msg: Any) -> None:
        await msg.respond(msg.data)

    await nc.subscribe(subject, cb=back)
    await nc.flush()
    try:
        yield
    finally:
        await nc.close()


def open_link(url: str, options: dict[str, Any] | None = None, **kw: Any) -> QueryLink:
    inbox = kw.pop("inbox", "_INBOX.test-link")
    return QueryLink.open(urlparse(url), options or {}, inbox=inbox, name="test link", **kw)


def assert_refused(link: QueryLink, subject: str) -> None:
    """A publish to ``subject``, which the link's user may not make, fails the link
    with the server's words; the link is closed after."""
    link.start(Replies())
    try:
        link.send(link.frame(subject, b"forbidden"))
        deadline = time.monotonic() + 5
        while link.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert link.error is not None and "permissions violation" in link.error.lower()
    finally:
        link.close()


def served_by_echo(
    url: str, link_options: dict[str, Any], subject: str = SUBJECT, **echo_options: Any
) -> None:
    """Open a link with ``link_options``, send three queries through an echo
    responder, and check they come back whole."""

    async def main() -> None:
        async with echo(url, subject, **echo_options):
            link = await anyio.to_thread.run_sync(
                lambda: open_link(url, link_options, inbox=f"{prefix}.test-link")
            )
            replies = Replies()
            link.start(replies)
            try:
                link.send(b"".join(link.frame(subject, b"q%d" % i) for i in range(3)))
                got = await anyio.to_thread.run_sync(replies.wait, 3)
            finally:
                link.close()
            assert [d for d, _ in got] == [b"q0", b"q1", b"q2"] and link.error is None

    prefix = link_options.get("inbox_prefix", "_INBOX")
    anyio.run(main, backend="asyncio")


def test_replies_come_back_whole_in_order_and_stamped_after_the_send(
    nats_server: NatsServer,
) -> None:
    sizes = [0, 1, 7, 64 << 10, 900 << 10, 3] * 20  # some span many reads, some share one
    payloads = [bytes([i % 251]) * n for i, n in enumerate(sizes)]

    async def main() -> tuple[list[tuple[bytes, int]], int]:
        async with echo(nats_server.url):
            link = await anyio.to_thread.run_sync(open_link, nats_server.url)
            replies = Replies()
            link.start(replies)
            try:
                sent = time.perf_counter_ns()
                for k in range(0, len(payloads), 10):  # ten frames per write
                    link.send(b"".join(link.frame(SUBJECT, p) for p in payloads[k : k + 10]))
                got = await anyio.to_thread.run_sync(replies.wait, len(payloads))
            finally:
                link.close()
            assert link.error is None and link.bad_replies == 0
            return got, sent

    got, sent = anyio.run(main, backend="asyncio")
    assert [d for d, _ in got] == payloads
    stamps = [t for _, t in got]
    assert stamps == sorted(stamps) and stamps[0] > sent


def test_a_reply_the_caller_cannot_read_is_counted_and_the_link_goes_on(
    nats_server: NatsServer,
) -> None:
    async def main() -> None:
        async with echo(nats_server.url):
            link = await anyio.to_thread.run_sync(open_link, nats_server.url)
            replies = Replies(poison=b"bad")
            link.start(replies)
            try:
                frames = [
                    link.frame(SUBJECT, b"bad%d" % i if i % 3 else b"ok%d" % i) for i in range(30)
                ]
                link.send(b"".join(frames))
                got = await anyio.to_thread.run_sync(replies.wait, 10)
                await anyio.sleep(0.2)
            finally:
                link.close()
            assert [d for d, _ in got] == [b"ok%d" % i for i in range(0, 30, 3)]
            assert link.bad_replies == 20 and "poisoned" in (link.bad_reply or "")
            assert link.error is None

    anyio.run(main, backend="asyncio")


def test_the_link_answers_the_servers_pings(tmp_path: Path) -> None:
    """A server that pings every 100 ms drops a client that misses two pongs."""
    conf = tmp_path / "ping.conf"
    conf.write_text('ping_interval: "100ms"\nping_max: 2\n')
    with NatsServer(store_dir=tmp_path / "nats", config_file=conf) as srv:

        async def main() -> None:
            async with echo(srv.url):
                link = await anyio.to_thread.run_sync(open_link, srv.url)
                replies = Replies()
                link.start(replies)
                try:
                    await anyio.sleep(1.2)  # a dozen pings, no traffic of ours
                    link.send(link.frame(SUBJECT, b"still here"))
                    got = await anyio.to_thread.run_sync(replies.wait, 1)
                finally:
                    link.close()
                assert got[0][0] == b"still here" and link.error is None

        anyio.run(main, backend="asyncio")


def test_a_link_that_loses_its_server_refuses_sends_and_connects_again(tmp_path: Path) -> None:
    srv = NatsServer(store_dir=tmp_path / "nats", port=free_port()).start()
    try:

        async def main() -> None:
            async with echo(srv.url, allow_reconnect=True, reconnect_time_wait=0.1):
                link = await anyio.to_thread.run_sync(open_link, srv.url)
                replies = Replies()
                link.start(replies)
                try:
                    link.send(link.frame(SUBJECT, b"before"))
                    await anyio.to_thread.run_sync(replies.wait, 1)
                    srv.kill()
                    with pytest.raises(BusError, match="unreachable"):
                        for _ in range(200):  # the first writes may reach the kernel's buffer
                            link.send(link.frame(SUBJECT, b"x" * 4096))
                            await anyio.sleep(0.01)
                    assert link.outages == 1 and link.outage
                    srv.start()
                    deadline = time.monotonic() + 10
                    while True:  # the link and the echo both connect again
                        try:
                            link.send(link.frame(SUBJECT, b"after"))
                            got = await anyio.to_thread.run_sync(replies.wait, 2, 0.5)
                            break
                        except (BusError, AssertionError):
                            if time.monotonic() > deadline:
                                raise
                            await anyio.sleep(0.1)
                finally:
                    link.close()
                assert got[0][0] == b"before" and got[-1][0] == b"after"
                assert link.outages == 1 and link.error is None

        anyio.run(main, backend="asyncio")
    finally:
        srv.stop()


def test_a_query_over_the_servers_limit_is_refused_before_it_is_sent(tmp_path: Path) -> None:
    conf = tmp_path / "small.conf"
    conf.write_text("max_payload: 1024\n")
    with NatsServer(store_dir=tmp_path / "nats", config_file=conf) as srv:
        link = open_link(srv.url)
        try:
            assert link.max_payload == 1024
            link.frame(SUBJECT, b"x" * 1024)
            with pytest.raises(BusError, match="1025 bytes exceeds"):
                link.frame(SUBJECT, b"x" * 1025)
        finally:
            link.close()


def test_no_server_and_a_server_that_is_not_nats_are_bus_errors(tmp_path: Path) -> None:
    with pytest.raises(BusError, match="no NATS server"):
        open_link(f"nats://127.0.0.1:{free_port()}", timeout=1)
    http = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port := free_port())],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                open_link(f"nats://127.0.0.1:{port}", timeout=1)
            except BusError as exc:
                if "no NATS server" in str(exc) and time.monotonic() < deadline:
                    time.sleep(0.1)  # not listening yet
                    continue
                assert "failed to open" in str(exc) or "closed" in str(exc)
                break
            raise AssertionError("an HTTP server passed for NATS")
    finally:
        http.kill()
        http.wait()


@pytest.mark.integration  # a real socket, and it waits out the client's timeout
@pytest.mark.parametrize(
    "greeting",
    [
        b"INFO []\r\n",
        b'INFO {"max_payload": "big"}\r\n',
        b'INFO {"max_payload": -1}\r\n',
        b"INFO {not json\r\n",
        b"INFO " + b"x" * (70 << 10),
        b"HELLO\r\n",
        b"INFO {}\r\n",  # then silence: no PONG ever comes
        b"INFO {}\r\n-ERR 'Authorization Violation'\r\n",
        b"",  # closes at once
    ],
)
def test_a_hostile_server_fails_the_handshake_with_a_bus_error(greeting: bytes) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(greeting)
            time.sleep(1.5)  # longer than the client's timeout

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with pytest.raises(BusError):
            open_link(f"nats://127.0.0.1:{port}", timeout=1)
    finally:
        server.join(5)
        listener.close()


# ---------------------------------------------------------------- credentials, TLS


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[NatsServer, Path]]:
    auth = tmp_path / "auth"
    assert mlscope_main(["auth", "init", "--out", str(auth)]) == 0
    with NatsServer(store_dir=tmp_path / "nats", config_file=auth / "server.conf") as srv:
        yield srv, auth


def test_a_link_signs_in_with_the_bus_credentials_and_keeps_their_permissions(
    secured: tuple[NatsServer, Path],
) -> None:
    srv, auth = secured
    settings = Settings(nats_url=srv.url, nats_creds=auth / "server.creds")
    options = busmod.connect_options(settings)
    agent_creds = auth / "agent.creds"
    query = names.agent_query("a1")
    # The server role sends queries to an agent that answers under its own user.
    served_by_echo(
        srv.url,
        options,
        subject=query,
        nkeys_seed=str(agent_creds),
        inbox_prefix=inbox_prefix_for(agent_creds) or "_INBOX",
    )
    # What the role may not publish fails the link, with the server's words.
    link = open_link(srv.url, options, inbox=f"{INBOX_PREFIXES['server']}.test-link")
    assert_refused(link, f"{INBOX_PREFIXES['submitter']}.x.1")
    # A seed the server does not know is refused at once.
    stranger = auth / "stranger.seed"
    stranger.write_bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER) + b"\n")
    with pytest.raises(BusError, match="refused the query link"):
        open_link(srv.url, {"nkeys_seed": str(stranger)})
    stranger.write_bytes(b"not a seed\n")
    with pytest.raises(BusError, match="failed to open"):
        open_link(srv.url, {"nkeys_seed": str(stranger)})


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _jwt(subject: str, nats_claims: dict[str, Any], issuer: Any) -> str:
    """A NATS JWT (v2) for ``subject``, signed by the ``issuer`` key pair."""
    claims: dict[str, Any] = {
        "iat": int(time.time()),
        "iss": issuer.public_key.decode(),
        "name": subject[:8],
        "sub": subject,
        "nats": {**nats_claims, "version": 2},
    }
    digest = hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    return f"{head}.{body}.{_b64(issuer.sign(f'{head}.{body}'.encode()))}"


def _keypair(prefix: int) -> Any:
    return nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), prefix)))


def _user_creds(path: Path, account: Any, permissions: dict[str, Any]) -> Path:
    """A ``.creds`` file: a new user of ``account`` with ``permissions``."""
    user = _keypair(nkeys.PREFIX_BYTE_USER)
    claims = {"type": "user", "subs": -1, "data": -1, "payload": -1, **permissions}
    jwt = _jwt(user.public_key.decode(), claims, account)
    path.write_text(
        "-----BEGIN NATS USER JWT-----\n"
        f"{jwt}\n"
        "------END NATS USER JWT------\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{user.seed.decode()}\n"
        "------END USER NKEY SEED------\n"
    )
    return path


def test_a_link_signs_in_with_a_user_jwt_as_the_bus_does(tmp_path: Path) -> None:
    """Operator mode (decentralized JWT auth): the bus's ``.creds`` file signs the link
    in, the user's permissions hold on it, and a user of an unknown account is refused."""
    operator = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
    account = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    account_id = account.public_key.decode()
    limits = {"subs": -1, "conn": -1, "leaf": -1, "imports": -1, "exports": -1}
    system_id = _keypair(nkeys.PREFIX_BYTE_ACCOUNT).public_key.decode()  # JetStream's own
    accounts = {
        key: _jwt(
            key,
            {"type": "account", "limits": {**limits, "data": -1, "payload": -1, "wildcards": True}},
            operator,
        )
        for key in (account_id, system_id)
    }
    operator_jwt = _jwt(
        operator.public_key.decode(), {"type": "operator", "system_account": system_id}, operator
    )
    conf = tmp_path / "operator.conf"
    conf.write_text(
        f"operator: {operator_jwt}\nsystem_account: {system_id}\nresolver: MEMORY\n"
        "resolver_preload: {\n"
        + "".join(f"  {key}: {jwt}\n" for key, jwt in accounts.items())
        + "}\n"
    )
    server = _user_creds(
        tmp_path / "server.creds",
        account,
        {"pub": {"allow": [SUBJECT]}, "sub": {"allow": ["_INBOX.>"]}},
    )
    responder = _user_creds(tmp_path / "agent.creds", account, {})
    with NatsServer(store_dir=tmp_path / "nats", config_file=conf) as srv:
        options = busmod.connect_options(Settings(nats_url=srv.url, nats_creds=server))
        assert options["user_credentials"] == str(server)
        served_by_echo(srv.url, options, user_credentials=str(responder))
        # What the user may not publish fails the link, with the server's words.
        assert_refused(open_link(srv.url, options), "elsewhere")
        # A user whose account the operator never signed is refused at the handshake.
        rogue = _user_creds(tmp_path / "rogue.creds", _keypair(nkeys.PREFIX_BYTE_ACCOUNT), {})
        with pytest.raises(BusError, match="refused the query link"):
            open_link(srv.url, {"user_credentials": str(rogue)})


def test_a_link_speaks_tls_when_the_bus_does(tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    assert openssl, "the TLS test needs the openssl command to make its certificate"
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"),
            *("-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    conf = tmp_path / "tls.conf"
    conf.write_text(f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n}}\n')
    with NatsServer(store_dir=tmp_path / "nats", config_file=conf) as srv:
        options = busmod.connect_options(Settings(nats_url=srv.url, nats_tls_ca=cert))
        served_by_echo(srv.url, options, tls=options["tls"])
        with pytest.raises(BusError, match="failed to open"):
            open_link(srv.url, {})  # the system's CAs do not know this certificate


# ---------------------------------------------------------------- a served run
