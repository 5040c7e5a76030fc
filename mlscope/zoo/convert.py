"""Exporting one set of torch weights to every format, byte-deterministically.

Formats: ONNX (legacy single-file exporter), TorchScript (``.pt``), a Keras port of
the same weights exported as a TensorFlow SavedModel directory, and TFLite converted
from that Keras model. Every exported model takes the same NCHW input as the torch
model (the Keras port transposes to NHWC inside the graph), so one manifest's
pre-processing fits all four.

Determinism (checked by building twice, see tests/test_zoo_build.py):

* TorchScript archives carry ``.debug_pkl`` records with absolute source paths of the
  venv and the checkout, and a random ``.data/serialization_id``. The archive is
  rewritten without the debug records (``torch.jit.load`` does not need them), with
  the id derived from the content, entries in their original order, timestamps fixed.
* ``keras.Model.export`` orders variables differently on every run; a ``tf.Module``
  wrapper saved by ``tf.saved_model.save`` in a fresh child process (function names
  come from process-wide counters) is stable, once the random ``fingerprint.pb``
  (optional for loading) is removed.

Weight-port rules (torch -> Keras): conv ``W.transpose(2, 3, 1, 0)``, depthwise conv
``W.transpose(2, 3, 0, 1)``, dense ``W.T``; batch norm copies gamma, beta, mean, var.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "export_onnx",
    "export_savedmodel",
    "export_tflite",
    "export_torchscript",
    "keras_from_sequential",
    "predict_all",
    "quiet_tf",
]

_FIXED_TIME = (1980, 1, 1, 0, 0, 0)
_SERIALIZATION_ID = ".data/serialization_id"


def quiet_tf() -> None:
    """Silence TensorFlow's C++ banner before it is imported."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


def export_onnx(
    model: Any,
    example: Any,
    path: Path,
    *,
    input_name: str = "input",
    output_name: str = "logits",
    opset: int = 17,
) -> Path:
    """A single-file ONNX graph with a dynamic batch dimension (legacy exporter)."""
    import torch

    torch.onnx.export(
        model,
        (example,),
        str(path),
        dynamo=False,
        input_names=[input_name],
        output_names=[output_name],
        dynamic_axes={input_name: {0: "batch"}, output_name: {0: "batch"}},
        opset_version=opset,
    )
    return path


def export_torchscript(model: Any, example: Any, path: Path) -> Path:
    """Trace + freeze, then rewrite the archive without debug records (see module doc)."""
    import torch

    with torch.no_grad():
        traced = torch.jit.freeze(torch.jit.trace(model, example).eval())  # type: ignore[no-untyped-call]
    buf = io.BytesIO()
    torch.jit.save(traced, buf)
    _strip_zip(buf.getvalue(), path, archive=path.stem)
    return path


def _strip_zip(data: bytes, path: Path, *, archive: str) -> None:
    src = zipfile.ZipFile(io.BytesIO(data))
    records: list[tuple[str, bytes]] = []
    for info in src.infolist():
        if info.filename.endswith(".debug_pkl"):
            continue
        # The archive's top folder is derived from the file name torch saw; ours is a
        # BytesIO, so name it after the target file instead.
        _, _, rest = info.filename.partition("/")
        records.append((rest, src.read(info)))
    # .data/serialization_id is a per-save random number; derive it from the content
    digest = hashlib.sha256(
        b"".join(n.encode() + d for n, d in records if n != _SERIALIZATION_ID)
    ).digest()
    fixed = str(int.from_bytes(digest[:16], "big")).zfill(40)[:40].encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as dst:
        for rest, blob in records:
            blob = fixed if rest == _SERIALIZATION_ID else blob
            dst.writestr(zipfile.ZipInfo(f"{archive}/{rest}", _FIXED_TIME), blob)
    path.write_bytes(out.getvalue())


def keras_from_sequential(seq: Any, input_shape: Sequence[int]) -> Any:
    """A Keras model with the weights of a torch ``nn.Sequential`` of simple layers.

    Supported: Conv2d (padding 0 or 'same'-equivalent), ReLU, MaxPool2d, Flatten,
    Linear. Input and flatten order are NCHW, as in torch.
    """
    from torch import nn

    quiet_tf()
    import keras

    inp = keras.Input(shape=tuple(input_shape), name="input")
    x = keras.layers.Permute((2, 3, 1))(inp)  # NCHW -> NHWC
    weights: list[tuple[Any, list[np.ndarray]]] = []
    for layer in seq:
        if isinstance(layer, nn.Conv2d):
            pad = "same" if layer.padding == (layer.kernel_size[0] // 2,) * 2 else "valid"
            if layer.padding not in ((0, 0),) and pad == "valid":
                raise ValueError(f"unsupported conv padding {layer.padding}")
            k = keras.layers.Conv2D(
                layer.out_channels, layer.kernel_size, strides=layer.stride, padding=pad
            )
            x = k(x)
            weights.append((k, [_np(layer.weight).transpose(2, 3, 1, 0), _np(layer.bias)]))
        elif isinstance(layer, nn.ReLU):
            x = keras.layers.ReLU()(x)
        elif isinstance(layer, nn.MaxPool2d):
            x = keras.layers.MaxPooling2D(layer.kernel_size, strides=layer.stride)(x)
        elif isinstance(layer, nn.Flatten):
            x = keras.layers.Permute((3, 1, 2))(x)  # back to NCHW so flatten order matches
            x = keras.layers.Flatten()(x)
        elif isinstance(layer, nn.Linear):
            d = keras.layers.Dense(layer.out_features)
            x = d(x)
            weights.append((d, [_np(layer.weight).T, _np(layer.bias)]))
        else:
            raise ValueError(f"no Keras port for {type(layer).__name__}")
    model = keras.Model(inp, x)
    for k, w in weights:
        k.set_weights(w)
    return model


def _np(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float32)  # type: ignore[no-any-return]


_SAVEDMODEL_CHILD = """
import json, sys
import keras, tensorflow as tf
model = keras.saving.load_model(sys.argv[1], compile=False)
shape, in_name, out_name = json.loads(sys.argv[3])

class Serving(tf.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    @tf.function(input_signature=[tf.TensorSpec([None, *shape], tf.float32, name=in_name)])
    def serve(self, x):
        return {out_name: self.model(x)}

module = Serving(model)
tf.saved_model.save(module, sys.argv[2], signatures={"serving_default": module.serve})
"""


def export_savedmodel(
    keras_path: Path,
    out_dir: Path,
    *,
    input_shape: Sequence[int],
    input_name: str = "input",
    output_name: str = "logits",
) -> Path:
    """Export a saved ``.keras`` model to a SavedModel dir, deterministically.

    ``keras.Model.export`` orders variables differently from run to run, so the model is
    wrapped in a ``tf.Module`` and saved with ``tf.saved_model.save`` in a fresh child
    process (function names come from process-wide counters). The random
    ``fingerprint.pb`` is removed; loaders treat it as optional.
    """
    if out_dir.exists():
        shutil.rmtree(out_dir)
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "TF_ENABLE_ONEDNN_OPTS": "0",
        "PYTHONHASHSEED": "0",
        "CUDA_VISIBLE_DEVICES": "",
    }
    spec = json.dumps([list(input_shape), input_name, output_name])
    proc = subprocess.run(
        [sys.executable, "-c", _SAVEDMODEL_CHILD, str(keras_path), str(out_dir), spec],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"SavedModel export failed:\n{proc.stderr[-4000:]}")
    (out_dir / "fingerprint.pb").unlink(missing_ok=True)
    return out_dir


def export_tflite(keras_model: Any, path: Path) -> Path:
    """Convert the Keras model (deterministic bytes; checked by the build tests).

    Converting the ``tf.Module`` SavedModel instead gives a TFLite graph that ignores
    the trained variables (10% accuracy), so the converter gets the Keras model. It
    prints Keras's export summary on stdout, which is swallowed.
    """
    quiet_tf()
    import tensorflow as tf

    converter = tf.lite.TFLiteConverter.from_keras_model(keras_model)
    with contextlib.redirect_stdout(io.StringIO()):
        data = converter.convert()
    path.write_bytes(data)
    return path


def predict_all(
    x: np.ndarray,
    *,
    onnx: Path | None = None,
    torchscript: Path | None = None,
    savedmodel: Path | None = None,
    tflite: Path | None = None,
    batch: int = 64,
) -> dict[str, np.ndarray]:
    """Run ``x`` (float32, NCHW) through each given artifact; ``{format: outputs}``."""
    runners: dict[str, Callable[[np.ndarray], np.ndarray]] = {}
    if onnx is not None:
        runners["onnxruntime"] = _ort_runner(onnx)
    if torchscript is not None:
        runners["pytorch"] = _torch_runner(torchscript)
    if savedmodel is not None:
        runners["tensorflow"] = _tf_runner(savedmodel)
    if tflite is not None:
        runners["tflite"] = _tflite_runner(tflite)
    out: dict[str, np.ndarray] = {}
    for name, run in runners.items():
        parts = [run(x[i : i + batch]) for i in range(0, len(x), batch)]
        out[name] = np.concatenate(parts)
    return out


def _ort_runner(path: Path) -> Callable[[np.ndarray], np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return lambda x: np.asarray(sess.run(None, {name: x})[0])


def _torch_runner(path: Path) -> Callable[[np.ndarray], np.ndarray]:
    import torch

    mod = torch.jit.load(str(path)).eval()  # type: ignore[no-untyped-call]

    def run(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return mod(torch.from_numpy(np.ascontiguousarray(x))).numpy()  # type: ignore[no-any-return]

    return run


def _tf_runner(path: Path) -> Callable[[np.ndarray], np.ndarray]:
    quiet_tf()
    import tensorflow as tf

    loaded = tf.saved_model.load(str(path))
    fn = loaded.signatures["serving_default"]

    def run(x: np.ndarray) -> np.ndarray:
        res = fn(tf.constant(x))
        return np.asarray(next(iter(res.values())))

    return run


def _tflite_runner(path: Path) -> Callable[[np.ndarray], np.ndarray]:
    from ai_edge_litert.interpreter import Interpreter

    interp = Interpreter(model_path=str(path), num_threads=1)
    inp = interp.get_input_details()[0]
    outp = interp.get_output_details()[0]

    def run(x: np.ndarray) -> np.ndarray:
        interp.resize_tensor_input(inp["index"], list(x.shape))
        interp.allocate_tensors()
        interp.set_tensor(inp["index"], x)
        interp.invoke()
        return np.array(interp.get_tensor(outp["index"]))

    return run
