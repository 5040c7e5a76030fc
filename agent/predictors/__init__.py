"""Predictors, one module per framework, imported by name only when used.

Each module ``agent.predictors.<framework>`` defines ``probe()`` and ``open(...)``
(see :mod:`mlscope.predictor`). Framework names are the same everywhere:
onnxruntime, pytorch, tensorflow, tflite, xrt, noop.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from mlscope.contracts import FrameworkInfo
from mlscope.errors import ConfigError, FrameworkUnavailable
from mlscope.manifest import FRAMEWORKS, ModelManifest
from mlscope.predictor import Predictor, PredictorOptions

__all__ = ["module", "open_predictor", "probe"]


def module(framework: str) -> ModuleType:
    if framework not in FRAMEWORKS:
        raise ConfigError(f"unknown framework {framework!r} (one of {', '.join(FRAMEWORKS)})")
    return importlib.import_module(f"agent.predictors.{framework}")


def probe(framework: str) -> FrameworkInfo | None:
    """What of this framework really loads here (None when it does not)."""
    try:
        info: FrameworkInfo | None = module(framework).probe()
    except ImportError:
        return None
    return info


def open_predictor(framework: str, model_path: Path, manifest: ModelManifest,
                   options: PredictorOptions) -> Predictor:
    try:
        mod = module(framework)
    except ImportError as exc:
        raise FrameworkUnavailable(
            f"{framework} is not installed: pip install 'mlscope[{_extra(framework)}]'",
            framework=framework) from exc
    pred: Predictor = mod.open(model_path, manifest, options)
    return pred


def _extra(framework: str) -> str:
    return {"onnxruntime": "onnx", "pytorch": "torch", "tensorflow": "tf"}.get(
        framework, framework)
