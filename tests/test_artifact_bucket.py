"""The artifact bucket is written by other clients: an agent fetching from it on a real
nats-server takes a good build, and refuses a hostile one with an ArtifactError that
names it, without writing or hashing anything outside the model's own directory,
replacing another model, or stopping."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic import ValidationError

import mlscope
from mlscope import artifact_bucket, names, objects
from mlscope import bus as busmod
from mlscope.buildlock import LOCK_NAME, BuildLock
from mlscope.errors import ArtifactError
from mlscope.manifest import Assets, ModelManifest
from mlscope.manifest_files import parse_manifest
from mlscope.model_registry import publish_manifest
from mlscope.natsserver import NatsServer
from mlscope.provision import provisioned
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


def b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


def digest(data: bytes) -> str:
    return "SHA-256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()


async def put_meta(settings: Settings, name: str, meta: dict[str, Any] | bytes) -> None:
    """An object's meta as any client that may put objects can publish it by hand,
    naming chunks it never wrote, or another object's."""
    bucket = names.ARTIFACTS_BUCKET
    if isinstance(meta, dict):
        meta = json.dumps({"name": name, "bucket": bucket, **meta}).encode()
    async with busmod.connect(settings, name="forger") as bus:
        await artifact_bucket.ensure_bucket(bus)
        await bus.js.publish(f"$O.{bucket}.M.{b64(name)}", meta)


async def put_donor(settings: Settings, data: bytes) -> dict[str, Any]:
    """Object ``donor`` (real chunks); the fields of a meta that tells its truth."""
    async with busmod.connect(settings, name="pusher") as bus:
        info = await (await artifact_bucket.ensure_bucket(bus)).put("donor", data)
    return {"nuid": info.nuid, "size": info.size, "chunks": info.chunks, "digest": info.digest}


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


async def put_hostile(settings: Settings, hostile: str) -> None:
    """Build evil 1.0.0 in the bucket, made hostile in one way."""
    if hostile == "a lock naming an artifact no file makes":
        bad = lock("evil", "1.0.0", artifacts={"nothere": "0" * 64})
        await put(settings, {"evil/1.0.0/g.onnx": DATA, f"evil/1.0.0/{LOCK_NAME}": bad})
        return
    truth = await put_donor(settings, DATA)
    await put(settings, {f"evil/1.0.0/{LOCK_NAME}": lock("evil", "1.0.0")})
    await put_meta(settings, "evil/1.0.0/g.onnx", {**truth, "nuid": "NOCHUNKS"})


@pytest.mark.parametrize(
    "hostile", ["a lock naming an artifact no file makes", "a file whose chunks never come"]
)
def test_an_agent_starts_and_serves_beside_a_hostile_build(
    bucket: tuple[Settings, Path], hostile: str, tmp_path: Path
) -> None:
    """A published manifest whose build is hostile: the agent starts, registers and
    refuses that model; it neither stops nor waits on that model for ever."""
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
        async with provisioned(settings, name="publisher") as bus:
            model = parse_manifest(manifest, file="evil")
            assert isinstance(model, ModelManifest)
            await publish_manifest(bus, model)
        await put_hostile(settings, hostile)

    async def registered() -> list[Any]:
        async with busmod.connect(settings, name="probe") as bus:
            return await list_agents(bus)

    anyio.run(publish)
    log = tmp_path / "agent.log"
    with log.open("wb") as out:
        agent = subprocess.Popen(
            [python(), "-m", "cli.main", "agent", "--framework", "noop", "--agent-id", "a1"],
            env=child_env(settings),
            stderr=out,
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
        # An operator's terminal says when it is ready and what it serves (logged
        # right after the registry entry is written).
        ready = f"agent a1 ready: noop {mlscope.__version__} on cpu, "
        ready += f"{len(agents[0].models)} model(s) served, "
        deadline = time.monotonic() + 10
        while ready not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready in log.read_text(), log.read_text()[-2000:]
    finally:
        agent.terminate()
        agent.wait(20)


LINK = {"options": {"link": {"bucket": names.ARTIFACTS_BUCKET, "name": "donor"}}}
FORGED: dict[str, tuple[dict[str, Any] | bytes, str]] = {
    "no chunks on its subject": ({"nuid": "NOCHUNKS"}, "sent no chunk within"),
    "more bytes than it declares": ({"size": 5}, "more than the 5 bytes"),
    "fewer bytes than it declares": ({"size": len(DATA) + 1000}, f"has {len(DATA)} of the"),
    "no bytes over real chunks": ({"chunks": 0, "size": 0}, "do not match its meta"),
    "a link": (LINK, "is a link"),
    "deleted": ({"deleted": True}, "lacks g.onnx"),
    "an empty nuid": ({"nuid": ""}, "no valid chunk subject"),
    "a wildcard nuid": ({"nuid": ">"}, "no valid chunk subject"),
    "no digest": ({"digest": None}, "no valid SHA-256 digest"),
    "a digest that is no sha256": ({"digest": "SHA-256=AAAA"}, "no valid SHA-256 digest"),
    "another object's digest": ({"digest": digest(b"other")}, "do not match its meta"),
    "a size that is no count": ({"size": "17"}, "malformed meta"),
    "no JSON": (b"{", "cannot fetch g.onnx of forged 1"),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_a_forged_object_meta_is_refused_without_waiting_on_it(
    bucket: tuple[Settings, Path], case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The meta of g.onnx is published by hand over the donor's real chunks (the
    lock is genuine): whatever it claims, the fetch ends promptly with an
    ArtifactError that names the model and the file, and puts nothing in place."""
    monkeypatch.setattr(objects, "CHUNK_IDLE_S", 0.5)
    settings, zoo = bucket
    change, expected = FORGED[case]
    truth = anyio.run(put_donor, settings, DATA)
    meta = change if isinstance(change, bytes) else {**truth, **change}
    anyio.run(put, settings, {f"forged/1/{LOCK_NAME}": lock("forged", "1")})
    anyio.run(put_meta, settings, "forged/1/g.onnx", meta)
    with pytest.raises(ArtifactError, match=r"g\.onnx") as caught:
        anyio.run(fetch, settings, zoo, "forged", "1")
    assert "forged" in str(caught.value) and expected in str(caught.value)
    assert not (zoo / "forged" / "1").exists()


def test_a_lock_whose_chunks_never_come_is_refused(
    bucket: tuple[Settings, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(objects, "CHUNK_IDLE_S", 0.5)
    settings, zoo = bucket
    truth = anyio.run(put_donor, settings, lock("forged", "1"))
    anyio.run(put_meta, settings, f"forged/1/{LOCK_NAME}", {**truth, "nuid": "NOCHUNKS"})
    with pytest.raises(ArtifactError, match=f"forged/1/{LOCK_NAME}.*sent no chunk"):
        anyio.run(fetch, settings, zoo, "forged", "1")


def test_a_meta_that_understates_its_size_writes_no_more_than_it_declares(
    bucket: tuple[Settings, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A meta of 10 bytes over 1 MiB of real chunks: the limit is checked against what
    arrives, not only against what the meta declares, so next to nothing is written."""
    settings, zoo = bucket
    truth = anyio.run(put_donor, settings, b"x" * (1 << 20))
    anyio.run(put, settings, {f"forged/1/{LOCK_NAME}": lock("forged", "1")})
    anyio.run(put_meta, settings, "forged/1/g.onnx", {**truth, "size": 10})
    written: list[int] = []
    real_open = Path.open

    def counting_open(self: Path, *args: Any, **kwargs: Any) -> Any:
        fh = real_open(self, *args, **kwargs)
        if ".fetch-" in str(self.parent):
            write = fh.write

            def counted(data: bytes) -> int:
                written.append(len(data))
                return int(write(data))

            fh.write = counted
        return fh

    monkeypatch.setattr(Path, "open", counting_open)
    with pytest.raises(ArtifactError, match="more than the 10 bytes"):
        anyio.run(lambda: fetch(settings, zoo, "forged", "1", max_bytes=1000))
    assert sum(written) <= 10


@pytest.mark.parametrize("broken", ["missing", "a directory", "a fifo", "a fifo lock"])
def test_push_refuses_a_file_the_lock_lists_that_is_not_a_regular_file(
    bucket: tuple[Settings, Path], tmp_path: Path, broken: str
) -> None:
    """A lock naming a file that is gone, a directory or a FIFO (whose hash would
    block forever), or a lock that is a FIFO itself, is the model's ArtifactError,
    not an OSError or a hang."""
    settings, _ = bucket
    model = tmp_path / "broken" / "1"
    model.mkdir(parents=True)
    if broken == "a directory":
        (model / "g.onnx").mkdir()
    elif broken == "a fifo":
        os.mkfifo(model / "g.onnx")
    if broken == "a fifo lock":
        (model / "g.onnx").write_bytes(DATA)
        os.mkfifo(model / LOCK_NAME)
    else:
        BuildLock("broken", "1", {"g.onnx": SHA}, {"g.onnx": SHA}, {}, {}).write(model)

    async def push() -> None:
        async with busmod.connect(settings, name="pusher") as bus:
            with anyio.fail_after(20):
                await artifact_bucket.push(bus, model)

    with pytest.raises(ArtifactError, match=LOCK_NAME if "lock" in broken else r"g\.onnx"):
        anyio.run(push)
