"""``mlscope models``: the catalog, and the models registry on the bus.

- ``mlscope models [--json] [--remote]``: models by task with versions, frameworks,
  sizes and artifact paths (``--remote`` adds the manifests published on the bus);
- ``mlscope models publish FILE|DIR...``: validate model manifests and put them in the
  registry bucket; running agents that have the artifacts start serving them at once;
- ``mlscope models remove NAME --version V --framework F``: take one out again.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any

import anyio

from cli.console import print_table
from cli.flag_types import framework_name
from mlscope import artifact_bucket
from mlscope import bus as busmod
from mlscope.artifacts import ArtifactStore
from mlscope.buildlock import BuildLock
from mlscope.catalog import Catalog, Entry, default_manifest_dirs
from mlscope.errors import ManifestError, MLScopeError
from mlscope.fetchpolicy import BUS_SCHEMES
from mlscope.manifest import ModelManifest
from mlscope.manifest_files import iter_manifest_files, load_manifest
from mlscope.model_registry import (
    ManifestWatcher,
    delete_manifest,
    key_for,
    publish_manifest,
)
from mlscope.provision import provisioned
from mlscope.settings import Settings

__all__ = ["describe", "register", "run"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    models = subparsers.add_parser("models", help="list the models the catalog knows")
    models.add_argument("--json", action="store_true", help="machine-readable output")
    models.add_argument(
        "--remote", action="store_true", help="include the manifests published on the bus"
    )
    models.set_defaults(func=run)
    sub = models.add_subparsers(dest="models_command")
    pub = sub.add_parser("publish", help="publish model manifests to the bus registry")
    pub.add_argument("files", nargs="+", type=Path, metavar="FILE")
    pub.set_defaults(func=run_publish)
    rm = sub.add_parser("remove", help="remove a model manifest from the bus registry")
    rm.add_argument("name")
    rm.add_argument("--version", required=True)
    rm.add_argument("--framework", type=framework_name, required=True)
    rm.set_defaults(func=run_remove)
    from cli.models_init import register as register_init

    register_init(sub)


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def describe(entry: Entry, zoo_dir: Path, store: ArtifactStore | None = None) -> dict[str, Any]:
    """One model manifest as a row: where its graph is, whether it is there and
    verified (against its pin or its build lock), its size, and if not, why not and
    the command that fixes it."""
    m = entry.manifest
    row: dict[str, Any] = {
        "name": m.name,
        "version": m.version,
        "task": m.task,
        "framework": m.framework.name,
        "framework_version": m.framework.version,
        "latency_only": m.latency_only,
        "manifest": str(entry.path),
        "sha256": m.assets.sha256,
        "path": None,
        "size_bytes": None,
        "available": False,
        "why": None,
        "fix": None,
        "dataset": m.dataset.name if m.dataset else None,
    }
    try:
        root = entry.root(zoo_dir)
    except MLScopeError:
        row["path"] = f"{m.assets.base_url}/{m.assets.graph_path}"
        row["why"] = "remote: fetched by the agent that serves it"
        return row
    row["path"] = str(root / m.assets.graph_path)
    try:
        path = entry.graph(zoo_dir, store=store)
    except MLScopeError as exc:
        row["why"], row["fix"] = exc.message, exc.fields.get("fix") or None
        row["reason"] = exc.fields.get("reason") or "invalid"
        return row
    row.update(size_bytes=_size(path), available=True, sha256=entry.graph_sha256(zoo_dir))
    return row


def run(args: argparse.Namespace) -> int:
    try:
        catalog = Catalog.load(default_manifest_dirs(args.settings.manifests_dir))
        if args.remote:
            remote = anyio.run(_remote_entries, args.settings, backend="asyncio")
            catalog = catalog.merged(remote)
    except MLScopeError as exc:
        print(f"mlscope models: {exc}", file=sys.stderr)
        return 1
    zoo_dir: Path = args.settings.zoo_dir
    store = ArtifactStore(args.settings.data_dir, zoo_dir=zoo_dir)
    tasks = {
        task: [describe(e, zoo_dir, store) for e in entries]
        for task, entries in catalog.tasks().items()
    }
    if args.json:
        print(json.dumps(tasks, indent=2))
        return 0
    for task, rows in tasks.items():
        lines = [f"{task}:"]
        cells = []
        for r in rows:
            size = f"{r['size_bytes'] / 1e6:8.2f} MB" if r["available"] else "   NOT BUILT"
            if r.get("reason") == "missing" and not r["fix"]:  # nothing here builds it
                size = "     MISSING"
            flag = " latency-only" if r["latency_only"] else ""
            lines.append(
                f"  {r['name']:<22} {r['version']:<8} {r['framework']:<12} {size}  "
                f"{r['path']}{flag}"
            )
            note = flag.strip()
            if r.get("reason"):
                note = _why_not(r)
                lines.append(f"      {note}")
            cells.append((r["name"], r["version"], r["framework"], size.strip(), r["path"], note))
        print_table(
            ("model", "version", "framework", "size", "path", "note"),
            cells,
            plain="\n".join(lines),
            title=task,
            right=("size",),
        )
    return 0


def _why_not(row: dict[str, Any]) -> str:
    """Why a row's graph is not available, with the command that fixes it if there is
    one: a missing file that no build makes (a ``file://`` model) says only why."""
    if row.get("reason") == "missing" and row["fix"]:
        return f"not built here: run `{row['fix']}`"
    if row.get("reason") == "missing":
        return f"missing: {row['why']}"
    return f"refused: {row['why']}"


async def _remote_entries(settings: Settings) -> list[Entry]:
    """The bus's valid manifests; invalid ones are reported on stderr and left out."""
    said: list[str] = []

    def say(line: str) -> None:
        said.append(line)
        print(f"mlscope models: {line}", file=sys.stderr)

    async with busmod.connect(settings, name="mlscope models") as bus:
        snap = await ManifestWatcher.snapshot(bus, log=say)
    if len(snap.rejected) > len(said):  # the watcher's log budget left the rest out
        print(
            f"mlscope models: {len(snap.rejected) - len(said)} more manifests on the bus "
            "are invalid (not listed one by one)",
            file=sys.stderr,
        )
    return list(snap.entries.values())


def publishable(path: Path) -> ModelManifest:
    """A model manifest whose assets any agent can locate: built (``zoo://``), on an
    http(s) server, or files beside the manifest (a relative ``base_url``, as
    ``mlscope models init`` writes), which publishing puts into the artifact bucket."""
    m = load_manifest(path)
    if not isinstance(m, ModelManifest):
        raise ManifestError("only model manifests can be published", file=str(path), field="kind")
    base = m.assets.base_url or ""
    if "://" in base and not base.startswith((*BUS_SCHEMES, "http://", "https://")):
        # agents refuse every other location in a manifest from the bus (fetchpolicy)
        raise ManifestError(
            f"assets.base_url {base!r}: agents never fetch a bus manifest's files from "
            "file:// or pkg:// locations; use files beside the manifest (a relative "
            "base_url: they are put into the artifact bucket), zoo:// or an http(s):// "
            "URL under the agents' MLSCOPE_ARTIFACT_URL_PREFIXES",
            file=str(path),
            field="assets.base_url",
        )
    return m


def own_files(m: ModelManifest) -> list[str]:
    """The top-level files or directories a manifest's assets name, relative to its
    asset directory: the graph, weights, labels and data set."""
    named = [
        m.assets.graph_path,
        m.assets.weights_path,
        m.dataset.path if m.dataset else None,
        *(o.labels for o in m.outputs),
    ]
    return sorted({PurePosixPath(f).parts[0] for f in named if f})


def _pinned(path: Path, m: ModelManifest, lock: BuildLock) -> None:
    """The manifest's checksums are its files' (a file changed since the manifest was
    written is refused here, not by every agent after the push). ``lock``: the files as
    they were copied for the push, each hashed once."""
    source = path.parent / (m.assets.base_url or "")
    pins = (
        (m.assets.graph_path, m.assets.sha256),
        (m.assets.weights_path, m.assets.weights_sha256),
    )
    for relative, pinned in pins:
        if relative is None or pinned is None:
            continue
        got = lock.files.get(PurePosixPath(relative).as_posix())
        if got is not None and got != pinned:
            raise ManifestError(
                f"{source / relative} does not have the sha256 the manifest pins "
                f"({pinned[:12]}...): it changed since the manifest was written",
                file=str(path),
                field="assets.sha256",
            )


async def with_files_on_bus(
    bus: busmod.Bus, path: Path, m: ModelManifest, *, replicas: int = 1
) -> ModelManifest:
    """``m`` as agents anywhere can serve it: a manifest whose files sit beside it has
    them put into the artifact bucket as ``zoo://NAME/VERSION`` (verified file by file
    when an agent fetches them) and points there; any other is returned as it is."""
    if "://" in (m.assets.base_url or ""):
        return m
    await artifact_bucket.push_files(
        bus,
        path.parent / (m.assets.base_url or ""),
        name=m.name,
        version=m.version,
        artifacts=own_files(m),
        origin={"published": path.name},
        check=partial(_pinned, path, m),
        replicas=replicas,
        log=lambda line: print(line, file=sys.stderr),
    )
    doc = m.model_dump(mode="json")
    doc["assets"] = {**doc["assets"], "base_url": f"zoo://{m.name}/{m.version}"}
    return ModelManifest.model_validate(doc)


def run_publish(args: argparse.Namespace) -> int:
    settings: Settings = args.settings
    files: list[Path] = []
    for f in args.files:
        files.extend(iter_manifest_files([f]) if f.is_dir() else [f])
    try:
        manifests = [publishable(f) for f in files]

        async def go() -> list[str]:
            async with provisioned(settings, name="mlscope models publish") as bus:
                keys = []
                for f, m in zip(files, manifests, strict=True):
                    m = await with_files_on_bus(bus, f, m, replicas=settings.js_replicas)
                    keys.append(await publish_manifest(bus, m))
                return keys

        keys = anyio.run(go, backend="asyncio")
    except MLScopeError as exc:
        print(f"mlscope models publish: {exc}", file=sys.stderr)
        return 1
    for f, key in zip(files, keys, strict=True):
        print(f"published {key} ({f})")
    return 0 if keys else 1


def run_remove(args: argparse.Namespace) -> int:
    key = key_for(args.name, args.version, args.framework)

    async def go() -> bool:
        async with busmod.connect(args.settings, name="mlscope models remove") as bus:
            return await delete_manifest(bus, key)

    try:
        removed = anyio.run(go, backend="asyncio")
    except MLScopeError as exc:
        print(f"mlscope models remove: {exc}", file=sys.stderr)
        return 1
    if not removed:
        print(f"mlscope models remove: {key} is not in the bus registry", file=sys.stderr)
        return 1
    print(f"removed {key}")
    return 0
