"""The files of ``mlscope auth`` and ``mlscope edge init``: seeds are private from the
moment they exist, nothing is written through a planted link, an existing auth
directory is not silently re-keyed, a damaged ``roles.json`` is one line naming it, and
a domain is one subject token. No server: files under tmp_path only."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.main import main as mlscope_main
from mlscope import auth_files, secrets_io
from mlscope.agentauth import add_agent
from mlscope.auth import ROLES
from mlscope.auth_files import inbox_prefix_for, write_auth
from mlscope.errors import ConfigError


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The usual umask, under which a plain write_text is world-readable."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def first_modes(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The mode each file had when it was about to get its final one: before a chmod,
    or before the rename of its temporary file into place."""
    seen: dict[str, int] = {}
    real_chmod, real_replace = Path.chmod, os.replace

    def chmod(self: Path, mode: int, **kw: bool) -> None:
        seen.setdefault(self.name, _mode(self))
        real_chmod(self, mode, **kw)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        seen.setdefault(Path(dst).name, _mode(Path(src)))
        real_replace(src, dst)

    monkeypatch.setattr(Path, "chmod", chmod)
    monkeypatch.setattr(os, "replace", replace)
    return seen


def _init(out: Path, *extra: str) -> int:
    return mlscope_main(["auth", "init", "--out", str(out), *extra])


# ---- seeds are private from the start -------------------------------------------------


def test_auth_init_never_has_a_seed_readable_by_others(
    tmp_path: Path, umask_022: None, first_modes: dict[str, int]
) -> None:
    write_auth(tmp_path / "auth")
    creds = {f"{role}.creds" for role in ROLES}
    assert creds <= set(first_modes), "a seed file was written without a mode change"
    assert {n: oct(m) for n, m in first_modes.items() if n in creds and m & 0o077} == {}
    for name in creds:
        assert _mode(tmp_path / "auth" / name) == 0o600


def test_add_agent_never_has_a_seed_readable_by_others(
    tmp_path: Path, umask_022: None, first_modes: dict[str, int]
) -> None:
    write_auth(tmp_path / "auth")
    first_modes.clear()
    creds = add_agent(tmp_path / "auth", "a1")
    assert first_modes.get(creds.name, 0o777) & 0o077 == 0
    assert _mode(creds) == 0o600


def test_auth_init_does_not_write_a_seed_through_a_symlink(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "auth"
    out.mkdir()
    (out / "server.creds").symlink_to(victim)
    assert _init(out) == 0
    assert victim.read_text() == "precious\n", "a seed was written through the symlink"
    assert not (out / "server.creds").is_symlink() and _mode(out / "server.creds") == 0o600


def test_add_agent_does_not_write_a_seed_through_a_symlink(tmp_path: Path) -> None:
    out = tmp_path / "auth"
    assert _init(out) == 0
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (out / "agent-a1.creds").symlink_to(victim)
    assert mlscope_main(["auth", "add-agent", "a1", "--out", str(out)]) == 0
    assert victim.read_text() == "precious\n"
    assert _mode(out / "agent-a1.creds") == 0o600


def test_add_agent_says_how_to_run_the_agent_it_issued(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "auth"
    assert _init(out) == 0
    argv = ["auth", "add-agent", "a1", "--out", str(out)]
    capsys.readouterr()
    assert mlscope_main([*argv, "--framework", "onnxruntime"]) == 0
    creds = out / "agent-a1.creds"
    run = f"run: MLSCOPE_NATS_CREDS={creds} mlscope agent --agent-id a1 --framework"
    assert f"{run} onnxruntime\n" in capsys.readouterr().out  # the one it may serve
    assert mlscope_main([*argv, "--framework", "noop", "--framework", "tflite"]) == 0
    assert f"{run} F\n" in capsys.readouterr().out  # one of those: the user's choice


def test_edge_init_keeps_the_copied_edge_seed_private(tmp_path: Path, umask_022: None) -> None:
    auth_dir, edge = tmp_path / "auth", tmp_path / "edge"
    assert _init(auth_dir) == 0
    seed = (auth_dir / "edge.creds").read_text().strip()
    edge.mkdir()
    planted = tmp_path / "planted.conf"
    (edge / "leaf.conf").symlink_to(planted)  # dangling: must not be followed
    argv = ["edge", "init", "--hub", "nats-leaf://hub:7422", "--out", str(edge)]
    assert mlscope_main([*argv, "--creds", str(auth_dir / "edge.creds")]) == 0
    assert not planted.exists()
    holding = [f for f in edge.iterdir() if seed in f.read_text()]
    assert [f.name for f in holding] == ["leaf.conf"]
    assert _mode(edge / "leaf.conf") == 0o600
    assert sorted(f.name for f in edge.iterdir()) == ["edge.env", "leaf.conf"]  # no temp


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "server.creds"
    target.write_text("old\n")

    def refuse(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        secrets_io.write_secret(target, "new\n")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["server.creds"]


# ---- an existing auth directory is not silently re-keyed -------------------------------


def test_auth_init_over_an_existing_directory_is_refused_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "auth"
    assert _init(out) == 0
    assert mlscope_main(["auth", "add-agent", "a1", "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert _init(out) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--force" in err and "server.conf" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    assert _init(out, "--force") == 0  # rotates every key, drops the added agent
    assert (out / "submitter.creds").read_bytes() != before["submitter.creds"]
    assert "a1" not in json.loads((out / "roles.json").read_text()).get("agents", {})


def test_a_lone_roles_json_also_counts_as_an_existing_directory(tmp_path: Path) -> None:
    out = tmp_path / "auth"
    out.mkdir()
    (out / "roles.json").write_text("{}\n")
    with pytest.raises(ConfigError, match=r"roles\.json"):
        write_auth(out)
    assert sorted(p.name for p in out.iterdir()) == ["roles.json"]


# ---- a damaged roles.json --------------------------------------------------------------

DAMAGED = [
    '{"agents": []}',
    '{"agents": {"a1": 5}}',
    '{"agents": {"a1": {}}}',
    '{"reply_window_s": "x"}',
    '{"reply_window_s": true}',
    '{"reply_window_s": -1}',
    '{"reply_window_s": NaN}',
    '{"public_keys": []}',
    '{"inbox_prefixes": {"agent": 1}}',
    '{"edge_domain": 7}',
    "[]",
    "not json",
]


@pytest.mark.parametrize("roles", DAMAGED)
def test_add_agent_with_a_damaged_roles_json_is_one_line(
    tmp_path: Path, roles: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "auth"
    assert _init(out) == 0
    (out / "roles.json").write_text(roles)
    conf = (out / "server.conf").read_bytes()
    capsys.readouterr()
    assert mlscope_main(["auth", "add-agent", "a1", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "roles.json" in err, err
    assert (out / "server.conf").read_bytes() == conf
    assert not (out / "agent-a1.creds").exists()


def test_a_damaged_roles_json_beside_a_seed_is_named_when_connecting(tmp_path: Path) -> None:
    out = tmp_path / "auth"
    write_auth(out)
    (out / "roles.json").write_text('{"public_keys": {"agent": ["x"]}}')
    with pytest.raises(ConfigError, match=r"roles\.json"):
        inbox_prefix_for(out / "agent.creds")


def test_a_missing_roles_json_is_no_roles(tmp_path: Path) -> None:
    assert auth_files.read_roles(tmp_path) == {}
    assert auth_files.read_roles(tmp_path / "nowhere") == {}


# ---- domains are one subject token -----------------------------------------------------

NOT_TOKENS = [">", "*", "a.b", "", "a b", "edge>", "hub*"]


@pytest.mark.parametrize("flag", ["--edge-domain", "--hub-domain"])
@pytest.mark.parametrize("value", NOT_TOKENS)
def test_auth_init_refuses_a_domain_that_is_not_one_token(
    tmp_path: Path, flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        _init(tmp_path / "auth", flag, value)
    assert info.value.code == 2
    assert f"argument {flag}: must be one subject token" in capsys.readouterr().err
    assert not (tmp_path / "auth").exists()


@pytest.mark.parametrize("flag", ["--domain", "--hub-domain"])
def test_edge_init_refuses_a_domain_that_is_not_one_token(
    tmp_path: Path, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["edge", "init", "--hub", "nats-leaf://hub:7422", "--out", str(tmp_path / "e")]
    with pytest.raises(SystemExit) as info:
        mlscope_main([*argv, flag, "*"])
    assert info.value.code == 2
    assert f"argument {flag}: must be one subject token" in capsys.readouterr().err


def test_edge_attach_refuses_a_domain_that_is_not_one_token(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The domain becomes the source's API prefix ``$JS.<domain>.API``."""
    with pytest.raises(SystemExit) as info:
        mlscope_main(["edge", "attach", "edge.*"])
    assert info.value.code == 2
    assert "argument domain: must be one subject token" in capsys.readouterr().err


def test_write_auth_refuses_a_wildcard_domain_itself(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="hub domain must be one subject token"):
        write_auth(tmp_path / "auth", hub_domain="*")
    assert not (tmp_path / "auth").exists()


def test_ordinary_domains_are_taken_as_given(tmp_path: Path) -> None:
    assert _init(tmp_path / "auth", "--edge-domain", "edge_7-b", "--hub-domain", "Hub2") == 0
    roles = json.loads((tmp_path / "auth" / "roles.json").read_text())
    assert (roles["edge_domain"], roles["hub_domain"]) == ("edge_7-b", "Hub2")


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "latin1"])
def test_credentials_that_are_no_small_text_file_are_a_bus_error(tmp_path: Path, kind: str) -> None:
    """A FIFO blocked every service at start-up, /dev/zero filled its memory, a Latin-1
    byte was a UnicodeDecodeError from deep inside connect."""
    from mlscope.bus import connect_options
    from mlscope.errors import BusError
    from mlscope.settings import Settings

    creds = tmp_path / "x.creds"
    if kind == "fifo":
        os.mkfifo(creds)
    elif kind == "directory":
        creds.mkdir()
    elif kind == "latin1":
        creds.write_bytes(b"SUAcaf\xe9\n")
    path = Path("/dev/zero") if kind == "device" else creds
    with pytest.raises(BusError, match="cannot read NATS credentials"):
        connect_options(Settings(nats_url="nats://127.0.0.1:1", nats_creds=path))


@pytest.mark.parametrize("kind", ["fifo", "directory", "latin1"])
def test_an_edge_env_that_is_no_text_file_is_a_config_error(tmp_path: Path, kind: str) -> None:
    """A FIFO blocked ``mlscope edge up``; a directory or a Latin-1 byte was a traceback."""
    from cli.edge_cmd import read_env

    env = tmp_path / "edge.env"
    if kind == "fifo":
        os.mkfifo(env)
    elif kind == "directory":
        env.mkdir()
    else:
        env.write_bytes(b"MLSCOPE_EDGE_AGENT_ID=caf\xe9\n")
    with pytest.raises(ConfigError, match="cannot read"):
        read_env(tmp_path)


@pytest.mark.timeout(10)
def test_a_fifo_in_place_of_a_seed_is_no_key_not_a_wait(tmp_path: Path) -> None:
    """Reading a seed for its public key blocked on a FIFO until a writer came."""
    from mlscope.agentauth import bound_id

    out = tmp_path / "auth"
    write_auth(out)
    add_agent(out, "a1")
    for name in ("agent.creds", "agent-a1.creds"):
        (out / name).unlink()
        os.mkfifo(out / name)
    assert inbox_prefix_for(out / "agent.creds") is None
    assert bound_id(out / "agent-a1.creds", "agent") is None
