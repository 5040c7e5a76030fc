"""The null predictor: returns its inputs at once.

It measures the pipeline itself (per-query overhead = end-to-end minus predict) and
lets an agent without any framework take part in bus and load-generator tests.
It needs no model file and no runtime; it is always available.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import mlscope
from mlscope.contracts import FrameworkInfo
from mlscope.errors import InferenceError, InputMismatchError
from mlscope.manifest import ModelManifest
from mlscope.predictor import PredictorOptions

__all__ = ["NoopPredictor", "open", "probe"]

FRAMEWORK = "noop"


def probe() -> FrameworkInfo:
    return FrameworkInfo(name=FRAMEWORK, version=mlscope.__version__, devices=("cpu",))


class NoopPredictor:
    """Echoes its inputs; checks only their number (nothing else costs nothing)."""

    framework = FRAMEWORK

    def __init__(self, model: str, n_inputs: int, device: str = "cpu") -> None:
        self.model = model
        self.device = device
        self._n_inputs = n_inputs
        self._closed = False

    def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        if self._closed:
            raise InferenceError(
                f"{self.model}: predictor is closed", model=self.model, framework=FRAMEWORK
            )
        if len(inputs) != self._n_inputs:
            raise InputMismatchError(
                f"{self.model} takes {self._n_inputs} input(s), got {len(inputs)}",
                model=self.model,
                framework=FRAMEWORK,
                expected=self._n_inputs,
                actual=len(inputs),
            )
        return list(inputs)

    def close(self) -> None:
        self._closed = True


def open(
    model_path: Path | None, manifest: ModelManifest, options: PredictorOptions
) -> NoopPredictor:
    """``model_path`` is ignored: there is nothing to load."""
    return NoopPredictor(manifest.name, len(manifest.inputs), options.device)
