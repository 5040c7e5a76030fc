"""The catalog over the committed manifests, and the model registry on a real NATS."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from cli import models_cmd
from mlscope.catalog import Catalog
from mlscope.contracts import AgentDescription, FrameworkInfo, JobRequest, ModelOffer
from mlscope.errors import ArtifactError, ManifestError, UnknownModelError
from mlscope.model_registry import (
    delete_manifest,
    load_remote,
    load_remote_entries,
    manifest_key,
    publish_manifest,
    publish_manifests,
)
from mlscope.natsserver import NatsServer
from mlscope.operators import compile_steps
from mlscope.provision import provisioned
from mlscope.settings import Settings
from tests.conftest import agent_description
from tests.zoo_fixtures import MANIFESTS


def catalog() -> Catalog:
    return Catalog.load([MANIFESTS])


def test_zoo_models_on_every_framework() -> None:
    cat = catalog()
    for name in ("digits_cnn", "mnist_lenet", "efficientnet_lite0"):
        fws = {e.manifest.framework.name for e in cat.entries if e.manifest.name == name}
        assert fws == {"onnxruntime", "pytorch", "tensorflow", "tflite"}, name
    assert {e.manifest.framework.name for e in cat.entries if e.manifest.name == "silero_vad"} == {
        "onnxruntime",
        "pytorch",
    }
    assert {e.manifest.framework.name for e in cat.entries if e.manifest.name == "basic_pitch"} == {
        "onnxruntime",
        "tflite",
        "tensorflow",
    }
    light = [e for e in cat.entries if e.manifest.name.startswith("light_")]
    assert len(light) == 9 and all(e.manifest.latency_only for e in light)
    assert cat.find("mp_face_detection").manifest.dataset is not None
    assert {f.name for f in cat.frameworks} == {"onnxruntime", "pytorch", "tensorflow", "tflite"}


def test_find_by_version_and_framework() -> None:
    cat = catalog()
    e = cat.find("digits_cnn", version=">=1.0,<2", framework="tflite")
    assert e.manifest.framework.name == "tflite"
    with pytest.raises(UnknownModelError, match="has no manifest"):
        cat.find("digits_cnn", version=">=2")
    with pytest.raises(UnknownModelError, match="known models"):
        cat.find("nope")


def test_packaged_models_resolve_and_verify(tmp_path: Path) -> None:
    """pkg:// assets are read in place from installed wheels, checksum-verified."""
    cat = catalog()
    for name in ("light_resnet50", "silero_vad", "basic_pitch"):
        for e in cat.entries:
            if e.manifest.name == name:
                assert e.graph(tmp_path / "zoo").exists()


def test_missing_zoo_artifact_says_build(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="mlscope zoo build"):
        catalog().find("mnist_lenet", framework="onnxruntime").graph(tmp_path / "zoo")


def test_models_command_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    models_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["models", "--json"])
    args.settings = Settings(data_dir=tmp_path)
    assert args.func(args) == 0
    tasks = json.loads(capsys.readouterr().out)
    rows = {(r["name"], r["framework"]): r for rs in tasks.values() for r in rs}
    light = rows[("light_resnet50", "onnxruntime")]
    assert light["available"] and light["size_bytes"] > 0 and light["latency_only"]
    assert not rows[("digits_cnn", "tflite")]["available"]
    assert "image_classification" in tasks and "voice_activity_detection" in tasks
    args = parser.parse_args(["models"])
    args.settings = Settings(data_dir=tmp_path)
    assert args.func(args) == 0
    assert "efficientnet_lite0" in capsys.readouterr().out


def test_registry_round_trip_is_untrusted(tmp_path: Path) -> None:
    cat = catalog()

    async def scenario() -> None:
        with NatsServer(store_dir=tmp_path / "nats") as server:
            settings = Settings(nats_url=server.url, data_dir=tmp_path)
            async with provisioned(settings, name="test") as bus:
                keys = await publish_manifests(bus, cat)
                assert len(keys) == len(cat.entries) == len(set(keys))
                assert "digits_cnn.1.0.0.onnxruntime" in keys
                remote = await load_remote(bus)
                assert {m.key for m in remote} == {e.manifest.key for e in cat.entries}
                assert not any(m.trusted for m in remote)
                by_key = {m.key: m for m in remote}
                local = cat.find("digits_cnn", framework="onnxruntime").manifest
                assert by_key[local.key].model_dump() == local.model_dump()
                # a custom step in a manifest from the bus never compiles
                evil = local.model_copy(
                    update={
                        "name": "evil",
                        "inputs": (
                            local.inputs[0].model_copy(
                                update={
                                    "steps": ({"python": {"module": "os", "function": "system"}},)
                                }
                            ),
                        ),
                    }
                )
                await publish_manifest(bus, evil)
                entries = {e.manifest.name: e for e in await load_remote_entries(bus)}
                got = entries["evil"]
                assert not got.trusted and not got.manifest.trusted
                with pytest.raises(ManifestError, match="not trusted"):
                    compile_steps(
                        got.manifest.inputs[0].steps,
                        trusted=got.manifest.trusted,
                        allow_custom=True,
                    )
                merged = cat.merged(entries.values())
                assert merged.find("evil").trusted is False
                assert merged.find("digits_cnn", framework="onnxruntime").trusted
                await delete_manifest(bus, evil)
                assert "evil" not in {m.name for m in await load_remote(bus)}
                # a bad value is a ManifestError that names its key
                kv = await bus.kv("mlscope_models")
                await kv.put("broken.1.0.0.onnxruntime", b'{"name": "broken"}')
                # nats-py's keys() watcher can end its initial pass early on a loaded
                # machine; the listing is retried, the assertion is not weakened.
                for _ in range(20):
                    try:
                        await load_remote(bus)
                    except ManifestError as exc:
                        assert "mlscope_models/broken" in str(exc)
                        break
                    await asyncio.sleep(0.25)
                else:
                    pytest.fail("the broken manifest was never reported")

    asyncio.run(scenario())


def test_manifest_key_sanitizes() -> None:
    m = catalog().find("digits_cnn", framework="onnxruntime").manifest
    local = m.model_copy(update={"version": "1.0.0+cpu.1"})
    assert manifest_key(local) == "digits_cnn.1.0.0_cpu.1.onnxruntime"


def digits_agent(catalog: Catalog, *, heartbeat_at: float = 0.0) -> AgentDescription:
    """An onnxruntime 1.31.1 agent serving digits_cnn, as the registry holds it."""
    m = catalog.find("digits_cnn", framework="onnxruntime").manifest
    return agent_description(
        "a1",
        frameworks=(FrameworkInfo(name="onnxruntime", version="1.31.1"),),
        models=(ModelOffer(name=m.name, version=m.version, framework="onnxruntime"),),
        heartbeat_at=heartbeat_at,
    )


def test_a_job_waits_only_for_an_agent_seen_moments_ago() -> None:
    """A failover can hold heartbeats back: the server waits for an agent that matched
    a few seconds ago, never for one gone long ago or one that never matched."""
    from broker.resolve import RESOLVE_GRACE_S, recently_alive

    catalog = Catalog.load([MANIFESTS])
    now = 1000.0
    job = JobRequest(model="digits_cnn", framework="onnxruntime")
    late = digits_agent(catalog, heartbeat_at=now - 7)  # stale (TTL 5 s), seen 7 s ago
    assert recently_alive(job, [late], catalog, now=now)
    gone = digits_agent(catalog, heartbeat_at=now - RESOLVE_GRACE_S - 1)
    assert not recently_alive(job, [gone], catalog, now=now)
    other = job.model_copy(update={"framework_version": ">=2"})
    assert not recently_alive(other, [late], catalog, now=now)
    assert not recently_alive(job, [], catalog, now=now)


def test_a_pinned_manifest_that_changed_is_refused() -> None:
    """``mlscope rerun`` pins the manifest's content: resolution refuses another one."""
    from broker.resolve import resolve
    from cli.rerun_cmd import rerun_job
    from mlscope.errors import ResolutionError
    from mlscope.manifest import manifest_digest

    catalog = Catalog.load([MANIFESTS])
    m = catalog.find("digits_cnn", framework="onnxruntime").manifest
    agent = digits_agent(catalog)
    stored: dict[str, object] = {
        "job": JobRequest(model="digits_cnn", framework="onnxruntime").dump(),
        "manifest": m.model_dump(mode="json"),
        "agent": agent.dump(),
    }
    job = rerun_job(stored, "ev-first")
    assert job.manifest_sha256 == m.digest == manifest_digest(m.model_dump(mode="json"))
    assert job.framework_version == "==1.31.1" and job.rerun_of == "ev-first"
    assert resolve(job, [agent], catalog)[1].manifest == m  # unchanged: resolves

    other = JobRequest(
        model="digits_cnn", framework="onnxruntime", manifest_sha256="0" * 64, rerun_of="ev-first"
    )
    with pytest.raises(ResolutionError, match="changed since ev-first"):
        resolve(other, [agent], catalog)
    newer = job.model_copy(update={"framework_version": "==1.32.0"})
    with pytest.raises(ResolutionError, match="no live agent"):
        resolve(newer, [agent], catalog)
