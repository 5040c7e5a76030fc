"""The artifact bucket is written by other clients: an agent fetching from it on a real
nats-server takes a good build, and refuses a hostile one with an ArtifactError that
names it, without writing or hashing anything outside the model's own directory,
replacing another model, or stopping."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic import ValidationError

from mlscope import artifact_bucket
from mlscope import bus as busmod
from mlscope.buildlock import LOCK_NAME, BuildLock
from mlscope.errors import ArtifactError
from mlscope.manifest import Assets, ModelManifest, parse_manifest
from mlscope.model_registry import publish_manifest
from mlscope.natsserver import NatsServer
from mlscope.registry import list_agents
from mlscope.settings import Settings
from tests.conftest import child_env, python

DATA = b"the model's bytes"
SHA = hashlib.sha256(DATA).hexdigest()


def lock(model: str = "evil", version: str = "1", **change: Any) -> bytes:
    doc = {
        "format": 1,
        "model": model,
        "version": version,
        "artifacts": {"g.onnx": SHA},
        "files": {"g.onnx": SHA},
        **change,
    }
    return json.dumps(doc).encode()


@pytest.fixture
def bucket(nats_server: NatsServer, tmp_path: Path) -> tuple[Settings, Path]:
    """A bus with one good model already in a data dir's zoo (which nothing may touch)."""
    zoo = tmp_path / "data" / "zoo"
    kept = zoo / "kept" / "1.0.0"
    kept.mkdir(parents=True)
    (kept / "g.onnx").write_bytes(DATA)
    BuildLock("kept", "1.0.0", {"g.onnx": SHA}, {"g.onnx": SHA}, {}, {}).write(kept)
    return Settings(nats_url=nats_server.url, data_dir=tmp_path / "data"), zoo


async def put(settings: Settings, objects: dict[str, bytes]) -> None:
    async with busmod.connect(settings, name="pusher") as bus:
        obs = await artifact_bucket.ensure_bucket(bus)
        for name, data in objects.items():
            await obs.put(name, data)


async def fetch(settings: Settings, zoo: Path, name: str, version: str, **kw: Any) -> Any:
    async with busmod.connect(settings, name="agent") as bus:
        with anyio.fail_after(30):
            return await artifact_bucket.fetch(bus, zoo, name, version, **kw)


def everything(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_a_good_build_is_fetched_and_verified(bucket: tuple[Settings, Path]) -> None:
    settings, zoo = bucket
    anyio.run(put, settings, {"good/2/g.onnx": DATA, f"good/2/{LOCK_NAME}": lock("good", "2")})
    got = anyio.run(fetch, settings, zoo, "good", "2")
    assert got.files == {"g.onnx": SHA} and got.origin["by"] == "bus"
    assert (zoo / "good" / "2" / "g.onnx").read_bytes() == DATA


HOSTILE: dict[str, bytes] = {
    "absolute artifact": lock(artifacts={"/dev/zero": "0" * 64}),
    "artifact outside": lock(artifacts={"../../../../etc/passwd": "0" * 64}),
    "artifact no file makes": lock(artifacts={"nothere": "0" * 64}),
    "empty file name": lock(files={"": SHA, "g.onnx": SHA}),
    "a file and a directory": lock(files={"a": SHA, "a/b": SHA}, artifacts={}),
    "one file twice": lock(files={"g.onnx": SHA, "./g.onnx": SHA}),
    "file outside": lock(files={"../../kept/1.0.0/g.onnx": SHA}, artifacts={}),
    "lock of another model": lock(model="kept", version="1.0.0"),
    "not a lock": b"[" * 100_000 + b"]" * 100_000,
    "wrong bytes": lock(files={"g.onnx": "0" * 64}, artifacts={}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_lock_is_refused_and_nothing_outside_is_touched(
    bucket: tuple[Settings, Path], case: str
) -> None:
    settings, zoo = bucket
    data = zoo.parent
    before = everything(data)
    objects = {"evil/1/g.onnx": DATA, "evil/1/a": DATA, "evil/1/a/b": DATA}
    anyio.run(put, settings, {**objects, f"evil/1/{LOCK_NAME}": HOSTILE[case]})
    with pytest.raises(ArtifactError):
        anyio.run(fetch, settings, zoo, "evil", "1")
    assert everything(data) - before <= {"zoo/evil"}  # an empty parent at most
    assert not any((zoo / "evil").iterdir()) if (zoo / "evil").exists() else True
    assert (zoo / "kept" / "1.0.0" / "g.onnx").read_bytes() == DATA


@pytest.mark.parametrize(("name", "version"), [("a", ".."), ("..", "1"), ("a/b", "1"), ("a", "")])
def test_coordinates_that_name_another_directory_are_refused(
    bucket: tuple[Settings, Path], name: str, version: str
) -> None:
    """``zoo://a/..`` would make the zoo itself the model's directory, which a fetch
    replaces: refused by the manifest and by the fetch alike."""
    settings, zoo = bucket
    before = everything(zoo)
    anyio.run(put, settings, {f"a/../{LOCK_NAME}": lock("a", ".."), "a/../g.onnx": DATA})
    with pytest.raises(ArtifactError, match="zoo://NAME/VERSION"):
        anyio.run(fetch, settings, zoo, name, version)
    with pytest.raises(ValidationError):
        Assets(base_url=f"zoo://{name}/{version}", graph_path="g.onnx")
    assert everything(zoo) == before


def test_a_file_over_the_limit_is_refused_before_it_is_downloaded(
    bucket: tuple[Settings, Path],
) -> None:
    settings, zoo = bucket
    anyio.run(put, settings, {"big/1/g.onnx": DATA, f"big/1/{LOCK_NAME}": lock("big", "1")})
    with pytest.raises(ArtifactError, match="MLSCOPE_MAX_ARTIFACT_BYTES"):
        anyio.run(lambda: fetch(settings, zoo, "big", "1", max_bytes=len(DATA) - 1))
    assert not (zoo / "big" / "1").exists()


def test_an_agent_starts_and_serves_beside_a_hostile_build(
    bucket: tuple[Settings, Path],
) -> None:
    """A published manifest whose build lock is hostile: the agent starts, registers
    and refuses that model; it did not stop (before: a traceback at every start)."""
    settings, _ = bucket
    manifest = {
        "kind": "model",
        "task": "platform_overhead",
        "name": "evil",
        "version": "1.0.0",
        "framework": {"name": "noop", "version": "*"},
        "inputs": [
            {"type": "tensor", "layer_name": "input", "element_type": "float32", "shape": [16]}
        ],
        "outputs": [{"type": "tensor", "layer_name": "output"}],
        "assets": {"base_url": "zoo://evil/1.0.0", "graph_path": "g.onnx"},
        "latency_only": True,
    }

    async def publish() -> None:
        async with busmod.connect(settings, name="publisher", provision=True) as bus:
            model = parse_manifest(manifest, file="evil")
            assert isinstance(model, ModelManifest)
            await publish_manifest(bus, model)
        bad = lock("evil", "1.0.0", artifacts={"nothere": "0" * 64})
        await put(settings, {"evil/1.0.0/g.onnx": DATA, f"evil/1.0.0/{LOCK_NAME}": bad})

    async def registered() -> list[Any]:
        async with busmod.connect(settings, name="probe") as bus:
            return await list_agents(bus)

    anyio.run(publish)
    agent = subprocess.Popen(
        [python(), "-m", "cli.main", "agent", "--framework", "noop", "--agent-id", "a1"],
        env=child_env(settings),
    )
    try:
        deadline = time.monotonic() + 60
        agents: list[Any] = []
        while not agents and time.monotonic() < deadline and agent.poll() is None:
            time.sleep(0.5)
            agents = anyio.run(registered)
        assert agent.poll() is None and [a.agent_id for a in agents] == ["a1"]
        refused = {r.name: r.message for r in agents[0].refused}
        assert "evil" in refused and "noop" in {m.name for m in agents[0].models}
    finally:
        agent.terminate()
        agent.wait(20)
