"""``mlscope models init FILE``: a starter model manifest read from an ONNX or TFLite file.

The framework comes from the extension (``.onnx``: onnxruntime, ``.tflite``: tflite);
the inputs' and outputs' names, shapes and element types from the file itself, through
the framework's own reader (``onnx``; LiteRT's interpreter); the sha256 of the file is
filled in. The first dimension of the first input is taken as the batch (a fixed batch
of N is recorded as ``attributes.fixed_batch_size``); other dynamic dimensions become 1
and are listed in ``attributes.note``. What the file cannot say (task, licence,
pre-/post-processing steps, labels) is left for the user, and the manifest says so.

Nothing is written until the manifest validates: it is rendered and checked in memory
(schema, and size: at most 1 MiB), then put in place by a rename, so
a refused model leaves no file behind to block the retry or break ``mlscope models``.
An existing ``-o`` (a symbolic link included, dangling or not) is refused unless
``--force``, which replaces the link itself, never the file it points at.
"""

from __future__ import annotations

import argparse
import os
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from cli.console import help_text
from cli.submit_errors import FlagError
from mlscope.bounded import MAX_DOCUMENT_BYTES
from mlscope.errors import ConfigError, ManifestError
from mlscope.hashing import sha256_path
from mlscope.manifest import NAME_MAX_CHARS
from mlscope.manifest_files import parse_manifest
from mlscope.secrets_io import write_atomic

__all__ = ["Tensor", "register", "starter_manifest"]

FRAMEWORK_BY_SUFFIX = {".onnx": "onnxruntime", ".tflite": "tflite"}
HEADER = (
    "# Starter manifest written by `mlscope models init` from {file}.\n"
    "# Check task, version, licence and description; add the pre-processing steps\n"
    "# (cast, normalize, reshape, ...) and the outputs' type, steps and labels.\n"
)
MAX_TENSORS = 1024
"""Most inputs (and most outputs) a starter manifest lists, checked before anything is
rendered: 20,000 inputs take seconds to render and validate, only to exceed the
manifest size limit. Models with KV caches have a few hundred."""
FLAGS = {"name": "--name", "version": "--version"}
"""The manifest fields a flag of ``models init`` sets."""


@dataclass(frozen=True)
class Tensor:
    """One input or output as the file declares it; ``None`` dims are dynamic."""

    name: str
    dims: tuple[int | None, ...]
    element_type: str


def _onnx_tensors(path: Path) -> tuple[list[Tensor], list[Tensor]]:
    import onnx  # the [onnx] extra

    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    weights = {i.name for i in g.initializer}

    def tensor(v: Any) -> Tensor:
        t = v.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name
        return Tensor(v.name, dims, dtype)

    return [tensor(v) for v in g.input if v.name not in weights], [tensor(v) for v in g.output]


def _tflite_tensors(path: Path) -> tuple[list[Tensor], list[Tensor]]:
    import numpy as np
    from ai_edge_litert.interpreter import Interpreter  # the [tflite] extra

    it = Interpreter(model_path=str(path))

    def tensor(d: dict[str, Any]) -> Tensor:
        sig = d.get("shape_signature")
        sig = list(sig) if sig is not None and len(sig) else list(d["shape"])
        dims = tuple(None if int(x) < 0 else int(x) for x in sig)
        return Tensor(str(d["name"]), dims, np.dtype(d["dtype"]).name)

    return [tensor(d) for d in it.get_input_details()], [tensor(d) for d in it.get_output_details()]


def read_tensors(path: Path) -> tuple[str, list[Tensor], list[Tensor]]:
    """(framework, inputs, outputs) of a model file; a ConfigError for any other file."""
    framework = FRAMEWORK_BY_SUFFIX.get(path.suffix.lower())
    if framework is None:
        raise ConfigError(
            f"{path}: cannot tell the framework from {path.suffix or 'no extension'!r} "
            f"(known: {', '.join(FRAMEWORK_BY_SUFFIX)})",
            field="file",
        )
    if not path.is_file():
        what = "not a regular file" if path.exists() else "no such file"
        what += " (a directory)" if path.is_dir() else ""
        raise ConfigError(f"{path}: {what}", field="file")
    reader = _onnx_tensors if framework == "onnxruntime" else _tflite_tensors
    extra = "onnx" if framework == "onnxruntime" else "tflite"
    try:
        inputs, outputs = reader(path)
    except ImportError as exc:
        raise ConfigError(
            f"reading {path.suffix} files needs {exc.name}: pip install 'mlscope[{extra}]'"
        ) from exc
    except Exception as exc:  # the framework's reader: any failure means "not a model"
        raise ConfigError(f"{path}: not a readable {framework} model ({exc})") from exc
    if not inputs or not outputs:
        raise ConfigError(f"{path}: the model declares no inputs or no outputs")
    return framework, inputs, outputs


def starter_manifest(
    path: Path, *, out: Path, name: str | None = None, version: str = "1.0.0"
) -> dict[str, Any]:
    """The manifest document for the model file ``path``, to be written at ``out``."""
    framework, inputs, outputs = read_tensors(path)
    for what, tensors in (("inputs", inputs), ("outputs", outputs)):
        if len(tensors) > MAX_TENSORS:
            raise ConfigError(
                f"{path}: the model declares {len(tensors)} {what}; a starter manifest "
                f"lists at most {MAX_TENSORS}",
                field="file",
            )
    attributes: dict[str, Any] = {}
    notes: list[str] = []
    specs = []
    for i, t in enumerate(inputs):
        dims = list(t.dims)
        spec: dict[str, Any] = {"type": "tensor", "layer_name": t.name}
        spec["element_type"] = t.element_type
        if dims:  # every input carries the batch on axis 0 (the manifest's default)
            batch = dims.pop(0)
            if batch is not None and batch < 1:  # no batch holds fewer than one sample
                raise ConfigError(
                    f"{path}: input {t.name[:40]!r} has a batch dimension of {batch}; "
                    "a dimension is at least 1 or dynamic",
                    field="file",
                )
            if i == 0 and batch is not None:
                attributes["fixed_batch_size"] = batch
        if any(d is None for d in dims):
            notes.append(f"input {t.name}: dynamic dimensions set to 1")
        spec["shape"] = [1 if d is None else d for d in dims]
        specs.append(spec)
    if notes:
        attributes["note"] = "; ".join(notes)
    doc: dict[str, Any] = {
        "kind": "model",
        "name": name or _name(path.stem),
        "version": version,
        "description": f"{path.name}, described from the file by mlscope models init",
        "task": "unknown",
        "license": "unknown",
        "source": str(path.name),
        "framework": {"name": framework, "version": "*"},
        "inputs": specs,
        "outputs": [{"type": "tensor", "layer_name": t.name} for t in outputs],
        "assets": {**_location(path, out), "sha256": sha256_path(path)},
        "latency_only": True,
    }
    if attributes:
        doc["attributes"] = attributes
    return doc


def _name(stem: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_\-]+", "_", stem).strip("_")[:NAME_MAX_CHARS]
    return name.strip("_") or "model"


def _location(path: Path, out: Path) -> dict[str, str]:
    """Beside the manifest: a relative graph path; elsewhere: a ``file://`` base.

    A symbolic link is followed, and directory and name are both the target's (the
    artifact store refuses a graph path that leaves its directory through a link;
    the target's directory with the link's name would point at nothing)."""
    real = path.resolve()
    here, there = real.parent, out.parent.resolve()
    if here == there:
        return {"graph_path": real.name}
    return {"base_url": "file://" + urllib.parse.quote(str(here)), "graph_path": real.name}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "init",
        help="write a starter manifest from an ONNX or TFLite file",
        description=help_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", type=Path, metavar="FILE", help="model.onnx or model.tflite")
    p.add_argument(
        "-o", "--output", type=Path, default=None, help="default: NAME.FRAMEWORK.yaml beside FILE"
    )
    p.add_argument("--name", default=None, help="model name (default: from the file name)")
    p.add_argument("--version", default="1.0.0", help="model version (default 1.0.0)")
    p.add_argument("--force", action="store_true", help="overwrite an existing manifest")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path: Path = args.file
    framework = FRAMEWORK_BY_SUFFIX.get(path.suffix.lower(), "unknown")
    out: Path = args.output or path.with_name(f"{_name(path.stem)}.{framework}.yaml")
    _check_output(out, force=args.force)
    doc = starter_manifest(path, out=out, name=args.name, version=args.version)
    given = {"name": args.name is not None, "version": True}
    text = _render(doc, file=path.name, out=out, flags=given)
    write_atomic(out, text, mode=0o666)  # a rename: never through a link
    print(f"wrote {out} ({doc['framework']['name']}, {len(doc['inputs'])} input(s))")
    return 0


def _check_output(out: Path, *, force: bool) -> None:
    """Refuse an ``out`` that exists (a dangling symbolic link included) unless
    ``force``, a directory even then, and one in no directory, before the model is
    read."""
    if out.is_dir():  # --force replaces a file or a link, never a directory
        raise ConfigError(f"{out} is a directory; -o names the manifest file", field="output")
    if os.path.lexists(out) and not force:
        what = "is a symbolic link (--force replaces the link, not its target)"
        if not out.is_symlink():
            what = "exists (--force overwrites it)"
        raise ConfigError(f"{out} {what}", field="output")
    if not out.parent.is_dir():
        raise ConfigError(f"{out}: no such directory {out.parent}", field="output")


def _render(doc: dict[str, Any], *, file: str, out: Path, flags: dict[str, bool]) -> str:
    """The manifest's text, validated as it will be read back from ``out``.

    A refusal of a field a flag set (``flags``: field -> given on the command line) is
    the flag's: a FlagError (exit 2) naming it."""
    try:
        parse_manifest(doc, file=str(out))
    except ManifestError as exc:
        blamed = _flag_problems(exc, flags)
        if blamed:
            raise FlagError(blamed) from exc
        raise
    body: str = yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=100)
    text = HEADER.format(file=file) + body
    size = len(text.encode())
    if size > MAX_DOCUMENT_BYTES:
        raise ManifestError(
            f"would be {size} bytes; a manifest may have at most {MAX_DOCUMENT_BYTES}",
            file=str(out),
        )
    return text


def _flag_problems(exc: ManifestError, flags: dict[str, bool]) -> str:
    """``argument --name: why (got ...)`` for each refused field a given flag set."""
    cause = exc.__cause__
    errors = cause.errors(include_url=False) if isinstance(cause, ValidationError) else []
    parts = []
    for err in errors:
        field = next((str(p) for p in err["loc"] if isinstance(p, str)), "")
        if field in FLAGS and flags.get(field):
            why = str(err["msg"]).removeprefix("Value error, ")
            got = repr(err.get("input"))
            got = got if len(got) <= 80 else f"{got[:60]}... ({len(got)} characters)"
            parts.append(
                f"argument {FLAGS[field]}: {why}" + ("" if got in why else f" (got {got})")
            )
    return "; ".join(parts)
