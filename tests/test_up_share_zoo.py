"""``mlscope up`` shares its data dir's built zoo on the bus before its server and
agents start, with credentials or without, and a broken model directory there costs
that model only: the rest are pushed, and the stack goes on. Its flags are bounded
before anything starts."""

from __future__ import annotations

import hashlib
from pathlib import Path

import anyio
import pytest

from cli.main import build_parser
from cli.services import MAX_AGENTS_PER_FRAMEWORK, _share_zoo
from mlscope import artifact_bucket
from mlscope import bus as busmod
from mlscope.buildlock import BuildLock
from mlscope.natsserver import NatsServer, free_port
from mlscope.settings import Settings
from tests.security_fixtures import issued_auth
from tests.test_lifecycle import READY, up

DATA = b"the model's bytes"
SHA = hashlib.sha256(DATA).hexdigest()


def built(zoo: Path, name: str, *, data: bytes | None = DATA) -> Path:
    """A model directory with a build lock over g.onnx (None: the file is gone)."""
    d = zoo / name / "1.0.0"
    d.mkdir(parents=True)
    if data is not None:
        (d / "g.onnx").write_bytes(data)
    BuildLock(name, "1.0.0", {"g.onnx": SHA}, {"g.onnx": SHA}, {}, {}).write(d)
    return d


async def pushed(settings: Settings) -> list[tuple[str, str]]:
    async with busmod.connect(settings, name="probe") as bus:
        return await artifact_bucket.pushed_models(bus)


def test_a_broken_model_directory_is_skipped_and_the_rest_pushed(
    nats_server: NatsServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "data")
    built(settings.zoo_dir, "a_gone", data=None)
    built(settings.zoo_dir, "b_good")
    _share_zoo(settings)
    assert anyio.run(pushed, settings) == [("b_good", "1.0.0")]
    notices = [line for line in capsys.readouterr().err.splitlines() if "a_gone" in line]
    assert len(notices) == 1 and "not pushed" in notices[0]


def test_mlscope_up_with_credentials_shares_its_zoo_before_its_services_start(
    tmp_path: Path,
) -> None:
    """With ``--auth`` the submitter may not write the artifact bucket: the push uses the
    server's credentials. It ends before the server and agents start, so it cannot share
    the machine with a job's measurement."""
    data, auth, log = tmp_path / "data", issued_auth(tmp_path / "auth"), tmp_path / "up.log"
    built(data / "zoo", "b_good")
    port = free_port()
    with up(data, port, log, "--auth", str(auth)):
        text = log.read_text()
        shared = text.find("zoo shared on the bus: b_good 1.0.0 (1 sent now)")
        assert 0 <= shared < min(text.find(line) for line in READY), text
        server = Settings(nats_url=f"nats://127.0.0.1:{port}", nats_creds=auth / "server.creds")
        assert anyio.run(pushed, server) == [("b_good", "1.0.0")]


@pytest.mark.parametrize("count", ["0", "-1", "x", str(MAX_AGENTS_PER_FRAMEWORK + 1), "10**9"])
def test_agents_per_framework_is_bounded(count: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser("up").parse_args(["up", "--agents-per-framework", count])
    assert exited.value.code == 2
    assert "--agents-per-framework" in capsys.readouterr().err


def test_agents_per_framework_within_bounds_is_taken() -> None:
    for count in (1, MAX_AGENTS_PER_FRAMEWORK):
        args = build_parser("up").parse_args(["up", "--agents-per-framework", str(count)])
        assert args.agents_per_framework == count
