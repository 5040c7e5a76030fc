"""``mlscope manifest validate FILE...``: exit non-zero with file:line: field messages."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlscope.errors import ManifestError
from mlscope.manifest_files import iter_manifest_files, load_manifest

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    manifest = subparsers.add_parser(
        "manifest", help="model, framework, system and scenario manifests"
    )
    sub = manifest.add_subparsers(dest="manifest_command", required=True)
    validate = sub.add_parser("validate", help="validate manifest files (or directories)")
    validate.add_argument("files", nargs="+", type=Path, metavar="FILE")
    validate.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    files: list[Path] = []
    empty = 0
    for f in args.files:
        found = iter_manifest_files([f]) if f.is_dir() else [f]
        if not found:  # a directory that holds none: said, not a silent failure
            empty += 1
            print(f"{f}: no manifest files (*.yaml, *.yml) in this directory", file=sys.stderr)
        files.extend(found)
    failed = 0
    for f in files:
        try:
            m = load_manifest(f)
        except ManifestError as exc:
            failed += 1
            print(str(exc), file=sys.stderr)
            continue
        print(f"{f}: ok ({getattr(m, 'kind', '?')})")
    if failed:
        print(f"{failed} of {len(files)} manifest(s) invalid", file=sys.stderr)
    return 1 if failed or empty else 0
