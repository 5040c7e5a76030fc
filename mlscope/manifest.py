"""Model and framework manifests (paper Listings 1 and 2), validated by pydantic.

A model manifest names one model version on one framework: its inputs with their
pre-processing steps, its outputs with their post-processing steps, its assets with
sha256 checksums, and the labeled data set used for accuracy. Unknown fields are
rejected; every error names the file, the line and the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mlscope.errors import ManifestError
from mlscope.versions import parse_constraint, parse_version

__all__ = [
    "FRAMEWORKS",
    "Assets",
    "DatasetSpec",
    "FrameworkManifest",
    "FrameworkRef",
    "InputSpec",
    "ModelManifest",
    "OutputSpec",
    "SystemRequirements",
    "load_manifest",
    "load_yaml",
]

FRAMEWORKS = ("onnxruntime", "pytorch", "tensorflow", "tflite", "xrt", "noop")


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


Step = dict[str, Any]
"""One processing step: ``{operator_name: {options}}`` (see agent.operators)."""


class FrameworkRef(_Strict):
    name: str
    version: str = "*"
    """Version constraint, e.g. ``>=1.12.0 <2.0`` or ``>=1.12,<2``."""

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in FRAMEWORKS:
            raise ValueError(f"unknown framework {v!r} (one of {', '.join(FRAMEWORKS)})")
        return v

    @field_validator("version")
    @classmethod
    def _constraint(cls, v: str) -> str:
        parse_constraint(v)
        return v


class InputSpec(_Strict):
    type: str = "tensor"
    layer_name: str | None = None
    element_type: str = "float32"
    shape: tuple[int, ...]
    """Shape of one sample, without the batch dimension."""
    layout: str | None = None
    steps: tuple[Step, ...] = ()


class OutputSpec(_Strict):
    type: str = "tensor"
    layer_name: str | None = None
    steps: tuple[Step, ...] = ()
    labels: str | None = None
    """Labels file (one per line), relative to the manifest's asset directory."""


class Assets(_Strict):
    base_url: str | None = None
    """Where assets come from: a directory, ``zoo://``, ``file://`` or ``http(s)://``."""
    graph_path: str
    weights_path: str | None = None
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    """sha256 of the graph file (for a directory: of its sorted file list and contents)."""
    weights_sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")


class DatasetSpec(_Strict):
    name: str
    path: str
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    metric: Literal["top1", "top5", "binary_auc", "none"] = "top1"


class SystemRequirements(_Strict):
    arch: str | None = None
    device: Literal["cpu", "gpu", "fpga"] = "cpu"
    accelerator: str | None = None
    min_memory_bytes: int | None = None
    interconnect: str | None = None


class ModelManifest(_Strict):
    kind: Literal["model"] = "model"
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]+$")
    version: str
    description: str = ""
    task: str
    license: str = "unknown"
    source: str = ""
    framework: FrameworkRef
    inputs: tuple[InputSpec, ...] = Field(min_length=1)
    outputs: tuple[OutputSpec, ...] = Field(min_length=1)
    assets: Assets
    attributes: dict[str, Any] = {}
    dataset: DatasetSpec | None = None
    latency_only: bool = False
    system: SystemRequirements = SystemRequirements()

    @field_validator("version")
    @classmethod
    def _semver(cls, v: str) -> str:
        parse_version(v)
        return v

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}:{self.framework.name}"


class FrameworkManifest(_Strict):
    kind: Literal["framework"] = "framework"
    name: str
    version: str
    containers: dict[str, dict[str, str]] = {}
    """Container image per architecture and device: ``{amd64: {cpu: image, gpu: image}}``."""
    options: dict[str, Any] = {}
    """Runtime options: ``intra_op_threads``, ``inter_op_threads``, ``providers``, ..."""


_KINDS: dict[str, type[BaseModel]] = {"model": ModelManifest, "framework": FrameworkManifest}


def load_yaml(path: Path) -> tuple[Any, yaml.Node | None]:
    """Parse YAML, keeping the node tree for line numbers."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ManifestError(f"cannot read: {exc.strerror}", file=str(path)) from exc
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise ManifestError(f"not valid YAML: {exc}", file=str(path), line=line) from exc
    return data, node


def _line_of(node: yaml.Node | None, loc: Sequence[int | str]) -> int | None:
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = [v for k, v in node.value if getattr(k, "value", None) == part]
            if not match:
                return line  # a missing field: point at its parent mapping
            node = match[0]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                return line
            node = node.value[part]
        else:
            return line
        line = node.start_mark.line + 1
    return line


def parse_manifest(data: Any, *, file: str, node: yaml.Node | None = None) -> BaseModel:
    """Validate already-parsed manifest data (from YAML or from the bus)."""
    if not isinstance(data, dict):
        raise ManifestError("a manifest must be a mapping", file=file, line=1)
    kind = data.get("kind", "model")
    cls = _KINDS.get(kind)
    if cls is None:
        raise ManifestError(f"unknown kind {kind!r} (model or framework)", file=file,
                            field="kind", line=_line_of(node, ["kind"]))
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = [p for p in first["loc"] if not (isinstance(p, str) and "[" in p)]
        field = ".".join(str(p) for p in loc) or None
        raise ManifestError(
            _message(first, len(exc.errors())), file=file, field=field, line=_line_of(node, loc)
        ) from exc


def _message(err: Any, count: int) -> str:
    kind = err["type"]
    text = {"missing": "is required", "extra_forbidden": "is not a known field"}.get(
        kind, str(err["msg"]))
    more = f" (and {count - 1} more error{'s' if count > 2 else ''})" if count > 1 else ""
    return f"{text}{more}"


def load_manifest(path: Path) -> BaseModel:
    """Load and validate one manifest file (model or framework)."""
    data, node = load_yaml(path)
    return parse_manifest(data, file=str(path), node=node)


def iter_manifest_files(dirs: Iterable[Path]) -> list[Path]:
    out: list[Path] = []
    for d in dirs:
        if d.is_dir():
            out.extend(sorted(p for p in d.rglob("*.y*ml") if p.suffix in (".yaml", ".yml")))
    return out
