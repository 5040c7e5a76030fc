"""Per-service load-generator identities (`mlscope auth add-loadgen`): a service's user
hears only its own control and run subjects, reports progress and writes the registry
only under its own id, and ``mlscope loadgen`` refuses to run with it under another
id, on a real nats-server with the ``auth init`` configuration."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from broker.lgservice import LoadgenService, default_id
from mlscope import names
from mlscope.agentauth import bound_id, loadgen_creds, loadgen_inbox_prefix
from mlscope.auth import INBOX_PREFIXES
from mlscope.auth_files import inbox_prefix_for, read_roles
from mlscope.errors import ConfigError
from mlscope.natsserver import NatsServer
from mlscope.settings import Settings
from tests.conftest import child_env, python
from tests.security_fixtures import issued_auth, secured_nats
from tests.test_auth import Probe, dealt_run

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def auth_dir(tmp_path: Path) -> Path:
    return issued_auth(tmp_path / "auth", ("add-loadgen", "lg-a"), ("add-loadgen", "lg-b"))


@pytest.fixture
def server(tmp_path: Path, auth_dir: Path) -> Iterator[NatsServer]:
    with secured_nats(tmp_path / "nats", auth_dir) as srv:
        yield srv


def test_add_loadgen_records_its_own_user(auth_dir: Path) -> None:
    creds = loadgen_creds(auth_dir, "lg-a")
    assert creds.name == "loadgen-lg-a.creds" and creds.stat().st_mode & 0o077 == 0
    assert inbox_prefix_for(creds) == loadgen_inbox_prefix("lg-a") == "_INBOX_loadgen_lg-a"
    assert bound_id(creds, "loadgen") == "lg-a"
    assert bound_id(creds, "agent") is None
    assert bound_id(auth_dir / "loadgen.creds", "loadgen") is None  # the shared user
    assert set(read_roles(auth_dir)["loadgens"]) == {"lg-a", "lg-b"}


def test_a_loadgen_user_is_bound_to_its_own_subjects(server: NatsServer, auth_dir: Path) -> None:
    async def main() -> None:
        async with Probe(server.url, loadgen_creds(auth_dir, "lg-a")) as a:
            for subject in (
                names.loadgen_ctl("lg-b"),
                names.loadgen_run("lg-b"),
                names.loadgen_progress("lg-b"),
                "mlscope.loadgen.*.ctl",
                "mlscope.loadgen.>",
            ):
                assert await a.denied_subscribe(subject), subject
            for inbox in (loadgen_inbox_prefix("lg-b"), INBOX_PREFIXES["loadgen"]):
                assert await a.denied_subscribe(f"{inbox}.>"), inbox
            for subject in (
                names.loadgen_progress("lg-b"),
                names.loadgen_ctl("lg-b"),
                f"$KV.{names.LOADGENS_BUCKET}.lg-b",
            ):
                assert await a.denied_publish(subject, b"{}"), subject
            # Its own subjects and key, and the agents it sends queries to.
            assert not await a.denied_subscribe(names.loadgen_ctl("lg-a"))
            assert not await a.denied_subscribe(names.loadgen_run("lg-a"))
            assert not await a.denied_publish(names.loadgen_progress("lg-a"))
            assert not await a.denied_publish(names.agent_query("x"))
            assert not await a.denied_publish(f"$KV.{names.LOADGENS_BUCKET}.lg-a", b"{}")

    anyio.run(main)


def test_a_loadgen_refuses_an_id_other_than_its_credentials(auth_dir: Path) -> None:
    as_a = Settings(nats_url="nats://127.0.0.1:1", nats_creds=loadgen_creds(auth_dir, "lg-a"))
    with pytest.raises(ConfigError, match="lg-a"):
        LoadgenService(as_a, loadgen_id="lg-b")
    LoadgenService(as_a, loadgen_id="lg-a")  # its own id
    shared = as_a.with_(nats_creds=auth_dir / "loadgen.creds")
    LoadgenService(shared, loadgen_id="lg-b")  # the role-wide user serves any id
    refused = subprocess.run(
        [python(), "-m", "cli.main", "loadgen", "--id", "lg-b"],
        env=child_env(as_a),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0
    assert "mlscope loadgen --id lg-a" in refused.stderr
    # With no --id, a service takes its own credentials' id; others their HOST-PID.
    assert default_id(as_a) == "lg-a"
    assert default_id(shared) == names.token(default_id(shared)) != "lg-a"


def test_a_loadgen_runs_its_dealt_slice_under_its_own_user(
    tmp_path: Path, auth_dir: Path, zoo_dir: Path
) -> None:
    dealt_run(tmp_path, auth_dir, zoo_dir, loadgen_creds(auth_dir, "lg-a"), "lg-a")
