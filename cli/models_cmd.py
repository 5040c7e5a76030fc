"""``mlscope models [--json]``: models by task with versions, frameworks, sizes, paths."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mlscope.catalog import Catalog, Entry, default_manifest_dirs
from mlscope.errors import MLScopeError

__all__ = ["describe", "register", "run"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    models = subparsers.add_parser("models", help="list the models the catalog knows")
    models.add_argument("--json", action="store_true", help="machine-readable output")
    models.set_defaults(func=run)


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def describe(entry: Entry, zoo_dir: Path) -> dict[str, Any]:
    """One model manifest as a row: where its graph is, whether it is there, its size."""
    m = entry.manifest
    row: dict[str, Any] = {
        "name": m.name, "version": m.version, "task": m.task,
        "framework": m.framework.name, "framework_version": m.framework.version,
        "latency_only": m.latency_only, "manifest": str(entry.path),
        "sha256": m.assets.sha256, "path": None, "size_bytes": None, "available": False,
        "dataset": m.dataset.name if m.dataset else None,
    }
    try:
        root = entry.root(zoo_dir)
    except MLScopeError:
        row["path"] = f"{m.assets.base_url}/{m.assets.graph_path}"
        return row
    path = root / m.assets.graph_path
    row["path"] = str(path)
    if path.exists():
        row["size_bytes"] = _size(path)
        row["available"] = True
    return row


def run(args: argparse.Namespace) -> int:
    try:
        catalog = Catalog.load(default_manifest_dirs(args.settings.manifests_dir))
    except MLScopeError as exc:
        print(f"mlscope models: {exc}", file=sys.stderr)
        return 1
    zoo_dir: Path = args.settings.zoo_dir
    tasks = {task: [describe(e, zoo_dir) for e in entries]
             for task, entries in catalog.tasks().items()}
    if args.json:
        print(json.dumps(tasks, indent=2))
        return 0
    for task, rows in tasks.items():
        print(f"{task}:")
        for r in rows:
            size = f"{r['size_bytes'] / 1e6:8.2f} MB" if r["size_bytes"] is not None else \
                "   (not built)"
            flag = " latency-only" if r["latency_only"] else ""
            print(f"  {r['name']:<22} {r['version']:<8} {r['framework']:<12} {size}  "
                  f"{r['path']}{flag}")
    return 0
