"""Artifact fetch policy: a manifest from the bus names only the bus's artifact store
or URLs under the operator's prefixes; every download is capped and hashed as it
streams. The stack test proves that no agent requests a URL or opens a file that a
hostile bus manifest names."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import anyio
import pytest
import yaml

from mlscope import bus as busmod
from mlscope.artifacts import ArtifactStore
from mlscope.errors import ArtifactError, ChecksumMismatch
from mlscope.fetchpolicy import FetchPolicy
from mlscope.manifest import ModelManifest
from mlscope.manifest_files import parse_manifest
from mlscope.model_registry import publish_manifest
from mlscope.registry import list_agents
from tests.conftest import REPO
from tests.security_fixtures import Recorder, auth_stack, role

pytestmark = pytest.mark.timeout(240)

BODY = b"model bytes " * 1000
SHA = hashlib.sha256(BODY).hexdigest()


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("http://h:8000/models/a.onnx", True),
        ("http://h:8000/models", True),
        ("http://h:8000/modelsX/a.onnx", False),
        ("http://h:8000/models/../secret", False),
        ("http://h:8000/models/%2e%2e/secret", False),
        ("http://user@h:8000/models/a", False),
        ("http://h:8001/models/a", False),
        ("https://h:8000/models/a", False),
        ("http://other/models/a", False),
        ("file:///models/a", False),
    ],
)
def test_url_prefixes_compare_parsed_urls(url: str, ok: bool) -> None:
    policy = FetchPolicy(url_prefixes=("http://h:8000/models/",))
    if ok:
        policy.check_url(url)
    else:
        with pytest.raises(ArtifactError, match="not under an allowed"):
            policy.check_url(url)


@pytest.mark.parametrize(
    "base_url", [None, "weights", "file:///etc", "pkg://onnx", "http://127.0.0.1:1/x", "ftp://h/x"]
)
def test_untrusted_locations_are_refused_before_any_access(
    tmp_path: Path, base_url: str | None
) -> None:
    store = ArtifactStore(tmp_path)
    with pytest.raises(ArtifactError) as err:
        store.resolve(base_url, "x.onnx", SHA, manifest_dir=tmp_path, trusted=False)
    assert err.value.fields["reason"] == "policy"
    assert not (tmp_path / "artifacts").exists()


def test_downloads_are_capped_hashed_and_kept_under_the_prefix(tmp_path: Path) -> None:
    with (
        Recorder(BODY) as ok,
        Recorder(BODY, content_length=False) as unannounced,
        Recorder(redirect_to=f"{ok.url}/elsewhere") as bouncer,
    ):
        prefixes = (f"{ok.url}/m/", f"{unannounced.url}/m/", f"{bouncer.url}/m/")
        store = ArtifactStore(
            tmp_path, policy=FetchPolicy(url_prefixes=prefixes, max_bytes=1 << 20)
        )
        got = store.resolve(f"{ok.url}/m", "a.onnx", SHA, manifest_dir=tmp_path, trusted=False)
        assert got.read_bytes() == BODY
        for server in (ok, unannounced):  # announced too big / streams past the cap
            with pytest.raises(ArtifactError, match="cap") as err:
                store.download(
                    f"{server.url}/m/b.onnx", "0" * 64, max_bytes=len(BODY) - 1, trusted=False
                )
            assert err.value.fields["reason"] == "too_large"
        with pytest.raises(ChecksumMismatch):
            store.download(f"{ok.url}/m/c.onnx", "1" * 64, trusted=False)
        # the redirect target is not under the bouncer's prefix
        with pytest.raises(ArtifactError, match="not under an allowed"):
            store.download(f"{bouncer.url}/m/d.onnx", SHA, name="d.onnx", trusted=False)
        assert ok.requests == ["/m/a.onnx", "/m/b.onnx", "/m/c.onnx"]  # none redirected
    leftovers = [
        p
        for p in (tmp_path / "artifacts").rglob("*")
        if p.is_file() and not p.name.endswith(".lock")
    ]
    assert leftovers == [got]  # nothing partial or unverified stays


def _hostile(name: str, base_url: str, graph: str, sha256: str) -> ModelManifest:
    doc = yaml.safe_load((REPO / "manifests/models/digits_cnn.onnxruntime.yaml").read_text())
    doc.update(name=name)
    for key in ("build", "dataset", "attributes"):
        doc.pop(key, None)
    doc["outputs"][0].pop("labels", None)
    doc["assets"] = {"base_url": base_url, "graph_path": graph, "sha256": sha256}
    manifest = parse_manifest(doc, file=name)
    assert isinstance(manifest, ModelManifest)
    return manifest


def test_bus_manifests_make_no_agent_fetch_or_open_anything(
    tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path
) -> None:
    base = tmp_path_factory.mktemp("fetchsec")
    trap = base / "trap"
    trap.mkdir()
    os.mkfifo(trap / "model.onnx")  # opening it to hash it would block the agent for good
    with Recorder(BODY) as listener, auth_stack(base, zoo_dir, ["onnxruntime"]) as (stack, auth):
        hostile = [
            _hostile("evil_http", f"{listener.url}/models", "model.onnx", SHA),
            _hostile("evil_file", f"file://{trap}", "model.onnx", SHA),
            _hostile("evil_pkg", "pkg://onnx", "__init__.py", SHA),
        ]
        server = role(stack, auth, "server")
        reader = role(stack, auth, "reader")

        async def main() -> dict[str, str]:
            async with busmod.connect(server, name="attacker") as bus:
                for m in hostile:
                    await publish_manifest(bus, m)
            async with busmod.connect(reader, name="observer") as bus:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    agents = await list_agents(bus)
                    refused: dict[str, str] = {r.name: r.reason for a in agents for r in a.refused}
                    offered = {o.name for a in agents for o in a.models}
                    if {m.name for m in hostile} <= set(refused):
                        assert not offered & set(refused)
                        return refused
                    await anyio.sleep(0.2)
            raise AssertionError(f"the agent never refused the bus manifests: {refused}")

        refused = anyio.run(main, backend="asyncio")
        assert {n: refused[n] for n in ("evil_http", "evil_file", "evil_pkg")} == dict.fromkeys(
            ("evil_http", "evil_file", "evil_pkg"), "policy"
        )
        time.sleep(0.5)
        assert listener.requests == []
        assert not stack.dead()
