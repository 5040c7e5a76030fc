"""Adding and removing a model at run time, without code (paper section 4.6).

A manifest published to the bus reaches the running agent and server through their
registry watchers: the agent starts serving and advertising it, the server resolves it,
and removing it withdraws it again. Nothing is restarted.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import anyio
import pytest
import yaml

from mlscope import bus as busmod
from mlscope import names
from mlscope.contracts import EvaluationSummary, JobRequest, ScenarioSpec
from mlscope.errors import UnknownModelError
from mlscope.hashing import sha256_path
from mlscope.jobs import submit
from mlscope.registry import list_agents
from mlscope.settings import Settings
from tests.conftest import REPO, child_env, python

pytestmark = pytest.mark.timeout(240)

LIVE = "digits_live"


def run_job(settings: Settings, model: str) -> EvaluationSummary:
    job = JobRequest(
        model=model,
        framework="onnxruntime",
        scenario=ScenarioSpec(name="online", qps=100, duration_s=1, seed=1),
    )
    return anyio.run(lambda: submit(settings, job, timeout=120), backend="asyncio")


def offered(settings: Settings) -> set[str]:
    async def go() -> set[str]:
        async with busmod.connect(settings, name="test") as bus:
            return {o.name for a in await list_agents(bus) for o in a.models}

    return anyio.run(go, backend="asyncio")


def wait_offered(settings: Settings, model: str, present: bool, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (model in offered(settings)) == present:
            return
        time.sleep(0.2)
    raise AssertionError(f"{model} {'never appeared' if present else 'stayed'} in the registry")


def mlscope(
    settings: Settings, *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python(), "-m", "cli.main", *args],
        env=child_env(settings),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def live_manifest(tmp_path: Path) -> Path:
    """digits_cnn's ONNX manifest under a new name: same verified zoo artifact."""
    doc = yaml.safe_load((REPO / "manifests/models/digits_cnn.onnxruntime.yaml").read_text())
    doc["name"] = LIVE
    path = tmp_path / f"{LIVE}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_model_published_at_run_time_is_served_then_withdrawn(
    stack: Settings, tmp_path: Path
) -> None:
    with pytest.raises(UnknownModelError):
        run_job(stack, LIVE)

    # A broken value in the bucket is reported and ignored; it must not stop the watchers.
    # Nor may the model be published under a key that is not its own: `models remove`
    # would leave that copy serving.
    impostor = yaml.safe_load(live_manifest(tmp_path).read_text())

    async def put_garbage() -> None:
        async with busmod.connect(stack, name="test") as bus:
            kv = await bus.kv(names.MODELS_BUCKET)
            await kv.put("garbage.1.onnxruntime", b"{not json")
            await kv.put("impostor", json.dumps(impostor).encode())

    anyio.run(put_garbage, backend="asyncio")

    out = mlscope(stack, "models", "publish", str(live_manifest(tmp_path)))
    assert out.returncode == 0, out.stderr
    assert f"{LIVE}.1.0.0.onnxruntime" in out.stdout
    wait_offered(stack, LIVE, present=True)

    s = run_job(stack, LIVE)
    assert s.status == "completed" and s.model["name"] == LIVE
    assert s.queries > 0 and s.errors == 0
    assert s.accuracy is not None and s.accuracy["top1"] > 0.8

    listing = mlscope(stack, "models", "--remote", "--json")
    assert listing.returncode == 0, listing.stderr
    assert LIVE in listing.stdout

    out = mlscope(
        stack, "models", "remove", LIVE, "--version", "1.0.0", "--framework", "onnxruntime"
    )
    assert out.returncode == 0, out.stderr
    wait_offered(stack, LIVE, present=False)
    with pytest.raises(UnknownModelError):
        run_job(stack, LIVE)
    # The built-in model was served throughout.
    assert "digits_cnn" in offered(stack)
    again = mlscope(
        stack, "models", "remove", LIVE, "--version", "1.0.0", "--framework", "onnxruntime"
    )
    assert again.returncode == 1 and "not in the bus registry" in again.stderr


def test_a_model_file_of_ones_own_is_initialised_published_and_served(
    stack: Settings, tmp_path: Path
) -> None:
    """The README's flow for a model file of one's own: `models init` writes a manifest
    beside it, `models publish` puts the file into the artifact bucket and the manifest
    on the bus, and an agent fetches, verifies and serves it, with nothing restarted."""
    built = next((stack.zoo_dir / "digits_cnn").glob("*/digits_cnn.onnx"))
    (tmp_path / "own_cnn.onnx").write_bytes(built.read_bytes())
    init = mlscope(stack, "models", "init", "own_cnn.onnx", cwd=tmp_path)
    assert init.returncode == 0, init.stderr
    manifest = tmp_path / "own_cnn.onnxruntime.yaml"
    out = mlscope(stack, "models", "publish", str(manifest))
    assert out.returncode == 0, out.stderr
    assert "own_cnn.1.0.0.onnxruntime" in out.stdout
    wait_offered(stack, "own_cnn", present=True, timeout=60)
    s = run_job(stack, "own_cnn")
    assert s.status == "completed" and s.queries > 0 and s.errors == 0

    # Other bytes under the same name and version are refused, not swapped in.
    (tmp_path / "own_cnn.onnx").write_bytes(built.read_bytes() + b"\0")
    doc = yaml.safe_load(manifest.read_text())
    doc["assets"]["sha256"] = sha256_path(tmp_path / "own_cnn.onnx")
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(doc))
    again = mlscope(stack, "models", "publish", str(changed))
    assert again.returncode == 1 and "new version" in again.stderr, again.stderr
    # A file changed since its manifest pinned it is refused before anything is sent.
    stale = mlscope(stack, "models", "publish", str(manifest))
    assert stale.returncode == 1 and "changed since the manifest" in stale.stderr


def test_publish_names_a_missing_asset_file(stack: Settings, tmp_path: Path) -> None:
    doc = yaml.safe_load((REPO / "manifests/models/digits_cnn.onnxruntime.yaml").read_text())
    doc["assets"]["base_url"] = "weights"
    doc["assets"]["sha256"] = "ab" * 32  # not a built zoo:// asset any more: pinned
    doc.pop("dataset")
    path = tmp_path / "relative.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = mlscope(stack, "models", "publish", str(path))
    assert out.returncode == 1
    assert str(tmp_path / "weights" / "digits_cnn.onnx") in out.stderr, out.stderr
