"""Framework manifests (paper Listing 2): one framework version and how to run it.

A framework manifest names a framework and its version, the containers it runs in, and
the runtime options its predictors read (threads, execution providers, graph
optimization, framework-specific extras), with per-device overrides.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from mlscope.devices import Device, device_kind
from mlscope.manifest import FrameworkName, Strict
from mlscope.versions import parse_version

__all__ = ["FrameworkManifest", "RuntimeOptions"]


class RuntimeOptions(Strict):
    """Framework runtime options; a predictor ignores those its framework lacks.

    The agent hands them to its predictors as one flat mapping
    (:meth:`FrameworkManifest.runtime`): the named fields below plus every key of
    ``extra`` (``signature`` for TensorFlow, ``execution_mode`` / ``tensorrt`` /
    ``provider_options`` for ONNX Runtime, ``xnnpack`` / ``dequantize`` for TFLite,
    ``format`` for PyTorch). An agent's explicit ``--threads`` wins over
    ``intra_op_threads``.
    """

    intra_op_threads: int | None = Field(default=None, ge=0)
    """Threads inside one operator (0: the framework's default)."""
    inter_op_threads: int | None = Field(default=None, ge=0)
    """Threads running independent operators."""
    providers: tuple[str, ...] = ()
    """ONNX Runtime execution providers, in preference order."""
    graph_optimization: Literal["disable", "basic", "extended", "all"] | None = None
    extra: dict[str, Any] = Field(default_factory=dict)
    """Framework-specific settings passed through as they are."""


class FrameworkManifest(Strict):
    """One framework version and how to run it (paper Listing 2)."""

    kind: Literal["framework"] = "framework"
    name: FrameworkName
    version: str
    description: str = ""
    containers: dict[str, dict[Device, str]] = Field(default_factory=dict)
    """Container image per architecture and device: ``{amd64: {cpu: image, gpu: image}}``."""
    options: RuntimeOptions = RuntimeOptions()
    device_options: dict[Device, RuntimeOptions] = Field(default_factory=dict)
    """Per device kind, options that replace those of ``options`` field by field
    (``extra`` is merged key by key), e.g. the execution providers of a GPU."""

    @field_validator("version")
    @classmethod
    def _semver(cls, v: str) -> str:
        parse_version(v)
        return v

    def runtime(self, device: str = "cpu") -> dict[str, Any]:
        """The flat runtime options a predictor reads for ``device`` (``cpu``,
        ``cuda:N``, ``fpga:N``...): unset fields are left out, ``extra`` is inlined."""
        base, over = self.options, self.device_options.get(device_kind(device))
        fields = dict(base.model_dump(exclude={"extra"}, exclude_none=True))
        extra = dict(base.extra)
        if over is not None:
            fields.update(over.model_dump(include=over.model_fields_set - {"extra"}))
            extra.update(over.extra)
        if not fields.get("providers"):
            fields.pop("providers", None)
        return {**extra, **{k: v for k, v in fields.items() if v is not None}}
