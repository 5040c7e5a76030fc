"""What reaches a model through a real agent: the framework manifest's runtime options,
every input of a multi-input model, the custom-code gate, labels on top-k results.

Agents run in-process on a real nats-server; models are the real zoo builds."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import onnxruntime as ort
import pytest

from agent.service import Agent, AgentConfig
from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.artifacts import sha256_path
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.errors import error_from_wire
from mlscope.manifest import FrameworkManifest, load_manifest
from mlscope.settings import Settings
from tests.zoo_fixtures import MANIFESTS

pytestmark = pytest.mark.timeout(180)

Ask = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def run_agent(settings: Settings, agent: Agent,
              body: Callable[[busmod.Bus, Ask], Awaitable[None]]) -> None:
    """Start ``agent`` on the bus, run ``body(bus, ask_ctl)``, stop the agent."""

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            async with busmod.connect(settings, name="test") as bus:
                async def ask(req: dict[str, Any]) -> dict[str, Any]:
                    msg = await bus.nc.request(names.agent_ctl(agent.agent_id),
                                               codec.encode(req), timeout=60)
                    out: dict[str, Any] = codec.decode(msg.data)
                    if "error" in out and req.get("op") == "prepare" and not out.get("ok"):
                        out["ok"] = False
                        out["why"] = str(error_from_wire(out["error"]))
                    return out

                await body(bus, ask)
            tg.cancel_scope.cancel()

    switch = sys.getswitchinterval()  # the agent shortens it for its process
    try:
        anyio.run(main, backend="asyncio")
    finally:
        sys.setswitchinterval(switch)


def local_catalog(zoo: Path) -> Catalog:
    """The committed catalog with its zoo entries pinned to this machine's build.

    Zoo models are trained and exported here; float results differ across CPUs, so
    the committed checksums may not match a local build, and an agent does not serve
    an artifact that fails its checksum. Everything else is the committed manifest.
    """
    committed = Catalog.load(default_manifest_dirs())
    entries = []
    for e in committed.entries:
        a = e.manifest.assets
        if (a.base_url or "").startswith("zoo://") and (e.root(zoo) / a.graph_path).exists():
            sha = sha256_path(e.root(zoo) / a.graph_path)
            e = replace(e, manifest=e.manifest.model_copy(
                update={"assets": a.model_copy(update={"sha256": sha}), "dataset": None}))
        entries.append(e)
    return Catalog(entries, committed.frameworks)


def prepare(model: str, version: str, evaluation_id: str = "ev-1") -> dict[str, Any]:
    return {"op": "prepare", "evaluation_id": evaluation_id, "model": model,
            "model_version": version, "batch_size": 1, "trace_level": "none"}


def loaded(agent: Agent, name: str) -> Any:
    """The predictor the agent opened for model ``name``."""
    (worker,) = [w for k, w in agent.workers.items() if k.startswith(f"{name}@")]
    return worker.model.predictor


# --------------------------------------------------------------- framework manifests


def committed_framework(name: str) -> FrameworkManifest:
    fm = load_manifest(MANIFESTS / "frameworks" / f"{name}.yaml")
    assert isinstance(fm, FrameworkManifest)
    return fm


def test_committed_tflite_manifest_sets_the_thread_count_and_threads_flag_wins(
        settings: Settings, zoo_dir: Path) -> None:
    catalog = local_catalog(zoo_dir)
    want = committed_framework("tflite").options.intra_op_threads
    assert want and want > 1  # the committed file sets a thread count (else: no signal)
    seen: dict[str, Any] = {}
    for flag in (None, 1):
        agent = Agent(settings, AgentConfig(framework="tflite", threads=flag), catalog)

        async def body(bus: busmod.Bus, ask: Ask, flag: int | None = flag,
                       agent: Agent = agent) -> None:
            rep = await ask(prepare("digits_cnn", "1.0.0"))
            assert rep["ok"], rep
            seen[str(flag)] = loaded(agent, "digits_cnn").num_threads

        run_agent(settings, agent, body)
    assert seen == {"None": want, "1": 1}


def test_committed_onnxruntime_manifest_reaches_the_session(settings: Settings, zoo_dir: Path,
                                                            tmp_path: Path) -> None:
    """The real file's options are read back from the created session; the same file
    with other values shows they are the manifest's and not ORT's defaults."""
    real = MANIFESTS / "frameworks" / "onnxruntime.yaml"
    changed = tmp_path / "onnxruntime.yaml"
    changed.write_text(real.read_text().replace("graph_optimization: all",
                                                "graph_optimization: basic")
                       .replace("intra_op_threads: 0", "intra_op_threads: 3")
                       .replace("inter_op_threads: 1", "inter_op_threads: 2"))
    local = local_catalog(zoo_dir)
    digits = local.find("digits_cnn", framework="onnxruntime")
    variant = load_manifest(changed)
    assert isinstance(variant, FrameworkManifest)
    got = {}
    for label, catalog in (("real", local), ("changed", Catalog([digits], [variant]))):
        agent = Agent(settings, AgentConfig(framework="onnxruntime"), catalog)

        async def body(bus: busmod.Bus, ask: Ask, label: str = label,
                       agent: Agent = agent) -> None:
            rep = await ask(prepare("digits_cnn", "1.0.0"))
            assert rep["ok"], rep
            session = loaded(agent, "digits_cnn").session
            so = session.get_session_options()
            got[label] = (so.intra_op_num_threads, so.inter_op_num_threads,
                          so.graph_optimization_level, tuple(session.get_providers()))

        run_agent(settings, agent, body)
    level = ort.GraphOptimizationLevel
    assert committed_framework("onnxruntime").runtime("cpu") == {
        "intra_op_threads": 0, "inter_op_threads": 1, "graph_optimization": "all",
        "providers": ("CPUExecutionProvider",)}
    assert got["real"] == (0, 1, level.ORT_ENABLE_ALL, ("CPUExecutionProvider",))
    assert got["changed"] == (3, 2, level.ORT_ENABLE_BASIC, ("CPUExecutionProvider",))


def test_runtime_options_per_device_and_extra_inlined() -> None:
    ort_fm = committed_framework("onnxruntime")
    assert ort_fm.runtime("cuda:1")["providers"] == ("CUDAExecutionProvider",
                                                     "CPUExecutionProvider")
    assert ort_fm.runtime("cpu")["providers"] == ("CPUExecutionProvider",)
    tf_fm = committed_framework("tensorflow")
    assert tf_fm.runtime("cpu")["signature"] == "serving_default"
    assert "extra" not in tf_fm.runtime("cpu")


def test_a_gpu_device_with_cpu_only_providers_is_refused() -> None:
    from agent.predictors.onnxruntime import _providers
    from mlscope.errors import ModelLoadError
    from mlscope.predictor import PredictorOptions

    digits = Catalog.load(default_manifest_dirs()).find("digits_cnn", framework="onnxruntime")
    opts = PredictorOptions(device="cuda:0", runtime={"providers": ["CPUExecutionProvider"]})
    with pytest.raises(ModelLoadError, match="no GPU provider"):
        _providers(opts, digits.manifest)

