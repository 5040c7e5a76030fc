"""What reaches a model through a real agent: the framework manifest's runtime options,
every input of a multi-input model, the custom-code gate, labels on top-k results.

Agents run in-process on a real nats-server; models are the real zoo builds."""

from __future__ import annotations

import queue
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import onnxruntime as ort
import pytest
import yaml

from agent.job import Job
from agent.pipeline import Executor, ExecutorConfig
from agent.predictors import probe
from agent.service import Agent, AgentConfig
from agent.worker import LoadedModel, compile_model
from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.contracts import Query, QueryReply, TraceLevel
from mlscope.errors import ConfigError, InputMismatchError, ManifestError, error_from_wire
from mlscope.framework_manifest import FrameworkManifest
from mlscope.manifest_files import load_manifest
from mlscope.model_registry import publish_manifest
from mlscope.operators import labeler
from mlscope.predictor import PredictorOptions
from mlscope.provision import provisioned
from mlscope.settings import Settings
from tests.agent_fixtures import Ask, run_agent
from tests.zoo_fixtures import MANIFESTS

pytestmark = pytest.mark.timeout(180)


def local_catalog(zoo: Path) -> Catalog:
    """The committed catalog: the zoo build's bytes match its checksums on any CPU
    (``mlscope.zoo.build.PORTABLE_MATH``), so agents serve the session's build."""
    del zoo
    return Catalog.load(default_manifest_dirs())


def prepare(model: str, version: str, evaluation_id: str = "ev-1") -> dict[str, Any]:
    return {
        "op": "prepare",
        "evaluation_id": evaluation_id,
        "model": model,
        "model_version": version,
        "batch_size": 1,
        "trace_level": "none",
    }


def loaded(agent: Agent, name: str) -> Any:
    """The predictor the agent opened for model ``name``."""
    (worker,) = [w for k, w in agent.models.workers.items() if k.startswith(f"{name}@")]
    return worker.model.predictor


# --------------------------------------------------------------- framework manifests


def committed_framework(name: str) -> FrameworkManifest:
    fm = load_manifest(MANIFESTS / "frameworks" / f"{name}.yaml")
    assert isinstance(fm, FrameworkManifest)
    return fm


def test_committed_tflite_manifest_sets_the_thread_count_and_threads_flag_wins(
    settings: Settings, zoo_dir: Path
) -> None:
    catalog = local_catalog(zoo_dir)
    want = committed_framework("tflite").options.intra_op_threads
    assert want and want > 1  # the committed file sets a thread count (else: no signal)
    seen: dict[str, Any] = {}
    for flag in (None, 1):
        agent = Agent(settings, AgentConfig(framework="tflite", threads=flag), catalog)

        async def body(
            bus: busmod.Bus, ask: Ask, flag: int | None = flag, agent: Agent = agent
        ) -> None:
            rep = await ask(prepare("digits_cnn", "1.0.0"))
            assert rep["ok"], rep
            seen[str(flag)] = loaded(agent, "digits_cnn").num_threads

        run_agent(settings, agent, body)
    assert seen == {"None": want, "1": 1}


def test_committed_onnxruntime_manifest_reaches_the_session(
    settings: Settings, zoo_dir: Path, tmp_path: Path
) -> None:
    """The real file's options are read back from the created session; the same file
    with other values shows they are the manifest's and not ORT's defaults."""
    real = MANIFESTS / "frameworks" / "onnxruntime.yaml"
    changed = tmp_path / "onnxruntime.yaml"
    changed.write_text(
        real.read_text()
        .replace("graph_optimization: all", "graph_optimization: basic")
        .replace("intra_op_threads: 0", "intra_op_threads: 3")
        .replace("inter_op_threads: 1", "inter_op_threads: 2")
    )
    local = local_catalog(zoo_dir)
    digits = local.find("digits_cnn", framework="onnxruntime")
    variant = load_manifest(changed)
    assert isinstance(variant, FrameworkManifest)
    got = {}
    for label, catalog in (("real", local), ("changed", Catalog([digits], [variant]))):
        agent = Agent(settings, AgentConfig(framework="onnxruntime"), catalog)

        async def body(bus: busmod.Bus, ask: Ask, label: str = label, agent: Agent = agent) -> None:
            rep = await ask(prepare("digits_cnn", "1.0.0"))
            assert rep["ok"], rep
            session = loaded(agent, "digits_cnn").session
            so = session.get_session_options()
            got[label] = (
                so.intra_op_num_threads,
                so.inter_op_num_threads,
                so.graph_optimization_level,
                tuple(session.get_providers()),
            )

        run_agent(settings, agent, body)
    level = ort.GraphOptimizationLevel
    assert committed_framework("onnxruntime").runtime("cpu") == {
        "intra_op_threads": 0,
        "inter_op_threads": 1,
        "graph_optimization": "all",
        "providers": ("CPUExecutionProvider",),
    }
    assert got["real"] == (0, 1, level.ORT_ENABLE_ALL, ("CPUExecutionProvider",))
    assert got["changed"] == (3, 2, level.ORT_ENABLE_BASIC, ("CPUExecutionProvider",))


def test_runtime_options_per_device_and_extra_inlined() -> None:
    ort_fm = committed_framework("onnxruntime")
    assert ort_fm.runtime("cuda:1")["providers"] == (
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    )
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


# --------------------------------------------------------------- custom Python steps

PROBE_MODULE = """
CALLS = []


def tap(env, data):
    CALLS.append((env["model"], len(data)))
    return data
"""


def custom_manifest(tmp_path: Path, zoo: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """digits_cnn as ``digits_custom`` with a custom step first, in a local directory,
    and the step's module importable (it records each call)."""
    (tmp_path / "custom_probe_steps.py").write_text(PROBE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("custom_probe_steps", None)
    digits = local_catalog(zoo).find("digits_cnn", framework="onnxruntime")
    doc = yaml.safe_load(digits.path.read_text())
    doc["name"] = "digits_custom"
    doc["assets"]["sha256"] = digits.graph_sha256(zoo)
    doc.pop("dataset")
    doc["inputs"][0]["steps"].insert(
        0, {"python": {"module": "custom_probe_steps", "function": "tap"}}
    )
    folder = tmp_path / "trusted"
    folder.mkdir()
    (folder / "digits_custom.yaml").write_text(yaml.safe_dump(doc))
    return folder


def calls() -> list[Any]:
    import custom_probe_steps

    out: list[Any] = custom_probe_steps.CALLS
    return out


def query(evaluation_id: str = "ev-1") -> bytes:
    return codec.encode_model(
        Query(evaluation_id=evaluation_id, index=0, inputs=np.ones((2, 8, 8), np.uint8))
    )


def test_custom_step_from_a_trusted_dir_runs_when_allowed(
    settings: Settings, zoo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    catalog = Catalog.load([custom_manifest(tmp_path, zoo_dir, monkeypatch)])
    allowed = settings.with_(allow_custom_code=True)
    agent = Agent(allowed, AgentConfig(framework="onnxruntime"), catalog)

    async def body(bus: busmod.Bus, ask: Ask) -> None:
        rep = await ask(prepare("digits_custom", "1.0.0"))
        assert rep["ok"], rep
        msg = await bus.nc.request(names.agent_query(agent.agent_id), query(), timeout=30)
        reply = codec.decode_model(QueryReply, msg.data)
        assert reply.ok and reply.outputs is not None and reply.outputs.shape == (2, 5)

    run_agent(allowed, agent, body)
    assert calls() == [("digits_custom", 2)]


def test_custom_step_not_allowed_is_a_typed_refusal(
    settings: Settings, zoo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not settings.allow_custom_code  # off unless the agent's settings opt in
    catalog = Catalog.load([custom_manifest(tmp_path, zoo_dir, monkeypatch)])
    entry = catalog.find("digits_custom")
    with pytest.raises(ManifestError, match="custom code is not allowed") as info:
        LoadedModel.open(entry, entry.graph(zoo_dir), PredictorOptions())
    assert info.value.field == "inputs.0.steps.0"
    assert info.value.fields["reason"] == "custom_code"
    agent = Agent(settings, AgentConfig(framework="onnxruntime"), catalog)

    async def body(bus: busmod.Bus, ask: Ask) -> None:
        assert agent.models.offers == []  # not advertised: it could not be prepared
        assert [(r.name, r.reason) for r in agent.models.refused] == [
            ("digits_custom", "custom_code")
        ]
        rep = await ask(prepare("digits_custom", "1.0.0"))
        assert not rep["ok"] and "custom code is not allowed" in rep["why"], rep

    run_agent(settings, agent, body)
    assert calls() == []


def test_the_same_manifest_from_the_bus_never_runs_custom_code(
    settings: Settings, zoo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = Catalog.load([custom_manifest(tmp_path, zoo_dir, monkeypatch)])
    (entry,) = local.entries

    async def publish() -> None:
        async with provisioned(settings, name="publisher") as bus:
            await publish_manifest(bus, entry.manifest)

    anyio.run(publish, backend="asyncio")
    allowed = settings.with_(allow_custom_code=True)
    agent = Agent(allowed, AgentConfig(framework="onnxruntime"), local_catalog(zoo_dir))

    async def body(bus: busmod.Bus, ask: Ask) -> None:
        assert "digits_custom" not in {m.name for m in agent.describe().models}
        rep = await ask(prepare("digits_custom", "1.0.0"))
        assert not rep["ok"] and "the manifest is not trusted" in rep["why"], rep
        remote = [e for e in agent.remote.entries.values() if e.manifest.name == "digits_custom"]
        assert remote and not remote[0].trusted
        with pytest.raises(ManifestError, match="not trusted"):
            compile_model(remote[0], allow_custom=True)

    run_agent(allowed, agent, body)
    assert calls() == []


def test_allow_custom_code_setting_from_the_environment() -> None:
    assert Settings.from_env({}).allow_custom_code is False
    on = Settings.from_env({"MLSCOPE_ALLOW_CUSTOM_CODE": "1"})
    assert on.allow_custom_code and on.as_env()["MLSCOPE_ALLOW_CUSTOM_CODE"] == "1"
    assert Settings.from_env(on.as_env()).allow_custom_code
    assert not Settings.from_env({"MLSCOPE_ALLOW_CUSTOM_CODE": "off"}).allow_custom_code
    with pytest.raises(ConfigError, match="MLSCOPE_ALLOW_CUSTOM_CODE"):
        Settings.from_env({"MLSCOPE_ALLOW_CUSTOM_CODE": "maybe"})


# --------------------------------------------------------------- top-k with labels


def test_topk_labels_from_the_labels_file_only_when_asked(
    settings: Settings, zoo_dir: Path
) -> None:
    entry = local_catalog(zoo_dir).find("efficientnet_lite0", framework="onnxruntime")
    names_file = entry.labels(zoo_dir)
    assert names_file is not None and len(names_file) == 1000
    with np.load(entry.root(zoo_dir) / "sanity.npz") as npz:
        x, y = npz["x"][:2], npz["y"][:2]
    agent = Agent(settings, AgentConfig(framework="onnxruntime"), Catalog([entry]))

    async def body(bus: busmod.Bus, ask: Ask) -> None:
        rep = await ask(prepare("efficientnet_lite0", "1.0.0"))
        assert rep["ok"], rep
        got = []
        for want in (True, False):
            q = Query(evaluation_id="ev-1", index=0, inputs=x, labels=want)
            msg = await bus.nc.request(
                names.agent_query(agent.agent_id), codec.encode_model(q), timeout=60
            )
            got.append(codec.decode_model(QueryReply, msg.data))
        named, plain = got
        assert named.ok and named.outputs is not None and named.labels is not None
        assert named.labels.shape == named.outputs.shape == (2, 5)
        assert list(named.outputs[:, 0]) == list(y)  # the sanity set, right
        assert list(named.labels[:, 0]) == [names_file[i] for i in y]
        assert named.labels.tolist() == [
            [names_file[i] for i in row] for row in named.outputs.tolist()
        ]
        assert plain.ok and plain.labels is None  # load runs build no strings

    run_agent(settings, agent, body)


def test_labeler_names_indices_only() -> None:
    names_ = ["zero", "one", "two"]
    assert labeler([{"softmax": {}}], names_) is None  # probabilities: nothing to name
    assert labeler([{"softmax": {}}, {"topk": {"k": 2}}], None) is None
    name = labeler([{"softmax": {}}, {"topk": {"k": 2}}], names_)
    assert name is not None
    assert name(np.array([[2, 0]], np.int32)).tolist() == [["two", "zero"]]
    with pytest.raises(ValueError, match="outside the 3 labels"):
        name(np.array([[3, 0]], np.int32))


# --------------------------------------------------------------- multi-input models


class Recording:
    """Wraps a real predictor; records the shapes of every input of every call."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.framework, self.device = inner, inner.framework, inner.device
        self.calls: list[list[tuple[int, ...]]] = []

    def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        self.calls.append([tuple(x.shape) for x in inputs])
        out: list[np.ndarray] = self.inner.predict(inputs)
        return out

    def close(self) -> None:
        self.inner.close()


def test_silero_vad_on_onnxruntime_through_the_worker(zoo_dir: Path) -> None:
    """Three inputs: audio (batch on axis 0), state (batch on axis 1), sr (shared).
    Warm-up fills each from the manifest; queries carry the audio alone (state and sr
    filled) or all three; merged queries are joined on each input's own batch axis."""
    entry = Catalog.load(default_manifest_dirs()).find("silero_vad", framework="onnxruntime")
    graph = entry.graph(zoo_dir)
    model = LoadedModel.open(entry, graph, PredictorOptions(threads=1))
    assert model.warmup() > 0
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    audio = [rng.standard_normal((n, 576)).astype(np.float32) * 0.1 for n in (1, 3, 2)]
    state = rng.standard_normal((2, 2, 128)).astype(np.float32)
    sr = np.array(16000, np.int64)

    def want(x: np.ndarray, s: np.ndarray | None = None) -> np.ndarray:
        s = np.zeros((2, len(x), 128), np.float32) if s is None else s
        out: np.ndarray = session.run(None, {"input": x, "state": s, "sr": sr})[0]
        return out

    model.predictor = Recording(model.predictor)
    ex = Executor(model, ExecutorConfig(max_batch=8, max_wait_us=300_000))
    replies: queue.SimpleQueue[QueryReply] = queue.SimpleQueue()
    jobs = [
        Job(
            index=0,
            inputs=audio[0],
            received_ns=time.perf_counter_ns(),
            level=TraceLevel.NONE,
            spans=None,
            reply=replies.put,
        ),
        Job(
            index=1,
            inputs=audio[1],
            received_ns=time.perf_counter_ns(),
            level=TraceLevel.NONE,
            spans=None,
            reply=replies.put,
        ),
        Job(
            index=2,
            inputs=audio[2],
            received_ns=time.perf_counter_ns(),
            level=TraceLevel.NONE,
            spans=None,
            reply=replies.put,
            more=(state, sr),
        ),
        Job(
            index=3,
            inputs=audio[0],
            received_ns=time.perf_counter_ns(),
            level=TraceLevel.NONE,
            spans=None,
            reply=replies.put,
            more=(state, sr, sr),
        ),
    ]  # one input too many
    try:
        assert all(ex.submit(j) for j in jobs)
        got = [replies.get(timeout=60) for _ in jobs]
    finally:
        ex.stop()
    assert [r.index for r in got] == [0, 1, 2, 3]
    for r, x, s in zip(got[:3], audio, (None, None, state), strict=True):
        assert r.ok and r.outputs is not None, r.error
        np.testing.assert_allclose(r.outputs, want(x, s), atol=1e-5)
    err = error_from_wire(got[3].error or {})
    assert isinstance(err, InputMismatchError) and "takes 3 input(s)" in str(err)
    calls = model.predictor.calls
    assert [(6, 576), (2, 6, 128), ()] in calls  # one batch of the three queries


def test_silero_vad_over_the_bus_with_its_further_inputs(settings: Settings) -> None:
    agent = Agent(
        settings, AgentConfig(framework="onnxruntime"), Catalog.load(default_manifest_dirs())
    )
    x = np.zeros((2, 576), np.float32)

    async def body(bus: busmod.Bus, ask: Ask) -> None:
        rep = await ask(prepare("silero_vad", "6.2.3"))
        assert rep["ok"] and rep["first_inference_ns"] > 0, rep
        for more in ((), (np.zeros((2, 2, 128), np.float32), np.array(16000, np.int64))):
            q = Query(evaluation_id="ev-1", index=0, inputs=x, more_inputs=more)
            msg = await bus.nc.request(
                names.agent_query(agent.agent_id), codec.encode_model(q), timeout=60
            )
            reply = codec.decode_model(QueryReply, msg.data)
            assert reply.ok and reply.outputs is not None, reply.error
            assert reply.outputs.shape == (2, 1)

    run_agent(settings, agent, body)


@pytest.mark.parametrize("framework", ["onnxruntime", "pytorch", "tensorflow", "tflite"])
def test_every_model_an_agent_advertises_can_be_prepared(
    settings: Settings, zoo_dir: Path, framework: str
) -> None:
    # `make install` installs all four frameworks: one that does not load is a failure
    assert probe(framework) is not None, f"{framework} does not load here"
    agent = Agent(settings, AgentConfig(framework=framework, threads=1), local_catalog(zoo_dir))
    failed: dict[str, str] = {}

    async def body(bus: busmod.Bus, ask: Ask) -> None:
        offers = agent.describe().models
        assert offers
        for i, offer in enumerate(offers):
            ev = f"ev-{i}"
            rep = await ask(prepare(offer.name, offer.version, ev))
            if not rep["ok"]:
                failed[offer.name] = rep["why"]
            await ask({"op": "release", "evaluation_id": ev, "unload": True})

    run_agent(settings, agent, body)
    assert failed == {}
