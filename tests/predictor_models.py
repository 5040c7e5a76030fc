"""One tiny model, the same weights, in every format the predictors load.

``relu(x @ w0 + b0) @ w1 + b1`` with x: (N, 16) float32 -> logits (N, 10), weights
from a seeded ``torch.nn.Linear`` pair, written as:

- ONNX (``torch.onnx.export(dynamo=False)``, dynamic batch), TorchScript ``.pt``,
  an exported program ``.pt2`` (dynamic batch);
- a Keras model with the same weights exported as a SavedModel (``model.export``),
  converted to TFLite (float) and to a fully int8-quantized TFLite;
- a stand-in "xclbin" for ``tests/fake_pyxrt``: an ``.npz`` holding the kernel name
  and the weights, renamed ``.xclbin``;
- a two-input Keras SavedModel whose input names sort differently from the manifest
  order, for the TensorFlow name-mapping test.

:func:`reference` computes the expected output in numpy. Frameworks are imported
inside the builders: importing this module is cheap.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlscope.manifest import ModelManifest

IN, HIDDEN, OUT = 16, 32, 10
KERNEL = "mlp_f32"
SHA = "0" * 64


@dataclass(frozen=True)
class ModelSet:
    root: Path
    weights: dict[str, np.ndarray]
    paths: dict[str, Path]

    def reference(self, x: np.ndarray) -> np.ndarray:
        return reference(self.weights, x)


def reference(w: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    h = np.maximum(x.astype(np.float64) @ w["w0"] + w["b0"], 0.0)
    out: np.ndarray = (h @ w["w1"] + w["b1"]).astype(np.float32)
    return out


def sample_inputs(batch: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (batch, IN)).astype(np.float32)


def manifest(
    framework: str,
    *,
    name: str = "tiny_mlp",
    inputs: list[dict[str, Any]] | None = None,
    outputs: list[dict[str, Any]] | None = None,
    attributes: dict[str, Any] | None = None,
) -> ModelManifest:
    return ModelManifest.model_validate(
        {
            "name": name,
            "version": "1.0.0",
            "task": "classification",
            "framework": {"name": framework},
            "inputs": inputs or [{"shape": [IN], "element_type": "float32"}],
            "outputs": outputs or [{}],
            "assets": {"graph_path": "model", "sha256": SHA},
            "attributes": attributes or {},
        }
    )


def xrt_attributes() -> dict[str, Any]:
    return {
        "xrt": {
            "kernel": KERNEL,
            "args": ["input:0", "output:0", "batch"],
            "outputs": [{"shape": [OUT], "element_type": "float32"}],
        }
    }


def build(root: Path) -> ModelSet:
    """Write every format under ``root``; takes ~5 s on 2 cores (TensorFlow import)."""
    import torch

    torch.manual_seed(0)
    first, second = torch.nn.Linear(IN, HIDDEN), torch.nn.Linear(HIDDEN, OUT)
    net = torch.nn.Sequential(first, torch.nn.ReLU(), second).eval()
    w = {
        "w0": first.weight.detach().numpy().T.copy(),
        "b0": first.bias.detach().numpy().copy(),
        "w1": second.weight.detach().numpy().T.copy(),
        "b1": second.bias.detach().numpy().copy(),
    }
    paths = {
        "onnx": _onnx(net, root / "model.onnx"),
        "torchscript": _torchscript(net, root / "model.pt"),
        "exported": _exported(net, root / "model.pt2"),
        "xclbin": _xclbin(w, root / "model.xclbin"),
    }
    paths.update(_tensorflow(w, root))
    return ModelSet(root=root, weights=w, paths=paths)


def _onnx(net: Any, path: Path) -> Path:
    import torch

    torch.onnx.export(
        net,
        (torch.zeros(1, IN),),
        str(path),
        dynamo=False,
        input_names=["x"],
        output_names=["logits"],
        dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
    )
    return path


def _torchscript(net: Any, path: Path) -> Path:
    import torch

    traced = torch.jit.trace(net, torch.zeros(1, IN))  # type: ignore[no-untyped-call]
    torch.jit.save(traced, str(path))
    return path


def _exported(net: Any, path: Path) -> Path:
    import torch

    batch = torch.export.Dim("batch", min=1, max=4096)
    ep = torch.export.export(net, (torch.zeros(2, IN),), dynamic_shapes=({0: batch},))
    torch.export.save(ep, str(path))
    return path


def _xclbin(w: dict[str, np.ndarray], path: Path) -> Path:
    with path.open("wb") as fh:  # np.savez on a handle keeps the .xclbin name
        arrays: dict[str, Any] = {"kernel": np.array(KERNEL), "uuid": np.array("5eed-mlp"), **w}
        np.savez(fh, **arrays)
    return path


def _tensorflow(w: dict[str, np.ndarray], root: Path) -> dict[str, Path]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    inp = keras.Input((IN,), name="x")
    hidden = keras.layers.Dense(HIDDEN, activation="relu")
    out = keras.layers.Dense(OUT)
    km = keras.Model(inp, out(hidden(inp)))
    hidden.set_weights([w["w0"], w["b0"]])
    out.set_weights([w["w1"], w["b1"]])
    saved = root / "saved_model"
    km.export(str(saved), verbose=False)

    tfl = root / "model.tflite"
    tfl.write_bytes(tf.lite.TFLiteConverter.from_saved_model(str(saved)).convert())

    def representative() -> Any:
        for i in range(32):
            yield [sample_inputs(1, seed=100 + i)]

    conv = tf.lite.TFLiteConverter.from_saved_model(str(saved))
    conv.optimizations = [tf.lite.Optimize.DEFAULT]
    conv.representative_dataset = representative
    conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    conv.inference_input_type = tf.int8
    conv.inference_output_type = tf.int8
    quant = root / "model_int8.tflite"
    quant.write_bytes(conv.convert())

    # Two inputs whose sorted names ("a_scale", "b_data") are the reverse of the order
    # the manifest gives, and two outputs: y = data * scale, and its row sum.
    data = keras.Input((4,), name="b_data")
    scale = keras.Input((4,), name="a_scale")
    prod = keras.layers.Multiply(name="product")([data, scale])
    total = keras.layers.Lambda(lambda t: keras.ops.sum(t, axis=1, keepdims=True), name="total")(
        prod
    )
    two = keras.Model({"b_data": data, "a_scale": scale}, {"product": prod, "total": total})
    two_path = root / "two_inputs"
    two.export(str(two_path), verbose=False)
    return {"saved_model": saved, "tflite": tfl, "tflite_int8": quant, "two_inputs": two_path}
