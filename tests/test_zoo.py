"""The zoo: same predictions on all four runtimes, sanity sets, behaviour pinned.

Every artifact is fetched through ``Entry.graph``/``Entry.dataset``, which verify it
against the build lock; the build itself checked the behaviour the committed manifests
pin, on whatever CPU runs the tests. The runtimes are called directly here (ONNX
Runtime, torch.jit, tf.saved_model, LiteRT), not through agent predictors.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from mlscope.buildlock import BuildLock
from mlscope.catalog import Catalog, Entry
from mlscope.manifest import Behaviour, Probe
from mlscope.operators import compile_steps
from mlscope.zoo import specs
from mlscope.zoo.behaviour import check_behaviour
from mlscope.zoo.build import BUILDERS, build
from tests.zoo_fixtures import MANIFESTS, built, zoo_dir

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
FRAMEWORKS = ("onnxruntime", "pytorch", "tensorflow", "tflite")
Runner = Callable[[np.ndarray], np.ndarray]


def run_onnxruntime(path: Path) -> Runner:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return lambda x: np.asarray(sess.run(None, {name: x})[0])


def run_pytorch(path: Path) -> Runner:
    import torch

    mod = torch.jit.load(str(path)).eval()  # type: ignore[no-untyped-call]

    def run(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return np.asarray(mod(torch.from_numpy(x)).numpy())

    return run


def run_tensorflow(path: Path) -> Runner:
    import tensorflow as tf

    fn = tf.saved_model.load(str(path)).signatures["serving_default"]
    return lambda x: np.asarray(fn(input=tf.constant(x))["logits"])


def run_tflite(path: Path) -> Runner:
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_path=str(path))
    inp, out = interp.get_input_details()[0], interp.get_output_details()[0]

    def run(x: np.ndarray) -> np.ndarray:
        interp.resize_tensor_input(inp["index"], list(x.shape))
        interp.allocate_tensors()
        interp.set_tensor(inp["index"], x)
        interp.invoke()
        return np.array(interp.get_tensor(out["index"]))

    return run


RUNNERS = {
    "onnxruntime": run_onnxruntime,
    "pytorch": run_pytorch,
    "tensorflow": run_tensorflow,
    "tflite": run_tflite,
}


def entries(name: str) -> dict[str, Entry]:
    cat = Catalog.load([MANIFESTS])
    return {fw: cat.find(name, framework=fw) for fw in FRAMEWORKS}


def dataset_of(entry: Entry) -> Path:
    path = entry.dataset(zoo_dir())
    assert path is not None, entry.manifest.key
    return path


def predictions(name: str, batch: int = 100) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Top-1 per framework over the manifest's data set, run through its own steps."""
    built(name)
    top1: dict[str, np.ndarray] = {}
    labels = np.empty(0)
    for fw, entry in entries(name).items():
        m = entry.manifest
        data = np.load(dataset_of(entry))
        x, labels = data["x"], data["y"]
        pre = compile_steps(m.inputs[0].steps)
        post = compile_steps(m.outputs[0].steps)
        run = RUNNERS[fw](entry.graph(zoo_dir()))
        outs = [
            post(run(np.ascontiguousarray(pre(x[i : i + batch]), np.float32)))
            for i in range(0, len(x), batch)
        ]
        top1[fw] = np.concatenate(outs)[:, 0]
    return top1, labels


@pytest.mark.parametrize(("name", "floor"), [("digits_cnn", 0.97), ("mnist_lenet", 0.96)])
def test_same_top1_on_four_runtimes(name: str, floor: float) -> None:
    top1, y = predictions(name)
    correct = {fw: int((p == y).sum()) for fw, p in top1.items()}
    assert max(correct.values()) - min(correct.values()) <= 1, correct
    assert min(correct.values()) / len(y) >= floor, correct
    pins = entries(name)["onnxruntime"].manifest.build
    assert pins is not None and pins.behaviour is not None
    for fw, c in correct.items():
        assert (
            abs(c / len(y) - pins.behaviour.accuracy) <= pins.behaviour.accuracy_tolerance + 1e-9
        ), fw


def test_efficientnet_sanity_set_on_four_runtimes() -> None:
    top1, y = predictions("efficientnet_lite0", batch=8)
    assert len(y) >= 6
    for fw, p in top1.items():
        assert p.tolist() == y.tolist(), fw


def test_face_detector_separates_faces() -> None:
    from sklearn.metrics import roc_auc_score

    built("mp_face_detection")
    entry = Catalog.load([MANIFESTS]).find("mp_face_detection")
    m = entry.manifest
    data = np.load(dataset_of(entry))
    pre, post = compile_steps(m.inputs[0].steps), compile_steps(m.outputs[1].steps)
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_path=str(entry.graph(zoo_dir())))
    interp.allocate_tensors()
    inp = interp.get_input_details()[0]["index"]
    score_index = next(
        d["index"] for d in interp.get_output_details() if d["name"] == m.outputs[1].layer_name
    )
    scores = []
    for img in pre(data["x"]):
        interp.set_tensor(inp, img[None].astype(np.float32))
        interp.invoke()
        scores.append(post(interp.get_tensor(score_index))[0, 0])
    assert roc_auc_score(data["y"], scores) > 0.99
    assert ((np.asarray(scores) > 0.5) == data["y"]).mean() > 0.95


def test_build_is_idempotent() -> None:
    built("digits_cnn")
    log: list[str] = []
    before = build(zoo_dir(), only=["digits_cnn"], log=log.append)
    assert log == ["digits_cnn 1.0.0: up to date"]
    lock = BuildLock.read(zoo_dir() / "digits_cnn" / "1.0.0")
    assert lock is not None and before["digits_cnn"] == lock.artifacts
    assert set(lock.artifacts) == set(BUILDERS["digits_cnn"].files)


def test_rebuild_on_one_machine_is_byte_identical(tmp_path: Path) -> None:
    """A forced rebuild elsewhere on this machine (another directory, another process
    state) gives the same bytes: the build is repeatable where it runs."""
    first = build(zoo_dir(), only=["digits_cnn"], log=lambda _m: None)
    second = build(tmp_path, only=["digits_cnn"], force=True, log=lambda _m: None)
    assert first == second


def _strip_measured(text: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    doc = yaml.safe_load(text)
    behaviour = (doc.get("build") or {}).pop("behaviour", None)
    return doc, behaviour


def test_committed_manifests_are_what_the_build_renders() -> None:
    """Everything but the measured numbers is rendered exactly; the measured behaviour
    of this machine's build is within the committed tolerances."""
    for name in BUILDERS:
        built(name)
    rendered = specs.render_all(zoo_dir())
    committed = {p.name: p.read_text() for p in (MANIFESTS / "models").glob("*.yaml")}
    assert sorted(rendered) == sorted(committed)
    for fname, text in rendered.items():
        got, measured = _strip_measured(text)
        want, pinned = _strip_measured(committed[fname])
        assert got == want, fname
        assert (measured is None) == (pinned is None), fname
        if pinned is not None and measured is not None:
            pins = Behaviour.model_validate(pinned)
            assert abs(measured["accuracy"] - pins.accuracy) <= pins.accuracy_tolerance + 1e-9
            assert [p["sample"] for p in measured["probes"]] == [p.sample for p in pins.probes]


def test_behaviour_check_flags_a_model_that_answers_differently() -> None:
    pins = Behaviour(
        accuracy=0.9,
        accuracy_tolerance=0.02,
        probe_tolerance=0.05,
        probes=(Probe(sample=0, top5=((3, 0.9), (5, 0.05))),),
    )
    good = {
        "accuracy": {"onnxruntime": 0.91},
        "probabilities": {"onnxruntime": {"0": [0.0, 0, 0, 0.88, 0, 0.07]}},
    }
    assert check_behaviour("m", good, pins) == []
    bad = {
        "accuracy": {"onnxruntime": 0.85},
        "probabilities": {"onnxruntime": {"0": [0.0, 0, 0, 0.2, 0, 0.8]}},
    }
    problems = check_behaviour("m", bad, pins)
    assert any("accuracy 0.8500" in p for p in problems)
    assert any("answers class 5, pinned 3" in p for p in problems)
    assert any("probabilities differ" in p for p in problems)
