"""System-requirement flags of ``mlscope-submit`` (and of commands built on its jobs).

``--system`` names a ``kind: system`` file (a path, or the name of one under the
manifest directories, e.g. ``gpu-h100``); the other flags set single requirements and
win over the file's. The server merges the result over the model manifest's
``system`` and resolves only agents that meet it (``mlscope.sysmatch``).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from cli.flag_types import MAX_COUNT, positive_int
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.contracts import SystemRequirement
from mlscope.errors import ConfigError
from mlscope.manifest import SystemManifest
from mlscope.manifest_files import load_manifest
from mlscope.settings import Settings
from mlscope.sysmatch import from_manifest

__all__ = ["add_system_flags", "parse_size", "system_from_args"]

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``8G``, ``512M``, ``16GiB``, ``1073741824`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if m is None:
        raise ConfigError(f"not a size: {text!r} (e.g. 8G, 512M)", field="min_memory")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _size_flag(text: str) -> int:
    """:func:`parse_size` as an argparse type: a refusal is the flag's usage error, in
    its own words (argparse would print ``invalid parse_size value``)."""
    try:
        size = parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.message) from exc
    if size > MAX_COUNT:  # what the wire carries
        raise argparse.ArgumentTypeError(f"{text!r} is too large (at most {MAX_COUNT} bytes)")
    return size


def _name(text: str) -> str:
    """An argparse type: a requirement's value (an architecture, a model, a host), not
    blank: a blank one would be matched against agents as a name nobody has."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text.strip()


def add_system_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("system requirements (the agent's machine must meet them)")
    g.add_argument(
        "--system",
        default=None,
        metavar="FILE|NAME",
        help="a kind: system manifest (manifests/systems/NAME.yaml, or its NAME)",
    )
    g.add_argument("--arch", type=_name, default=None, help="CPU architecture, e.g. amd64, arm64")
    g.add_argument(
        "--accelerator", type=_name, default=None, help="accelerator model, e.g. H100, u250"
    )
    g.add_argument(
        "--min-memory", type=_size_flag, default=None, help="memory the agent may use, e.g. 8G"
    )
    g.add_argument(
        "--min-cores", type=positive_int, default=None, help="cores the agent may run on"
    )
    g.add_argument(
        "--interconnect", type=_name, default=None, help="accelerator link, e.g. pcie4, nvlink"
    )
    g.add_argument("--host", dest="system_host", type=_name, default=None, help="exactly this host")


def _system_file(ref: str) -> SystemManifest:
    path = Path(ref)
    if path.suffix in (".yaml", ".yml") or path.exists():
        m = load_manifest(path)
        if not isinstance(m, SystemManifest):
            raise ConfigError(f"{ref} is not a kind: system manifest", field="system")
        return m
    dirs = default_manifest_dirs(Settings.from_env().manifests_dir)
    return Catalog.load(dirs).system(ref)


def system_from_args(args: argparse.Namespace) -> SystemRequirement | None:
    """The job's requirements: ``--system``'s, with the single flags over them."""
    ref = getattr(args, "system", None)
    base = from_manifest(_system_file(ref)) if ref else None
    flags = {
        "arch": getattr(args, "arch", None),
        "accelerator": getattr(args, "accelerator", None),
        "min_memory_bytes": getattr(args, "min_memory", None),
        "min_cores": getattr(args, "min_cores", None),
        "interconnect": getattr(args, "interconnect", None),
        "host": getattr(args, "system_host", None),
    }
    set_flags = {k: v for k, v in flags.items() if v is not None}
    if base is None and not set_flags:
        return None
    fields = base.model_dump(exclude_none=True) if base is not None else {}
    return SystemRequirement.model_validate({**fields, **set_flags})
