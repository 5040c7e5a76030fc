"""Manifests of the zoo models read in place from installed wheels (ONNX's light
models, Silero VAD, Basic Pitch): each file pinned by its sha256."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlscope.artifacts import resolve_package
from mlscope.hashing import sha256_path
from mlscope.zoo.packaged import LIGHT_MODELS
from mlscope.zoo.specs_common import CONSTRAINTS, Rendered, drop_none

__all__ = ["RENDERERS"]


def _onnx_io(path: Path) -> tuple[str, str]:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in inits]
    return inputs[0], model.graph.output[0].name


def _light(_: Path) -> Rendered:
    docs: Rendered = {}
    base = "pkg://onnx/backend/test/data/light"
    root = resolve_package(base)
    for arch in LIGHT_MODELS:
        graph = root / f"light_{arch}.onnx"
        inp, outp = _onnx_io(graph)
        docs[f"light_{arch}.onnxruntime.yaml"] = (
            "",
            {
                "kind": "model",
                "name": f"light_{arch}",
                "version": "1.23.2",
                "description": f"The {arch} architecture from the ONNX model zoo with constant "
                "weights (ConstantOfShape): real compute, meaningless predictions.",
                "task": "image_classification",
                "license": "Apache-2.0",
                "source": "onnx==1.23.2 wheel, onnx/backend/test/data/light",
                "framework": {"name": "onnxruntime", "version": CONSTRAINTS["onnxruntime"]},
                "inputs": [
                    {
                        "type": "image",
                        "layer_name": inp,
                        "element_type": "float32",
                        "shape": [3, 224, 224],
                        "layout": "NCHW",
                    }
                ],
                "outputs": [{"type": "tensor", "layer_name": outp}],
                "assets": {
                    "base_url": base,
                    "graph_path": graph.name,
                    "sha256": sha256_path(graph),
                },
                "attributes": {
                    "architecture": arch,
                    "fixed_batch_size": 1,
                    "note": "feed only the non-initializer input",
                },
                "latency_only": True,
            },
        )
    return docs


def _silero(_: Path) -> Rendered:
    base = "pkg://silero_vad/data"
    root = resolve_package(base)
    common = {
        "kind": "model",
        "name": "silero_vad",
        "version": "6.2.3",
        "description": "Silero voice activity detector: speech probability per 512-sample "
        "chunk of 16 kHz audio (32 ms).",
        "task": "voice_activity_detection",
        "license": "MIT",
        "source": "silero-vad==6.2.3 wheel, silero_vad/data",
        "latency_only": True,
    }
    onnx_doc = {
        **common,
        "framework": {"name": "onnxruntime", "version": CONSTRAINTS["onnxruntime"]},
        "inputs": [
            {"type": "audio", "layer_name": "input", "element_type": "float32", "shape": [576]},
            {
                "type": "tensor",
                "layer_name": "state",
                "element_type": "float32",
                "shape": [2, 128],
                "batch_axis": 1,
                "fill": 0.0,
            },
            {
                "type": "scalar",
                "layer_name": "sr",
                "element_type": "int64",
                "shape": [],
                "batch_axis": None,
                "fill": 16000,
            },
        ],
        "outputs": [
            {"type": "probability", "layer_name": "output"},
            {"type": "tensor", "layer_name": "stateN"},
        ],
        "assets": {
            "base_url": base,
            "graph_path": "silero_vad.onnx",
            "sha256": sha256_path(root / "silero_vad.onnx"),
        },
        "attributes": {
            "sample_rate": 16000,
            "note": (
                "input is 64 samples of context + 512 new samples; state is (2, batch, 128) "
                "and carries over between chunks (a query without it starts from zeros); sr "
                "is 16000"
            ),
        },
    }
    jit_doc = {
        **common,
        "framework": {"name": "pytorch", "version": CONSTRAINTS["pytorch"]},
        "inputs": [
            {"type": "audio", "element_type": "float32", "shape": [512]},
            {
                "type": "scalar",
                "element_type": "int64",
                "shape": [],
                "batch_axis": None,
                "fill": 16000,
            },
        ],
        "outputs": [{"type": "probability"}],
        "assets": {
            "base_url": base,
            "graph_path": "silero_vad.jit",
            "sha256": sha256_path(root / "silero_vad.jit"),
        },
        "attributes": {
            "sample_rate": 16000,
            "note": ("forward(x, sr: int); the RNN state lives inside the module (reset_states())"),
        },
    }
    return {"silero_vad.onnxruntime.yaml": ("", onnx_doc), "silero_vad.pytorch.yaml": ("", jit_doc)}


def _basic_pitch(_: Path) -> Rendered:
    base = "pkg://basic_pitch/saved_models/icassp_2022"
    root = resolve_package(base)
    common = {
        "kind": "model",
        "name": "basic_pitch",
        "version": "0.4.0",
        "description": "Spotify's Basic Pitch: polyphonic note transcription from 2 s of "
        "22.05 kHz mono audio.",
        "task": "audio_transcription",
        "license": "Apache-2.0",
        "source": "basic-pitch==0.4.0 wheel (installed --no-deps)",
        "latency_only": True,
    }
    names = {
        "onnxruntime": ("serving_default_input_2:0", "StatefulPartitionedCall:{}"),
        "tflite": ("serving_default_input_2:0", "StatefulPartitionedCall:{}"),
    }
    files = {"onnxruntime": "nmp.onnx", "tflite": "nmp.tflite", "tensorflow": "nmp"}
    docs: Rendered = {}
    for fw, graph in files.items():
        inp, outp = names.get(fw, (None, None))
        outs = [
            {"type": "tensor", "layer_name": outp.format(i) if outp else None} for i in range(3)
        ]
        doc: dict[str, Any] = {
            **common,
            "framework": {"name": fw, "version": CONSTRAINTS[fw]},
            "inputs": [
                {"type": "audio", "layer_name": inp, "element_type": "float32", "shape": [43844, 1]}
            ],
            "outputs": outs,
            "assets": {"base_url": base, "graph_path": graph, "sha256": sha256_path(root / graph)},
            "attributes": {
                "sample_rate": 22050,
                "outputs": "contour (172, 264), note (172, 88), onset (172, 88)",
            },
        }
        if fw == "tensorflow":
            doc["attributes"] = {
                **doc["attributes"],
                "savedmodel_loader": (
                    "tf.compat.v1.saved_model.loader.load(sess, ['serve'], path); "
                    "tf.saved_model.load fails on TF 2.21 (optimizer slots)"
                ),
            }
        docs[f"basic_pitch.{fw}.yaml"] = ("", drop_none(doc))
    return docs


RENDERERS = {
    "light": _light,
    "silero_vad": _silero,
    "basic_pitch": _basic_pitch,
}
