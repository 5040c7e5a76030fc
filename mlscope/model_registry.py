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
import logging
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskStatus

from mlscope import names
from mlscope.bounded import load_json
from mlscope.bus import Bus, bus_errors, if_found
from mlscope.catalog import Catalog, Entry
from mlscope.errors import ManifestError
from mlscope.kvread import BucketWatch, bucket_keys
from mlscope.logbudget import LogBudget
from mlscope.manifest import ModelManifest, mark_untrusted
from mlscope.manifest_files import parse_manifest
from mlscope.serving import as_error

__all__ = [
    "MAX_REMOTE_MANIFESTS",
    "ManifestWatcher",
    "delete_manifest",
    "key_for",
    "load_remote",
    "load_remote_entries",
    "manifest_key",
    "publish_manifest",
    "publish_manifests",
]

_KEY_UNSAFE = re.compile(r"[^-/_=.a-zA-Z0-9]")
log = logging.getLogger("mlscope.models")
MAX_REMOTE_MANIFESTS = 1000
"""Most manifests a :class:`ManifestWatcher` holds: every agent and the server keep
each one, and an agent's registry entry lists each model it serves. Past it, a
manifest is rejected until others are removed and it is published again."""
REMOTE_ROOT = Path("/nonexistent/mlscope-bus")
"""Stand-in manifest directory of remote entries: relative assets never resolve."""


def manifest_key(manifest: ModelManifest) -> str:
    """``<name>.<version>.<framework>`` with characters KV keys forbid replaced by ``_``."""
    return key_for(manifest.name, manifest.version, manifest.framework.name)


def key_for(name: str, version: str, framework: str) -> str:
    return _KEY_UNSAFE.sub("_", f"{name}.{version}.{framework}").strip(".")


async def publish_manifest(bus: Bus, manifest: ModelManifest) -> str:
    """Put one manifest; returns its key."""
    kv = await bus.kv(names.MODELS_BUCKET)
    key = manifest_key(manifest)
    payload = json.dumps(manifest.model_dump(mode="json"), sort_keys=True).encode()
    with bus_errors(f"cannot publish manifest {key}", key=key):
        await kv.put(key, payload)
    return key


async def publish_manifests(bus: Bus, catalog: Catalog) -> list[str]:
    """Publish every model manifest of ``catalog``; returns the keys, in order."""
    return [await publish_manifest(bus, e.manifest) for e in catalog.entries]


async def delete_manifest(bus: Bus, manifest: ModelManifest | str) -> bool:
    """Remove a manifest (or a key); False when there was none to remove."""
    key = manifest if isinstance(manifest, str) else manifest_key(manifest)
    kv = await bus.kv(names.MODELS_BUCKET)
    with bus_errors(f"cannot delete manifest {key}", key=key):
        if await if_found(kv.get(key)) is None:
            return False
        await kv.delete(key)
    return True


async def load_remote(bus: Bus) -> list[ModelManifest]:
    """Every manifest in the bucket, validated and marked untrusted (sorted by key).

    A value that does not validate raises ManifestError naming its key as the file.
    """
    kv = await bus.kv(names.MODELS_BUCKET)
    with bus_errors(f"cannot list {names.MODELS_BUCKET}"):
        keys = await bucket_keys(bus, names.MODELS_BUCKET)
    out: list[ModelManifest] = []
    for key in keys:
        with bus_errors(f"cannot read manifest {key}", key=key):
            entry = await if_found(kv.get(key))
        if entry is not None:  # else removed (a delete marker), or since the listing
            out.append(_parse(key, entry.value))
    return out


def _parse(key: str, value: bytes | None) -> ModelManifest:
    """One bucket value as a validated, untrusted model manifest (errors name the key)."""
    where = f"{names.MODELS_BUCKET}/{key}"
    try:
        data = load_json(value or b"", file=where)  # size, depth and encoding bounded
        manifest = parse_manifest(data, file=where)
    except ManifestError:
        raise
    except Exception as exc:  # whatever an untrusted value makes the validator do
        raise ManifestError(as_error(exc).message, file=where) from exc
    if not isinstance(manifest, ModelManifest):
        raise ManifestError(
            "only model manifests belong in the models bucket", file=where, field="kind"
        )
    if key != manifest_key(manifest):  # else one model could hold several keys
        raise ManifestError(
            f"a manifest of {manifest.key} belongs under the key {manifest_key(manifest)}, "
            "not under this one",
            file=where,
            field="name",
        )
    return mark_untrusted(manifest)


async def load_remote_entries(bus: Bus) -> list[Entry]:
    """:func:`load_remote` as catalog entries (``trusted=False``)."""
    return [remote_entry(m) for m in await load_remote(bus)]


def remote_entry(m: ModelManifest) -> Entry:
    """A catalog entry for a manifest from the bus: untrusted, no local directory."""
    return Entry(m, REMOTE_ROOT / f"{manifest_key(m)}.yaml", trusted=False)


class ManifestWatcher:
    """A live view of the models bucket: untrusted catalog entries, kept up to date.

    ``run`` watches the bucket (last value per key, then every change); it reports
    started once the initial snapshot is in, so a process that starts it first never
    acts on a half-read registry. After that, ``on_change`` is awaited after each change.
    A value that does not validate, that is stored under a key other than its
    manifest's (:func:`manifest_key`), or that arrives while :data:`MAX_REMOTE_MANIFESTS`
    are held, is kept out of ``entries`` and recorded in ``rejected`` with its error
    (at most as many again are recorded): a bad manifest on the bus never stops the
    watcher.
    """

    def __init__(
        self,
        bus: Bus,
        on_change: Callable[[], Awaitable[None]] | None = None,
        *,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.bus, self.on_change = bus, on_change
        self._log = log or log_warning
        self._log_budget = LogBudget()
        self.entries: dict[str, Entry] = {}
        self.rejected: dict[str, ManifestError] = {}

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with BucketWatch(self.bus, names.MODELS_BUCKET) as watch:
            async for update in watch:
                if update is None:  # the initial snapshot is complete
                    task_status.started()
                    continue
                self._apply(update.key, update.value, deleted=update.operation is not None)
                if watch.caught_up and self.on_change is not None:
                    try:
                        await self.on_change()
                    except Exception as exc:  # one bad change never stops the watch
                        self.log(
                            f"reacting to a change of {update.key} failed: {as_error(exc).message}"
                        )

    def _apply(self, key: str, value: bytes | None, *, deleted: bool) -> None:
        self.entries.pop(key, None)
        self.rejected.pop(key, None)
        if deleted:
            return
        try:
            if len(self.entries) >= MAX_REMOTE_MANIFESTS:
                raise ManifestError(
                    f"the models bucket holds more than {MAX_REMOTE_MANIFESTS} manifests: "
                    "remove some, then publish this one again",
                    file=f"{names.MODELS_BUCKET}/{key}",
                )
            m = _parse(key, value)
        except ManifestError as exc:
            if len(self.rejected) < MAX_REMOTE_MANIFESTS:
                self.rejected[key] = exc
            self.log(f"ignoring a manifest on the bus: {exc}")
            return
        self.entries[key] = remote_entry(m)

    def log(self, line: str) -> None:
        """One line about the bucket, under the watcher's budget: a flood of bad
        manifests is kept out in full but logged briefly."""
        more = self._log_budget.take()
        if more is not None:
            self._log(line + more)

    @classmethod
    async def snapshot(cls, bus: Bus, **kw: Any) -> ManifestWatcher:
        """The bucket as it is now (valid entries and rejected keys), without watching on."""
        watcher = cls(bus, **kw)
        async with anyio.create_task_group() as tg:
            await tg.start(watcher.run)
            tg.cancel_scope.cancel()
        return watcher

    def catalog(self, local: Catalog) -> Catalog:
        """``local`` plus the bus's manifests (a local manifest wins on the same key)."""
        return local.merged(self.entries.values())


def log_warning(line: str) -> None:
    log.warning("%s", line)
