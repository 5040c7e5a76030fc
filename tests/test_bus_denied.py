"""What a role's credentials do not allow fails as a denial, not as a timeout: the NATS
server drops what a client may not publish and says so only on the side, so without
it a reader's ``mlscope cancel`` said no server ran the job and ``mlscope rerun`` that
no server was running. A later failure is not blamed on an earlier denial."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.contracts import JobRequest
from mlscope.errors import BusDenied, BusError, BusNotFound
from mlscope.natsserver import NatsServer
from mlscope.provision import provisioned
from mlscope.settings import Settings
from tests.conftest import child_env
from tests.security_fixtures import issued_auth, secured_nats

BIN = Path(sys.executable).parent


@pytest.fixture
def auth(tmp_path: Path) -> Path:
    return issued_auth(tmp_path / "auth")


@pytest.fixture
def secured(tmp_path: Path, auth: Path) -> Iterator[NatsServer]:
    """A nats-server under the roles' configuration, its streams made by the server."""
    with secured_nats(tmp_path / "nats", auth) as srv:

        async def provision() -> None:
            async with provisioned(as_role(srv, auth, "server"), name="test"):
                pass

        anyio.run(provision, backend="asyncio")
        yield srv


def as_role(srv: NatsServer, auth: Path, role: str) -> Settings:
    return Settings(nats_url=srv.url, nats_creds=auth / f"{role}.creds")


LONG_S = 60.0
"""A wait a denial must end long before: the server denies within milliseconds."""


def test_what_a_reader_may_not_do_fails_as_denied(secured: NatsServer, auth: Path) -> None:
    """A request, a persistent publish or a JetStream API call fails when the server
    denies its subject, not when its timeout runs out."""
    job = codec.encode_model(JobRequest(model="noop", framework="noop"))

    async def main() -> None:
        async with busmod.connect(as_role(secured, auth, "reader"), name="test") as bus:
            with (
                anyio.fail_after(LONG_S / 2),
                pytest.raises(BusDenied, match=r"mlscope\.job\.j-1\.cancel"),
            ):
                await busmod.request(bus, names.job_cancel("j-1"), b"{}", timeout=LONG_S)
            with (
                anyio.fail_after(LONG_S / 2),
                pytest.raises(BusDenied, match=r"(?i)permissions violation.*jobs\.submit"),
            ):
                await busmod.publish_persistent(
                    bus, names.JOBS_SUBJECT, job, msg_id="j-2", timeout=LONG_S
                )
            # Concurrent requests on the subject are all ended; nothing is left waiting.
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(_denied_request, bus, names.job_cancel("j-3"))
            assert not bus.nc.awaiting  # type: ignore[attr-defined]
            dead = busmod.bus_errors("cannot read the dead letters")
            with (
                anyio.fail_after(LONG_S / 2),
                pytest.raises(BusDenied, match=r"(?i)cannot read the dead letters.*denied"),
                dead,
            ):
                await bus.nc.jetstream(timeout=LONG_S).stream_info(names.DEAD_STREAM)
            # A later failure of its own is not blamed on those denials.
            with pytest.raises(BusError) as later, busmod.bus_errors("a later step"):
                raise TimeoutError
            assert not isinstance(later.value, BusDenied)

    anyio.run(main, backend="asyncio")


async def _denied_request(bus: busmod.Bus, subject: str) -> None:
    with anyio.fail_after(LONG_S / 2), pytest.raises(BusDenied):
        await busmod.request(bus, subject, b"{}", timeout=LONG_S)


def test_what_the_server_may_do_is_not_denied(secured: NatsServer, auth: Path) -> None:
    async def main() -> None:
        async with busmod.connect(as_role(secured, auth, "server"), name="test") as bus:
            with pytest.raises(BusNotFound), busmod.bus_errors("cannot read a stream"):
                await bus.js.stream_info("NO_SUCH_STREAM")
            with busmod.bus_errors("cannot read the dead letters"):
                assert (await bus.js.stream_info(names.DEAD_STREAM)).config.name

    anyio.run(main, backend="asyncio")


@pytest.mark.parametrize(
    ("command", "wrong"),
    [
        (["mlscope", "cancel", "job-1", "--timeout", "60"], "no server is running"),
        (["mlscope-submit", "noop", "--framework", "noop"], "stream does not exist"),
        (["mlscope", "doctor"], "TimeoutError"),
    ],
)
def test_the_cli_says_the_credentials_were_denied(
    secured: NatsServer, auth: Path, command: list[str], wrong: str
) -> None:
    """As the reader: each command fails, saying its credentials were denied, and not
    what it used to guess from the silence; ``mlscope cancel`` without waiting out its
    timeout."""
    done = subprocess.run(
        [str(BIN / command[0]), *command[1:]],
        env=child_env(as_role(secured, auth, "reader")),
        capture_output=True,
        text=True,
        timeout=LONG_S / 2,
        check=False,
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "denied" in done.stderr and "MLSCOPE_NATS_CREDS" in done.stderr, done.stderr
    assert wrong not in done.stderr, done.stderr
