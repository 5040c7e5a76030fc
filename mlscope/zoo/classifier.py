"""Shared steps of the image-classifier builders: export to four formats, check them.

Every classifier in the zoo is exported from one torch module (plus its Keras port)
to ``<stem>.onnx``, ``<stem>.pt`` (TorchScript), ``<stem>.savedmodel/`` and
``<stem>.tflite``, all taking the same NCHW float32 input.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlscope.zoo import convert

__all__ = ["FORMAT_FILES", "export_formats", "measure", "softmax", "write_labels"]

FORMAT_FILES = {
    "onnx": ".onnx",
    "torchscript": ".pt",
    "savedmodel": ".savedmodel",
    "tflite": ".tflite",
}
"""predict_all keyword -> file suffix."""


def export_formats(
    model: Any, keras_model: Any, example: Any, out: Path, stem: str, *, input_shape: Sequence[int]
) -> dict[str, Path]:
    """Write the four formats; returns ``{predict_all keyword: path}``."""
    paths = {k: out / f"{stem}{suffix}" for k, suffix in FORMAT_FILES.items()}
    convert.export_onnx(model, example, paths["onnx"])
    convert.export_torchscript(model, example, paths["torchscript"])
    with tempfile.TemporaryDirectory(prefix="mlscope-keras-") as tmp:
        kpath = Path(tmp) / f"{stem}.keras"
        keras_model.save(kpath)
        convert.export_savedmodel(kpath, paths["savedmodel"], input_shape=input_shape)
    convert.export_tflite(keras_model, paths["tflite"])
    return paths


def measure(
    name: str,
    paths: dict[str, Path],
    x: np.ndarray,
    y: np.ndarray,
    *,
    probes: Sequence[int],
    batch: int = 64,
    tolerance: int = 1,
) -> dict[str, Any]:
    """What the build reports of a classifier's behaviour, per format: top-1 accuracy on
    ``(x, y)`` and the class probabilities of the ``probes`` rows. Raises when two
    formats differ by more than ``tolerance`` correct answers (one set of weights)."""
    outputs = convert.predict_all(x, batch=batch, **paths)
    correct = {fw: int((o.argmax(axis=1) == y).sum()) for fw, o in outputs.items()}
    if max(correct.values()) - min(correct.values()) > tolerance:
        raise RuntimeError(f"{name}: formats disagree on top-1: {correct}")
    return {
        "samples": len(y),
        "accuracy": {fw: c / len(y) for fw, c in correct.items()},
        "probabilities": {
            fw: {str(i): softmax(o[i]).tolist() for i in probes} for fw, o in outputs.items()
        },
    }


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max()
    e = np.exp(z)
    return e / e.sum()  # type: ignore[no-any-return]


def write_labels(path: Path, labels: Sequence[str]) -> Path:
    path.write_text("".join(f"{label}\n" for label in labels))
    return path
