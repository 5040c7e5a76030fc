"""``mlscope models init FILE``: a starter model manifest read from an ONNX or TFLite file.

The framework comes from the extension (``.onnx``: onnxruntime, ``.tflite``: tflite);
the inputs' and outputs' names, shapes and element types from the file itself, through
the framework's own reader (``onnx``; LiteRT's interpreter); the sha256 of the file is
filled in. The first dimension of the first input is taken as the batch (a fixed batch
of N is recorded as ``attributes.fixed_batch_size``); other dynamic dimensions become 1
and are listed in ``attributes.note``. What the file cannot say (task, licence,
pre-/post-processing steps, labels) is left for the user, and the manifest says so.
"""

from __future__ import annotations

import argparse
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mlscope.errors import ConfigError
from mlscope.hashing import sha256_path
from mlscope.manifest import load_manifest

__all__ = ["Tensor", "register", "starter_manifest"]

FRAMEWORK_BY_SUFFIX = {".onnx": "onnxruntime", ".tflite": "tflite"}
HEADER = (
    "# Starter manifest written by `mlscope models init` from {file}.\n"
    "# Check task, version, licence and description; add the pre-processing steps\n"
    "# (cast, normalize, reshape, ...) and the outputs' type, steps and labels.\n"
)


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
        raise ConfigError(f"{path}: no such file", field="file")
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
    attributes: dict[str, Any] = {}
    notes: list[str] = []
    specs = []
    for i, t in enumerate(inputs):
        dims = list(t.dims)
        spec: dict[str, Any] = {"type": "tensor", "layer_name": t.name}
        spec["element_type"] = t.element_type
        if dims:  # every input carries the batch on axis 0 (the manifest's default)
            batch = dims.pop(0)
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
    return re.sub(r"[^A-Za-z0-9_\-]+", "_", stem).strip("_") or "model"


def _location(path: Path, out: Path) -> dict[str, str]:
    """Beside the manifest: a relative graph path; elsewhere: a ``file://`` base."""
    here, there = path.resolve().parent, out.resolve().parent
    if here == there:
        return {"graph_path": path.name}
    return {"base_url": "file://" + urllib.parse.quote(str(here)), "graph_path": path.name}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "init",
        help="write a starter manifest from an ONNX or TFLite file",
        description=__doc__,
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
    if out.exists() and not args.force:
        raise ConfigError(f"{out} exists (--force overwrites it)", field="output")
    doc = starter_manifest(path, out=out, name=args.name, version=args.version)
    text = HEADER.format(file=path.name) + yaml.safe_dump(
        doc, sort_keys=False, default_flow_style=None, width=100
    )
    out.write_text(text)
    load_manifest(out)  # what we write must validate
    print(f"wrote {out} ({doc['framework']['name']}, {len(doc['inputs'])} input(s))")
    return 0
