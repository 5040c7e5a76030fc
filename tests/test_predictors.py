"""The predictor contract, one parametrized suite for every framework.

Every backend opens the same tiny model (tests/predictor_models.py: same weights in
every format) and must: match the numpy reference at batch sizes 1 and 4 (and after
changing batch size on one predictor); turn a wrong dtype, shape or input count into
an InputMismatchError carrying model, framework, expected and actual, and keep
working afterwards; turn a corrupt or missing file into a ModelLoadError; close
idempotently; and report a real version from probe().

XRT runs against tests/fake_pyxrt (a numpy stand-in with pyxrt's API whose kernel
computes the same network). CUDA variants run where a CUDA device is present and
skip otherwise.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch

import mlscope
from agent.predictors import module, open_predictor, probe
from mlscope.divergence import divergence
from mlscope.errors import (
    ConfigError,
    FrameworkUnavailable,
    InferenceError,
    InputMismatchError,
    ModelLoadError,
    PredictorError,
    error_from_wire,
)
from mlscope.predictor import Predictor, PredictorOptions
from tests import predictor_models as pm

FAKE_PYXRT = Path(__file__).parent / "fake_pyxrt"
CUDA = torch.cuda.is_available()
ORT_CUDA = CUDA and "CUDAExecutionProvider" in ort.get_available_providers()
ATOL = 1e-5


@dataclass(frozen=True)
class Backend:
    id: str
    framework: str
    artifact: str | None
    """Key into ModelSet.paths (None: the predictor loads no file)."""
    device: str = "cpu"
    checks_inputs: bool = True
    """Checks dtype and shape (noop checks only the count)."""
    computes: bool = True
    """Computes the network (noop echoes its inputs)."""
    attributes: dict[str, Any] = field(default_factory=dict)


_GPU = [pytest.mark.gpu]
_SKIP_TORCH = pytest.mark.skipif(not CUDA, reason="no CUDA device")
_SKIP_ORT = pytest.mark.skipif(not ORT_CUDA, reason="no CUDA device or no ORT CUDA provider")
BACKENDS = [
    pytest.param(Backend("onnxruntime", "onnxruntime", "onnx"), id="onnxruntime"),
    pytest.param(Backend("pytorch-ts", "pytorch", "torchscript"), id="pytorch-ts"),
    pytest.param(Backend("pytorch-ep", "pytorch", "exported"), id="pytorch-ep"),
    pytest.param(Backend("tensorflow", "tensorflow", "saved_model"), id="tensorflow"),
    pytest.param(Backend("tflite", "tflite", "tflite"), id="tflite"),
    pytest.param(
        Backend("xrt", "xrt", "xclbin", device="fpga:0", attributes=pm.xrt_attributes()),
        id="xrt-standin",
    ),
    pytest.param(Backend("noop", "noop", None, checks_inputs=False, computes=False), id="noop"),
    pytest.param(
        Backend("onnxruntime-cuda", "onnxruntime", "onnx", device="cuda:0"),
        id="onnxruntime-cuda",
        marks=[*_GPU, _SKIP_ORT],
    ),
    pytest.param(
        Backend("pytorch-ts-cuda", "pytorch", "torchscript", device="cuda:0"),
        id="pytorch-ts-cuda",
        marks=[*_GPU, _SKIP_TORCH],
    ),
    pytest.param(
        Backend("pytorch-ep-cuda", "pytorch", "exported", device="cuda:0"),
        id="pytorch-ep-cuda",
        marks=[*_GPU, _SKIP_TORCH],
    ),
]


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> pm.ModelSet:
    return pm.build(tmp_path_factory.mktemp("predictor_models"))


@pytest.fixture
def fake_pyxrt(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Put the pyxrt stand-in on sys.path for one test, and take it away after."""
    monkeypatch.syspath_prepend(str(FAKE_PYXRT))
    sys.modules.pop("pyxrt", None)
    import pyxrt

    yield pyxrt
    sys.modules.pop("pyxrt", None)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    b: Backend = request.param
    if b.framework == "xrt":
        request.getfixturevalue("fake_pyxrt")
    return b


def _open(
    backend: Backend, models: pm.ModelSet, path: Path | None = None, **options: Any
) -> Predictor:
    if path is None and backend.artifact is not None:
        path = models.paths[backend.artifact]
    manifest = pm.manifest(backend.framework, attributes=backend.attributes)
    opts = PredictorOptions(device=backend.device, threads=1, **options)
    return open_predictor(backend.framework, path, manifest, opts)  # type: ignore[arg-type]


@pytest.fixture
def predictor(backend: Backend, models: pm.ModelSet) -> Iterator[Predictor]:
    pred = _open(backend, models)
    yield pred
    pred.close()


def _expected(backend: Backend, models: pm.ModelSet, x: np.ndarray) -> np.ndarray:
    return models.reference(x) if backend.computes else x


def _assert_works(pred: Predictor, backend: Backend, models: pm.ModelSet, batch: int = 2) -> None:
    x = pm.sample_inputs(batch, seed=batch)
    (y,) = pred.predict([x])
    assert y.shape == (batch, pm.OUT if backend.computes else pm.IN)
    np.testing.assert_allclose(y, _expected(backend, models, x), atol=ATOL, rtol=0)


def _assert_mismatch(err: InputMismatchError, backend: Backend) -> None:
    fields = err.fields
    assert fields["model"] == "tiny_mlp"
    assert fields["framework"] == backend.framework
    assert "expected" in fields and "actual" in fields
    assert fields["expected"] != fields["actual"]
    wire = error_from_wire(err.to_wire())  # survives the trip over the bus, typed
    assert isinstance(wire, InputMismatchError) and wire.fields["model"] == "tiny_mlp"


# -- the contract -------------------------------------------------------------------------


def test_probe_reports_real_version(backend: Backend) -> None:
    info = probe(backend.framework)
    assert info is not None and info.name == backend.framework
    real: dict[str, Callable[[], str]] = {  # each asks only its own runtime
        "onnxruntime": lambda: str(ort.__version__),
        "pytorch": lambda: str(torch.__version__).split("+")[0],
        "tensorflow": _tf_version,
        "tflite": lambda: dist_version("ai-edge-litert"),
        "xrt": lambda: "2.17.0",  # from the stand-in's host report, as real XRT gives it
        "noop": lambda: mlscope.__version__,
    }
    assert info.version == real[backend.framework]()
    assert backend.device in info.devices


@pytest.mark.parametrize("batch", [1, 4])
def test_outputs_match_reference(
    predictor: Predictor, backend: Backend, models: pm.ModelSet, batch: int
) -> None:
    x = pm.sample_inputs(batch)
    outputs = predictor.predict([x])
    assert len(outputs) == 1
    assert outputs[0].dtype == np.float32
    assert outputs[0].shape == (batch, pm.OUT if backend.computes else pm.IN)
    np.testing.assert_allclose(outputs[0], _expected(backend, models, x), atol=ATOL, rtol=0)
    assert predictor.framework == backend.framework


def test_batch_size_changes_on_one_predictor(
    predictor: Predictor, backend: Backend, models: pm.ModelSet
) -> None:
    for batch in (1, 4, 1, 3, 8):
        _assert_works(predictor, backend, models, batch)


def test_read_only_and_strided_inputs(
    predictor: Predictor, backend: Backend, models: pm.ModelSet
) -> None:
    """Arrays decoded from a bus message are read-only; slices are not contiguous."""
    x = pm.sample_inputs(3)
    ro = np.frombuffer(x.tobytes(), np.float32).reshape(3, pm.IN)
    assert not ro.flags.writeable
    np.testing.assert_allclose(
        predictor.predict([ro])[0], _expected(backend, models, x), atol=ATOL, rtol=0
    )
    wide = pm.sample_inputs(6)[::2]
    np.testing.assert_allclose(
        predictor.predict([wide])[0], _expected(backend, models, wide), atol=ATOL, rtol=0
    )


def test_wrong_dtype_is_input_mismatch(
    predictor: Predictor, backend: Backend, models: pm.ModelSet
) -> None:
    if not backend.checks_inputs:  # the noop model echoes any input it is given
        x = pm.sample_inputs(2).astype(np.float64)
        np.testing.assert_array_equal(predictor.predict([x])[0], x)
        return
    with pytest.raises(InputMismatchError) as ei:
        predictor.predict([pm.sample_inputs(2).astype(np.float64)])
    _assert_mismatch(ei.value, backend)
    assert ei.value.fields["expected"] == "float32" and ei.value.fields["actual"] == "float64"
    _assert_works(predictor, backend, models)


@pytest.mark.parametrize(
    "shape", [(2, pm.IN - 1), (2, pm.IN, 1), (pm.IN,)], ids=["features", "rank-up", "no-batch"]
)
def test_wrong_shape_is_input_mismatch(
    predictor: Predictor, backend: Backend, models: pm.ModelSet, shape: tuple[int, ...]
) -> None:
    if not backend.checks_inputs:  # the noop model echoes any input it is given
        x = np.zeros(shape, np.float32)
        np.testing.assert_array_equal(predictor.predict([x])[0], x)
        return
    with pytest.raises(InputMismatchError) as ei:
        predictor.predict([np.zeros(shape, np.float32)])
    _assert_mismatch(ei.value, backend)
    assert ei.value.fields["actual"] == list(shape)
    _assert_works(predictor, backend, models)


@pytest.mark.parametrize("count", [0, 2])
def test_wrong_input_count_is_input_mismatch(
    predictor: Predictor, backend: Backend, models: pm.ModelSet, count: int
) -> None:
    with pytest.raises(InputMismatchError) as ei:
        predictor.predict([pm.sample_inputs(2)] * count)
    _assert_mismatch(ei.value, backend)
    assert ei.value.fields["actual"] == count
    _assert_works(predictor, backend, models)


def _loads_a_file(param: Any) -> bool:
    backend: Backend = param.values[0]
    return backend.artifact is not None


@pytest.fixture(params=[p for p in BACKENDS if _loads_a_file(p)])
def file_backend(request: pytest.FixtureRequest) -> Backend:
    """The backends that load a model file (the noop backend loads none)."""
    b: Backend = request.param
    if b.framework == "xrt":
        request.getfixturevalue("fake_pyxrt")
    return b


def test_corrupt_model_is_load_error(
    file_backend: Backend, models: pm.ModelSet, tmp_path: Path
) -> None:
    backend = file_backend
    assert backend.artifact is not None
    good = models.paths[backend.artifact]
    bad = tmp_path / good.name
    garbage = b"\x00not a model\xff" * 64
    if good.is_dir():  # a SavedModel directory with a corrupt graph
        bad.mkdir()
        (bad / "saved_model.pb").write_bytes(garbage)
    else:
        bad.write_bytes(garbage)
    for path in (bad, tmp_path / "missing" / good.name):
        with pytest.raises(ModelLoadError) as ei:
            _open(backend, models, path)
        assert ei.value.fields["model"] == "tiny_mlp"
        assert ei.value.fields["framework"] == backend.framework


def test_close_is_idempotent(backend: Backend, models: pm.ModelSet) -> None:
    pred = _open(backend, models)
    _assert_works(pred, backend, models)
    pred.close()
    pred.close()
    with pytest.raises(InferenceError):
        pred.predict([pm.sample_inputs(1)])


# -- framework specifics -------------------------------------------------------------------


def test_registry_knows_frameworks_and_rejects_others() -> None:
    with pytest.raises(ConfigError):
        module("caffe")
    info = probe("noop")
    assert info is not None and info.version == mlscope.__version__


def test_pytorch_runtime_failure_is_inference_error(models: pm.ModelSet, tmp_path: Path) -> None:
    class Fragile(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if bool(x.sum() > 1000.0):
                raise RuntimeError("overflow guard tripped")
            return x * 2

    path = tmp_path / "fragile.pt"
    torch.jit.save(torch.jit.script(Fragile()), str(path))
    pred = open_predictor("pytorch", path, pm.manifest("pytorch"), PredictorOptions())
    with pytest.raises(InferenceError) as ei:
        pred.predict([np.full((2, pm.IN), 100.0, np.float32)])
    assert ei.value.fields["framework"] == "pytorch" and ei.value.fields["batch_size"] == 2
    x = pm.sample_inputs(2)
    np.testing.assert_array_equal(pred.predict([x])[0], x * 2)


@pytest.mark.skipif(CUDA, reason="checks the no-GPU path")
@pytest.mark.parametrize(
    "framework,artifact",
    [("pytorch", "torchscript"), ("onnxruntime", "onnx"), ("tensorflow", "saved_model")],
)
def test_gpu_device_without_gpu_is_load_error(
    models: pm.ModelSet, framework: str, artifact: str
) -> None:
    with pytest.raises(ModelLoadError) as ei:
        open_predictor(
            framework,
            models.paths[artifact],
            pm.manifest(framework),
            PredictorOptions(device="cuda:0"),
        )
    assert ei.value.fields["device"] == "cuda:0"


def test_onnxruntime_options_from_framework_manifest(models: pm.ModelSet) -> None:
    runtime = {
        "providers": ["CPUExecutionProvider"],
        "inter_op_threads": 2,
        "execution_mode": "parallel",
        "graph_optimization": "basic",
    }
    pred = open_predictor(
        "onnxruntime",
        models.paths["onnx"],
        pm.manifest("onnxruntime"),
        PredictorOptions(threads=1, runtime=runtime),
    )
    so = pred.session.get_session_options()  # type: ignore[attr-defined]  # the ORT predictor's
    assert (so.intra_op_num_threads, so.inter_op_num_threads) == (1, 2)
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    x = pm.sample_inputs(4)
    np.testing.assert_allclose(pred.predict([x])[0], models.reference(x), atol=ATOL, rtol=0)
    with pytest.raises(ModelLoadError, match="lacks provider"):
        open_predictor(
            "onnxruntime",
            models.paths["onnx"],
            pm.manifest("onnxruntime"),
            PredictorOptions(runtime={"providers": ["NoSuchExecutionProvider"]}),
        )


def test_tensorflow_maps_names_in_manifest_order(models: pm.ModelSet) -> None:
    data = np.arange(8, dtype=np.float32).reshape(2, 4)
    scale = np.full((2, 4), 0.5, np.float32)
    named = pm.manifest(
        "tensorflow",
        inputs=[{"layer_name": "b_data", "shape": [4]}, {"layer_name": "a_scale", "shape": [4]}],
        outputs=[{"layer_name": "total"}, {"layer_name": "product"}],
    )
    pred = open_predictor("tensorflow", models.paths["two_inputs"], named, PredictorOptions())
    total, product = pred.predict([data, scale])
    np.testing.assert_allclose(product, data * scale)
    np.testing.assert_allclose(total, (data * scale).sum(axis=1, keepdims=True))
    # Without layer names: inputs and outputs in sorted signature-name order.
    unnamed = pm.manifest("tensorflow", inputs=[{"shape": [4]}, {"shape": [4]}], outputs=[{}, {}])
    pred = open_predictor("tensorflow", models.paths["two_inputs"], unnamed, PredictorOptions())
    product, total = pred.predict([scale, data])  # a_scale, b_data
    np.testing.assert_allclose(product, data * scale)
    bad = pm.manifest("tensorflow", inputs=[{"layer_name": "nope", "shape": [4]}])
    with pytest.raises(ModelLoadError, match="not in the signature"):
        open_predictor("tensorflow", models.paths["two_inputs"], bad, PredictorOptions())
    with pytest.raises(ModelLoadError, match="no signature"):
        open_predictor(
            "tensorflow",
            models.paths["saved_model"],
            pm.manifest("tensorflow"),
            PredictorOptions(runtime={"signature": "predict"}),
        )


def test_tflite_quantized_model(models: pm.ModelSet) -> None:
    path = models.paths["tflite_int8"]
    pred = open_predictor("tflite", path, pm.manifest("tflite"), PredictorOptions(threads=1))
    x = pm.sample_inputs(64, seed=7)
    (y,) = pred.predict([x])  # float32 in: quantized here; int8 out: dequantized
    ref = models.reference(x)
    assert y.dtype == np.float32
    assert np.abs(y - ref).max() < 0.25  # int8 steps of ~0.004, through two layers
    assert np.mean(y.argmax(1) == ref.argmax(1)) >= 0.9
    raw = np.clip(np.rint(x / 0.0078), -128, 127).astype(np.int8)
    assert pred.predict([raw])[0].shape == (64, pm.OUT)  # raw int8 is passed through
    with pytest.raises(InputMismatchError):
        pred.predict([x.astype(np.float64)])
    keep = open_predictor(
        "tflite", path, pm.manifest("tflite"), PredictorOptions(runtime={"dequantize": False})
    )
    assert keep.predict([x])[0].dtype == np.int8


def test_xrt_data_path_and_kernel_failure(models: pm.ModelSet, fake_pyxrt: Any) -> None:
    manifest = pm.manifest("xrt", attributes=pm.xrt_attributes())
    pred = open_predictor(
        "xrt", models.paths["xclbin"], manifest, PredictorOptions(device="fpga:0", batch_size=2)
    )
    x = pm.sample_inputs(16)  # larger than batch_size: buffers grow
    np.testing.assert_allclose(pred.predict([x])[0], models.reference(x), atol=ATOL, rtol=0)
    fake_pyxrt.kernel.fail_next_run = True
    with pytest.raises(InferenceError, match="ERT_CMD_STATE_ERROR") as ei:
        pred.predict([x])
    assert ei.value.fields["framework"] == "xrt" and ei.value.fields["device"] == "fpga:0"
    np.testing.assert_allclose(pred.predict([x[:3]])[0], models.reference(x[:3]), atol=ATOL)


def test_cross_framework_divergence(models: pm.ModelSet, fake_pyxrt: Any) -> None:
    """The same weights on every runtime: float formats agree; int8 TFLite drifts a little."""
    x = pm.sample_inputs(64, seed=11)
    runs = {
        "onnxruntime": ("onnx", "cpu", {}),
        "pytorch": ("exported", "cpu", {}),
        "tensorflow": ("saved_model", "cpu", {}),
        "tflite": ("tflite", "cpu", {}),
        "xrt": ("xclbin", "fpga:0", pm.xrt_attributes()),
    }
    outputs = {}
    for framework, (artifact, device, attributes) in runs.items():
        pred = open_predictor(
            framework,
            models.paths[artifact],
            pm.manifest(framework, attributes=attributes),
            PredictorOptions(device=device),
        )
        outputs[framework] = pred.predict([x])[0]
        pred.close()
    for framework, out in outputs.items():
        d = divergence(outputs["pytorch"], out, kind="logits")
        assert d.max_abs_diff < ATOL and d.top1_agreement == 1.0 and d.mean_kl < 1e-9, framework
    quant = open_predictor(
        "tflite", models.paths["tflite_int8"], pm.manifest("tflite"), PredictorOptions()
    ).predict([x])[0]
    d = divergence(outputs["pytorch"], quant, kind="logits")
    assert 0 < d.max_abs_diff < 0.25 and d.top1_agreement >= 0.9 and 0 < d.mean_kl < 0.01


def test_xrt_rejects_bad_configuration(models: pm.ModelSet, fake_pyxrt: Any) -> None:
    path = models.paths["xclbin"]
    attrs = pm.xrt_attributes()
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"xrt": {**attrs["xrt"], "args": ["input:0", "batch"]}}, "fpga:0", "argument layout"),
        ({"xrt": {**attrs["xrt"], "outputs": []}}, "fpga:0", "attributes.xrt.outputs"),
        ({"xrt": {**attrs["xrt"], "kernel": "other"}}, "fpga:0", "No compute units"),
        (attrs, "fpga:3", "No such device"),
        (attrs, "cpu", "fpga:N"),
    ]
    for attributes, device, message in cases:
        with pytest.raises(ModelLoadError, match=message):
            open_predictor(
                "xrt",
                path,
                pm.manifest("xrt", attributes=attributes),
                PredictorOptions(device=device),
            )


def test_xrt_without_pyxrt_is_not_advertised_and_says_how_to_install(models: pm.ModelSet) -> None:
    if "pyxrt" not in sys.modules and importlib.util.find_spec("pyxrt") is not None:
        pytest.skip("a real pyxrt is installed here")
    sys.modules.pop("pyxrt", None)
    assert probe("xrt") is None
    with pytest.raises(FrameworkUnavailable, match=r"source /opt/xilinx/xrt/setup\.sh") as ei:
        open_predictor(
            "xrt",
            models.paths["xclbin"],
            pm.manifest("xrt", attributes=pm.xrt_attributes()),
            PredictorOptions(device="fpga:0"),
        )
    assert isinstance(ei.value, PredictorError) and isinstance(ei.value, ImportError)


def _tf_version() -> str:
    import tensorflow as tf

    return str(tf.__version__)


def test_accelerators_are_found_through_the_runtime(fake_pyxrt: Any) -> None:
    from agent.predictors import accelerators

    fpgas = accelerators("xrt")
    assert [(a.kind, a.index) for a in fpgas] == [
        ("fpga", i) for i in range(fake_pyxrt.enumerate_devices())
    ]
    assert all(a.model and a.model != "unknown" for a in fpgas)
    # No GPU on a CPU-only machine: torch finds none and NVML is absent or empty.
    import torch

    gpus = accelerators("pytorch")
    assert len(gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_a_gpu_the_framework_cannot_use_is_not_the_agents(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU host with a CPU-only runtime (onnxruntime without a GPU provider, TFLite)
    lists no GPU for that framework, so a job asking for a GPU never lands there."""
    from agent.predictors import accelerators
    from mlscope import sysinfo
    from mlscope.contracts import Accelerator

    host = [
        Accelerator(kind="gpu", model="NVIDIA H200", index=i, interconnect="pcie5") for i in (0, 1)
    ]
    monkeypatch.setattr(sysinfo, "nvml_gpus", lambda: list(host))
    assert accelerators("onnxruntime", ("cpu",)) == ()
    assert accelerators("tflite", ("cpu",)) == ()
    assert accelerators("onnxruntime", ("cpu", "cuda:1")) == (host[1],)
    assert accelerators("tensorflow", ("cpu", "cuda:0", "cuda:1")) == tuple(host)
