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

__all__ = ["FORMAT_FILES", "check_top1", "export_formats", "write_labels"]

FORMAT_FILES = {"onnx": ".onnx", "torchscript": ".pt", "savedmodel": ".savedmodel",
                "tflite": ".tflite"}
"""predict_all keyword -> file suffix."""


def export_formats(model: Any, keras_model: Any, example: Any, out: Path, stem: str, *,
                   input_shape: Sequence[int]) -> dict[str, Path]:
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


def check_top1(name: str, paths: dict[str, Path], x: np.ndarray, y: np.ndarray, *,
               tolerance: int = 1) -> dict[str, float]:
    """Top-1 accuracy per format; raise when two formats differ by more than a sample."""
    outputs = convert.predict_all(x, **paths)  # type: ignore[arg-type]
    correct = {fw: int((o.argmax(axis=1) == y).sum()) for fw, o in outputs.items()}
    if max(correct.values()) - min(correct.values()) > tolerance:
        raise RuntimeError(f"{name}: formats disagree on top-1: {correct}")
    return {fw: c / len(y) for fw, c in correct.items()}


def write_labels(path: Path, labels: Sequence[str]) -> Path:
    path.write_text("".join(f"{label}\n" for label in labels))
    return path
