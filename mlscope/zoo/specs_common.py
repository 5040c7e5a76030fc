"""What every zoo manifest the generator renders shares: the file suffix and version
constraint of each framework, and how a rendered document drops its empty fields."""

from __future__ import annotations

from typing import Any

__all__ = ["CONSTRAINTS", "FRAMEWORK_FILES", "Rendered", "drop_none"]

FRAMEWORK_FILES = {
    "onnxruntime": ".onnx",
    "pytorch": ".pt",
    "tensorflow": ".savedmodel",
    "tflite": ".tflite",
}
CONSTRAINTS = {
    "onnxruntime": ">=1.20 <2.0",
    "pytorch": ">=2.4,<3",
    "tensorflow": ">=2.16 <3.0",
    "tflite": ">=2.0,<3",
}
"""Both constraint spellings are accepted (mlscope.versions)."""

Rendered = dict[str, tuple[str, dict[str, Any]]]
"""``{file name: (comment above the document, document)}``, what each renderer returns."""


def drop_none(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: drop_none(v) for k, v in doc.items() if v is not None}
    if isinstance(doc, list):
        return [drop_none(v) for v in doc]
    return doc
