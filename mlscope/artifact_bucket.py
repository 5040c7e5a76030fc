"""The artifact repository on the bus: built zoo models in a JetStream object store.

The paper's artifact storage server. A model is built once (``mlscope zoo build``) and
pushed (``mlscope artifacts push``, ``mlscope zoo build --push``, and ``mlscope up``
for what its data dir holds); an agent on another machine whose data dir lacks it
fetches it, verifies every file by sha256 and serves it. So every agent of a
deployment runs the same bytes, whatever CPU each one would have built them on.

Bucket ``mlscope_artifacts`` (:data:`mlscope.names.ARTIFACTS_BUCKET`), objects::

    <name>/<version>/<file>          every regular file the build lock lists
    <name>/<version>/mlscope.lock    the build lock (JSON), put last

A fetch reads the lock first, downloads each file into a scratch directory beside
``<zoo_dir>/<name>/<version>``, checks each file's sha256 against the lock and each
artifact's (a SavedModel directory's tree hash too), writes the lock with
``origin.by = "bus"`` and only then renames the directory into place. A fetch never
replaces a model the data dir already holds with a lock: a local build stays what that
agent serves, and its hashes travel with every evaluation it runs.

Any client that may put objects may also publish an object's meta and chunks by hand,
so a fetch trusts no meta: every object is read with :func:`mlscope.objects.read`.
"""

from __future__ import annotations

import json
import shutil
import stat
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import anyio
from nats.js.object_store import ObjectStore

from mlscope import names, objects
from mlscope.artifacts import check_relative, safe_join, zoo_coordinates
from mlscope.buildlock import LOCK_NAME, BuildLock
from mlscope.bus import Bus, bus_errors, if_found
from mlscope.errors import ArtifactError, BusError, ChecksumMismatch
from mlscope.hashing import sha256_path
from mlscope.provision import find_object_store, object_store

__all__ = ["ensure_bucket", "fetch", "open_bucket", "push", "push_files", "pushed_models"]

Log = Callable[[str], None]
_DESCRIPTION = "built zoo models (mlscope artifacts push)"
LOCK_MAX_BYTES = 4 << 20
"""Largest build lock a fetch reads (a lock lists a model's files and their hashes)."""
DEFAULT_MAX_FILE_BYTES = 4 << 30
"""Largest file a fetch takes unless told (the agent passes MLSCOPE_MAX_ARTIFACT_BYTES)."""


def _quiet(_message: str) -> None:
    return None


async def open_bucket(bus: Bus) -> ObjectStore | None:
    """The artifact bucket; None when nobody pushed anything yet."""
    return await find_object_store(bus, names.ARTIFACTS_BUCKET)


async def ensure_bucket(bus: Bus, *, replicas: int = 1) -> ObjectStore:
    """The artifact bucket, created when missing."""
    return await object_store(
        bus, names.ARTIFACTS_BUCKET, description=_DESCRIPTION, replicas=replicas
    )


def _object(name: str, version: str, relative: str) -> str:
    return f"{name}/{version}/{relative}"


@contextmanager
def _fetching(what: str, **fields: Any) -> Iterator[None]:
    """A fetch's bus failures (a meta nats-py cannot parse among them) as the
    ArtifactError of the object they hit: the agent refuses that model, not the rest."""
    try:
        yield
    except BusError as exc:
        raise ArtifactError(f"cannot fetch {what}: {exc.message}"[:300], **fields) from exc


async def _remote_lock(bus: Bus, obs: ObjectStore, name: str, version: str) -> BuildLock | None:
    where = f"{names.ARTIFACTS_BUCKET}/{_object(name, version, LOCK_NAME)}"
    data = bytearray()

    async def keep(chunk: bytes) -> None:
        data.extend(chunk)

    over = f"the {LOCK_MAX_BYTES} bytes a build lock may have"
    bucket, obj = names.ARTIFACTS_BUCKET, _object(name, version, LOCK_NAME)
    found = await objects.read(
        bus, obs, bucket, obj, keep, cap=LOCK_MAX_BYTES, over=over, path=where
    )
    if found is None:
        return None
    try:
        doc = json.loads(bytes(data))
    except (ValueError, RecursionError) as exc:
        raise ArtifactError(f"invalid build lock {where}: {exc!r}"[:300], path=where) from exc
    return BuildLock.from_json(doc, where=where)


def _checked_layout(lock: BuildLock, where: str) -> None:
    """The lock's files are distinct relative paths inside the model's directory (none
    empty, none both a file and a directory), and each artifact is one of them or a
    directory of them: nothing a fetch writes or hashes is outside its scratch
    directory, or missing from it."""
    files = {check_relative(relative) for relative in lock.files}
    if len(files) != len(lock.files) or any(str(f) in ("", ".") for f in files):
        raise ArtifactError(f"build lock {where} names one file twice, or none", path=where)
    dirs = {parent for f in files for parent in f.parents if str(parent) != "."}
    if files & dirs:
        raise ArtifactError(f"build lock {where} names a file and a directory alike", path=where)
    for artifact in lock.artifacts:
        if check_relative(artifact) not in files | dirs:
            raise ArtifactError(
                f"build lock {where} names an artifact ({artifact[:80]!r}) none of its files make",
                path=where,
            )


def _local_build(model_dir: Path) -> BuildLock:
    """The build lock of ``model_dir``, each file it lists checked: a regular file (a
    FIFO would block the hash forever; a directory or a device is no build output)
    whose sha256 is still the lock's. Every failure, the disk's too, is an ArtifactError."""
    if (model_dir / LOCK_NAME).exists() and not (model_dir / LOCK_NAME).is_file():
        raise ArtifactError(f"{model_dir / LOCK_NAME} is not a regular file", path=str(model_dir))
    lock = BuildLock.read(model_dir)
    if lock is None:
        raise ArtifactError(
            f"{model_dir} has no build lock: build it first (`mlscope zoo build`)",
            path=str(model_dir),
        )
    for relative, sha in sorted(lock.files.items()):
        path = safe_join(model_dir, relative)
        try:
            if not stat.S_ISREG(path.stat().st_mode):
                raise ArtifactError(
                    f"{path} is not a regular file; run `mlscope zoo build --only "
                    f"{lock.model} --force`",
                    path=str(path),
                )
            actual = sha256_path(path)
        except OSError as exc:
            raise ArtifactError(
                f"cannot read {path} of {lock.model}: {exc.strerror or exc!r}", path=str(path)
            ) from exc
        if actual != sha:
            raise ChecksumMismatch(
                f"{path} changed since its build lock; "
                f"run `mlscope zoo build --only {lock.model} --force`",
                path=str(path),
                expected=sha,
            )
    return lock


async def push(
    bus: Bus, model_dir: Path, *, log: Log = _quiet, replicas: int = 1, replace: bool = True
) -> bool:
    """Put one built model (a directory with a build lock) into the bucket.

    Files the bucket already holds with the same sha256 are not sent again; the lock
    goes last, so a reader never sees a lock whose files are not all there. Returns
    False when the bucket already had exactly this build. A model directory that does
    not match its lock (a file gone, changed, or not a regular file) is an ArtifactError;
    so is, unless ``replace``, other bytes under the same name and version.
    """
    lock = await anyio.to_thread.run_sync(_local_build, model_dir)
    return await _send(bus, model_dir, lock, log=log, replicas=replicas, replace=replace)


async def _send(
    bus: Bus, model_dir: Path, lock: BuildLock, *, log: Log, replicas: int, replace: bool
) -> bool:
    """Put ``model_dir``'s files, which ``lock`` lists with their sha256, and then the
    lock into the bucket (see :func:`push`)."""
    obs = await ensure_bucket(bus, replicas=replicas)
    remote = await _remote_lock(bus, obs, lock.model, lock.version)
    if remote is not None and remote.same_bytes(lock):
        log(f"{lock.model} {lock.version}: already in the artifact bucket")
        return False
    if remote is not None and not replace:
        raise ArtifactError(
            f"the artifact bucket holds other files as {lock.model} {lock.version}: "
            "give the model a new version",
            model=lock.model,
            version=lock.version,
        )
    with bus_errors(f"cannot push {lock.model} {lock.version}"):
        for relative, sha in sorted(lock.files.items()):
            name = _object(lock.model, lock.version, relative)
            info = await if_found(obs.get_info(name))
            if (None if info is None else objects.digest_hex(info.digest)) != sha:
                await _put_file(obs, name, model_dir / relative)
        await obs.put(
            _object(lock.model, lock.version, LOCK_NAME),
            json.dumps(lock.to_json(), sort_keys=True).encode(),
        )
    log(f"{lock.model} {lock.version}: pushed {len(lock.files)} files to the artifact bucket")
    return True


async def push_files(
    bus: Bus,
    source: Path,
    *,
    name: str,
    version: str,
    artifacts: list[str],
    origin: dict[str, Any],
    check: Callable[[BuildLock], None] | None = None,
    log: Log = _quiet,
    replicas: int = 1,
) -> BuildLock:
    """Put a model's own files (``artifacts``: top-level files or directories under
    ``source``, such as a manifest's graph and labels) into the bucket as
    ``zoo://name/version``, with a build lock made of them; its lock. The files are
    copied to a scratch directory first and hashed there once, so ``source`` gets no
    lock and a file changed meanwhile is not pushed under an old hash. ``check`` sees
    that lock before anything is sent (a caller's pinned checksums; it raises to stop
    the push). Other bytes already in the bucket under that name and version are an
    ArtifactError (a new version publishes new bytes)."""
    zoo_coordinates(f"zoo://{name}/{version}")
    with tempfile.TemporaryDirectory(prefix="mlscope-publish-") as tmp:
        root = Path(tmp)

        def stage() -> BuildLock:
            for relative in artifacts:
                src = safe_join(source, relative)
                try:
                    if src.is_dir():
                        shutil.copytree(src, root / relative, symlinks=False)
                    else:
                        shutil.copyfile(src, root / relative)
                except OSError as exc:
                    raise ArtifactError(
                        f"cannot read {src}: {exc.strerror or exc!r}", path=str(src)
                    ) from exc
            lock = BuildLock.of(
                root, model=name, version=version, artifacts=artifacts, origin=origin
            )
            lock.write(root)
            return lock

        lock = await anyio.to_thread.run_sync(stage)
        if check is not None:
            check(lock)
        # the scratch directory is this call's own: its files are the lock's
        await _send(bus, root, lock, log=log, replicas=replicas, replace=False)
    return lock


async def _put_file(obs: ObjectStore, name: str, path: Path) -> None:
    try:
        fh = path.open("rb")
    except OSError as exc:  # gone since it was hashed
        raise ArtifactError(f"cannot read {path}: {exc.strerror or exc!r}", path=str(path)) from exc
    with fh:
        await obs.put(name, fh)


async def fetch(
    bus: Bus,
    zoo_dir: Path,
    name: str,
    version: str,
    *,
    log: Log = _quiet,
    max_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> BuildLock | None:
    """Fetch one model into ``<zoo_dir>/<name>/<version>`` unless it is there already.

    Returns the lock now in place, or None when neither the data dir nor the bucket
    has the model. A file whose bytes differ from the lock fails the whole fetch
    (ChecksumMismatch) and nothing is put in place. The bucket is not trusted: a lock
    for another model, a layout that reaches outside the model's directory, an object
    whose meta is a link or lies, a file over ``max_bytes`` or anything else that
    cannot be fetched is an ArtifactError naming the model and the file.
    """
    zoo_coordinates(f"zoo://{name}/{version}")  # one directory two levels below zoo_dir
    target = safe_join(zoo_dir, f"{name}/{version}")
    local = BuildLock.read(target)
    if local is not None:
        return local
    obs = await open_bucket(bus)
    if obs is None:
        return None
    where = f"{names.ARTIFACTS_BUCKET}/{_object(name, version, LOCK_NAME)}"
    with _fetching(f"the build lock of {name} {version}", model=name, path=where):
        lock = await _remote_lock(bus, obs, name, version)
    if lock is None:
        return None
    if (lock.model, lock.version) != (name, version):
        raise ArtifactError(
            f"build lock {where} is for {lock.model[:80]} {lock.version[:40]}", path=where
        )
    _checked_layout(lock, where)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.parent / f".{version}.fetch-{uuid.uuid4().hex[:8]}"
    try:
        await _download(bus, obs, lock, scratch, max_bytes)
        fetched = BuildLock(
            model=lock.model,
            version=lock.version,
            artifacts=lock.artifacts,
            files=lock.files,
            origin={**lock.origin, "by": "bus"},
            behaviour=lock.behaviour,
        )
        fetched.write(scratch)
        if BuildLock.read(target) is None:  # another agent of this data dir may have won
            shutil.rmtree(target, ignore_errors=True)
            scratch.rename(target)
    except (OSError, RecursionError) as exc:  # the disk, or what the checks let through
        raise ArtifactError(f"cannot fetch {name} {version}: {exc!r}"[:300], path=where) from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log(f"{name} {version}: fetched {len(lock.files)} files from the artifact bucket")
    return BuildLock.read(target)


async def _download(
    bus: Bus, obs: ObjectStore, lock: BuildLock, scratch: Path, max_bytes: int
) -> None:
    """Every file of ``lock`` into ``scratch``, each hashed as it streams and held to
    the lock's sha256; then each artifact's (a directory's tree hash)."""
    over = f"the {max_bytes} an artifact may have (MLSCOPE_MAX_ARTIFACT_BYTES)"
    for relative, sha in sorted(lock.files.items()):
        path = safe_join(scratch, relative)
        path.parent.mkdir(parents=True, exist_ok=True)
        name = _object(lock.model, lock.version, relative)
        with (
            path.open("wb") as fh,
            _fetching(
                f"{relative} of {lock.model} {lock.version}", model=lock.model, path=relative
            ),
        ):
            sink = partial(_write, fh)
            actual = await objects.read(
                bus,
                obs,
                names.ARTIFACTS_BUCKET,
                name,
                sink,
                cap=max_bytes,
                over=over,
                model=lock.model,
                path=relative,
            )
        if actual is None:
            raise ArtifactError(
                f"the artifact bucket lacks {relative} of {lock.model} {lock.version}",
                model=lock.model,
                path=relative,
            )
        _check(lock, relative, sha, actual)
    for artifact, sha in lock.artifacts.items():
        actual = await anyio.to_thread.run_sync(sha256_path, safe_join(scratch, artifact))
        _check(lock, artifact, sha, actual)


async def _write(fh: BinaryIO, chunk: bytes) -> None:
    await anyio.to_thread.run_sync(fh.write, chunk)


def _check(lock: BuildLock, relative: str, expected: str, actual: str) -> None:
    if actual != expected:
        raise ChecksumMismatch(
            f"{lock.model} {lock.version}: fetched {relative} has "
            f"sha256 {actual}, the lock says {expected}",
            model=lock.model,
            path=relative,
            expected=expected,
            actual=actual,
        )


async def pushed_models(bus: Bus) -> list[tuple[str, str]]:
    """(name, version) of every model whose lock is in the bucket."""
    obs = await open_bucket(bus)
    if obs is None:
        return []
    with bus_errors("cannot list the artifact bucket"):
        infos = await if_found(obs.list(ignore_deletes=True))
    if infos is None:
        return []
    out = []
    for info in infos:
        parts = (info.name or "").split("/")
        if len(parts) == 3 and parts[2] == LOCK_NAME:
            out.append((parts[0], parts[1]))
    return sorted(out)
