"""Manifests on the bus (paper section 4.6): add or remove models at run time, no code.

Each model manifest is stored as JSON in the KV bucket :data:`mlscope.names.MODELS_BUCKET`
under ``<name>.<version>.<framework>``. NATS KV keys allow ``[-/_=.a-zA-Z0-9]`` (dots
are subject-token separators, so they are fine inside a key but not at its ends);
anything else, e.g. the ``+`` of a local version label, becomes ``_``.

Manifests read back from the bus are **untrusted**: they are validated exactly like
local files, and :func:`mlscope.manifest.mark_untrusted` makes any custom Python step in
them refuse to compile (see docs/SECURITY.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nats.errors
import nats.js.errors

from mlscope import names
from mlscope.bus import Bus
from mlscope.catalog import Catalog, Entry
from mlscope.errors import BusError, ManifestError
from mlscope.manifest import ModelManifest, mark_untrusted, parse_manifest

__all__ = ["delete_manifest", "load_remote", "load_remote_entries", "manifest_key",
           "publish_manifest", "publish_manifests"]

_KEY_UNSAFE = re.compile(r"[^-/_=.a-zA-Z0-9]")
REMOTE_ROOT = Path("/nonexistent/mlscope-bus")
"""Stand-in manifest directory of remote entries: relative assets never resolve."""


def manifest_key(manifest: ModelManifest) -> str:
    """``<name>.<version>.<framework>`` with characters KV keys forbid replaced by ``_``."""
    raw = f"{manifest.name}.{manifest.version}.{manifest.framework.name}"
    return _KEY_UNSAFE.sub("_", raw).strip(".")


async def publish_manifest(bus: Bus, manifest: ModelManifest) -> str:
    """Put one manifest; returns its key."""
    kv = await bus.kv(names.MODELS_BUCKET)
    key = manifest_key(manifest)
    payload = json.dumps(manifest.model_dump(mode="json"), sort_keys=True).encode()
    try:
        await kv.put(key, payload)
    except nats.errors.Error as exc:
        raise BusError(f"cannot publish manifest {key}: {exc!r}", key=key) from exc
    return key


async def publish_manifests(bus: Bus, catalog: Catalog) -> list[str]:
    """Publish every model manifest of ``catalog``; returns the keys, in order."""
    return [await publish_manifest(bus, e.manifest) for e in catalog.entries]


async def delete_manifest(bus: Bus, manifest: ModelManifest) -> None:
    kv = await bus.kv(names.MODELS_BUCKET)
    try:
        await kv.delete(manifest_key(manifest))
    except nats.errors.Error as exc:
        raise BusError(f"cannot delete manifest {manifest_key(manifest)}: {exc!r}") from exc


async def load_remote(bus: Bus) -> list[ModelManifest]:
    """Every manifest in the bucket, validated and marked untrusted (sorted by key).

    A value that does not validate raises ManifestError naming its key as the file.
    """
    kv = await bus.kv(names.MODELS_BUCKET)
    try:
        keys = sorted(await kv.keys())
    except nats.js.errors.NoKeysError:
        return []
    except nats.errors.Error as exc:
        raise BusError(f"cannot list {names.MODELS_BUCKET}: {exc!r}") from exc
    out: list[ModelManifest] = []
    for key in keys:
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue  # deleted between keys() and get()
        except nats.errors.Error as exc:
            raise BusError(f"cannot read manifest {key}: {exc!r}", key=key) from exc
        where = f"{names.MODELS_BUCKET}/{key}"
        try:
            data = json.loads(entry.value or b"")
        except ValueError as exc:
            raise ManifestError(f"not valid JSON: {exc}", file=where) from exc
        manifest = parse_manifest(data, file=where)
        if not isinstance(manifest, ModelManifest):
            raise ManifestError("only model manifests belong in the models bucket",
                                file=where, field="kind")
        out.append(mark_untrusted(manifest))
    return out


async def load_remote_entries(bus: Bus) -> list[Entry]:
    """:func:`load_remote` as catalog entries (``trusted=False``)."""
    return [Entry(m, REMOTE_ROOT / f"{manifest_key(m)}.yaml", trusted=False)
            for m in await load_remote(bus)]
