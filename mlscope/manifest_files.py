"""Manifest files: YAML read within bounds and validated by kind, each error on its line.

:func:`load_manifest` reads one file (``kind:`` model, the default, framework, system or
scenario); :func:`parse_manifest` validates data already parsed, from YAML or from the
bus. A refusal is one :class:`ManifestError` naming the file, and the line and field of
every problem; :func:`scenario_refusal` places a scenario spec's refusal the same way,
on the lines of the scenario file that set its values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from mlscope.bounded import load_yaml_bounded
from mlscope.errors import ManifestError
from mlscope.framework_manifest import FrameworkManifest
from mlscope.manifest import ModelManifest, SystemManifest
from mlscope.scenario_file import ScenarioFile

__all__ = [
    "iter_manifest_files",
    "load_manifest",
    "load_yaml",
    "parse_manifest",
    "scenario_refusal",
]


_KINDS: dict[str, type[BaseModel]] = {
    "model": ModelManifest,
    "framework": FrameworkManifest,
    "system": SystemManifest,
    "scenario": ScenarioFile,
}


def load_yaml(path: Path) -> tuple[Any, yaml.Node | None]:
    """Parse YAML within bounds (size, encoding, depth, aliases, duplicate keys; see
    :mod:`mlscope.bounded`), keeping the node tree for line numbers."""
    return load_yaml_bounded(path)


def _line_of(node: yaml.Node | None, loc: Sequence[int | str]) -> int | None:
    """The 1-based line of the YAML element at ``loc``.

    A mapping entry reports its key's line; when the last part is missing (a required
    field), the line of the mapping that should hold it (its key's line when nested).
    """
    if node is None:
        return None
    line = int(node.start_mark.line) + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = [(k, v) for k, v in node.value if getattr(k, "value", None) == part]
            if not match:
                return line
            key, node = match[0]
            line = int(key.start_mark.line) + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                return line
            node = node.value[part]
            line = int(node.start_mark.line) + 1
        else:
            return line
    return line


def parse_manifest(data: Any, *, file: str, node: yaml.Node | None = None) -> BaseModel:
    """Validate already-parsed manifest data (from YAML or from the bus).

    The raised ManifestError carries the first problem's line and field; its message
    lists every problem, one per line, each with its own line and field.
    """
    if not isinstance(data, dict):
        raise ManifestError("a manifest must be a mapping", file=file, line=1)
    kind = data.get("kind", "model")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ManifestError(
            f"unknown kind {kind!r} (one of {', '.join(_KINDS)})",
            file=file,
            field="kind",
            line=_line_of(node, ["kind"]),
        )
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        problems = [_problem(err, node) for err in exc.errors(include_url=False)]
        raise _refusal(problems, file) from exc


def _refusal(problems: list[tuple[int | None, str | None, str]], file: str) -> ManifestError:
    """One error for every problem: the first's line and field, then one line each."""
    (line, field, text), rest = problems[0], problems[1:]
    for r_line, r_field, r_text in rest:
        where = f"{file}:{r_line}" if r_line is not None else file
        text += f"\n  {where}: field '{r_field}': {r_text}" if r_field else f"\n  {where}: {r_text}"
    return ManifestError(text, file=file, field=field, line=line)


def _problem(err: Any, node: yaml.Node | None) -> tuple[int | None, str | None, str]:
    # pydantic puts validator names such as "function-after[...]" into loc: skip them
    loc = [p for p in err["loc"] if not (isinstance(p, str) and "[" in p)]
    field = ".".join(str(p) for p in loc) or None
    kind = err["type"]
    if kind == "missing":
        text = "is required"
    elif kind == "extra_forbidden":
        text = "is not a known field"
    else:
        text = str(err["msg"]).removeprefix("Value error, ")
        if "input" in err and not isinstance(err["input"], (dict, list)):
            text += f" (got {_clipped(repr(err['input']))})"
    return _line_of(node, loc), field, text


GOT_MAX_CHARS = 200
"""Longest quote of a rejected value in an error: a bus manifest may hold a
megabyte-long string, and its errors are logged and kept by every watcher."""


def _clipped(text: str) -> str:
    if len(text) <= GOT_MAX_CHARS:
        return text
    return f"{text[:GOT_MAX_CHARS]}... ({len(text)} characters)"


def scenario_refusal(
    exc: ValidationError, *, file: str, node: yaml.Node | None, keys: Mapping[str, str]
) -> ManifestError:
    """A :class:`ScenarioSpec`'s refusal of the values a scenario file gave it, as that
    file's error: each problem on the line of the key that set the field (``keys``:
    spec field -> file key, where they differ)."""
    problems = []
    for err in exc.errors(include_url=False):
        loc = tuple(keys.get(p, p) if isinstance(p, str) else p for p in err["loc"])
        problems.append(_problem({**err, "loc": loc}, node))
    return _refusal(problems, file)


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
