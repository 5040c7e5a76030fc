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


def mlscope(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python(), "-m", "cli.main", *args],
        env=child_env(settings),
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


def test_publish_refuses_relative_assets_naming_file_and_field(
    stack: Settings, tmp_path: Path
) -> None:
    doc = yaml.safe_load((REPO / "manifests/models/digits_cnn.onnxruntime.yaml").read_text())
    doc["assets"]["base_url"] = "weights"
    doc["assets"]["sha256"] = "ab" * 32  # not a built zoo:// asset any more: pinned
    doc.pop("dataset")
    path = tmp_path / "relative.yaml"
    path.write_text(yaml.safe_dump(doc))
    out = mlscope(stack, "models", "publish", str(path))
    assert out.returncode == 1
    assert str(path) in out.stderr and "assets.base_url" in out.stderr
