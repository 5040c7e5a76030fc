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
so a fetch trusts no meta: it reads each object's meta once, refuses links, deleted
objects and metas without a chunk subject or a digest, and reads the chunks itself
(not with nats-py's ``ObjectStore.get``, which follows links into memory and reads
chunks until the stream runs dry), holding them to that one meta: no more bytes than
it declares (nor than the caller's limit), no chunk late by more than
:data:`CHUNK_IDLE_S`, its digest at the end.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import stat
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import anyio
from nats.aio.msg import Msg
from nats.js.api import ObjectInfo
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE, ObjectStore

from mlscope import names
from mlscope.artifacts import check_relative, safe_join, zoo_coordinates
from mlscope.buildlock import LOCK_NAME, BuildLock
from mlscope.bus import Bus, bus_errors, find_object_store, if_found, next_msg, object_store
from mlscope.errors import ArtifactError, BusError, ChecksumMismatch
from mlscope.hashing import sha256_path

__all__ = ["ensure_bucket", "fetch", "open_bucket", "push", "pushed_models"]

Log = Callable[[str], None]
Sink = Callable[[bytes], Awaitable[object]]
_DESCRIPTION = "built zoo models (mlscope artifacts push)"
LOCK_MAX_BYTES = 4 << 20
"""Largest build lock a fetch reads (a lock lists a model's files and their hashes)."""
DEFAULT_MAX_FILE_BYTES = 4 << 30
"""Largest file a fetch takes unless told (the agent passes MLSCOPE_MAX_ARTIFACT_BYTES)."""
CHUNK_IDLE_S = 5.0
"""Longest wait for an object's next chunk. A writer puts the chunks before the meta,
so a healthy server delivers each one in milliseconds; a meta whose chunks are gone or
never came is refused after this long instead of being awaited forever (an agent
fetches its models before it serves anything)."""
FETCH_GRACE_S = 30.0
"""Time one object's fetch has on top of what its size warrants (:data:`FETCH_MIN_RATE`)."""
FETCH_MIN_RATE = 1 << 20
"""Bytes per second below which one object's fetch is given up: its deadline is
``FETCH_GRACE_S + size / FETCH_MIN_RATE``, so chunks trickled onto the subject just
inside :data:`CHUNK_IDLE_S` of each other cannot hold an agent's start for hours."""
_NUID = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A chunk subject's last token: never a wildcard, never a dot (another subject)."""
_DIGEST = "sha-256="


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


def _digest(digest: object) -> bytes | None:
    """nats' ``SHA-256=<base64url>`` digest as its 32 bytes; None when it is not one."""
    if not isinstance(digest, str) or not digest.lower().startswith(_DIGEST):
        return None
    try:
        raw = base64.urlsafe_b64decode(digest[len(_DIGEST) :])
    except ValueError:  # binascii.Error among them
        return None
    return raw if len(raw) == hashlib.sha256().digest_size else None


def _hex(digest: str | None) -> str | None:
    """nats' ``SHA-256=<base64url>`` digest as lowercase hex."""
    raw = _digest(digest)
    return None if raw is None else raw.hex()


@dataclass(frozen=True)
class _Meta:
    """What the one read of an object's meta promised; its chunks are held to it."""

    where: str
    nuid: str
    size: int
    chunks: int
    digest: bytes


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _promised(info: ObjectInfo, where: str, *, cap: int, over: str, **fields: Any) -> _Meta:
    """The meta as a fetch may follow it: an ArtifactError for a deleted object, a link
    (to any bucket: a fetch reads this bucket only), a chunk subject that is not one
    nuid, a size or chunk count that is not a count, no digest, or a size over ``cap``."""
    size, chunks, digest = _count(info.size), _count(info.chunks), _digest(info.digest)
    if info.deleted:
        problem = "is deleted"
    elif info.is_link():
        problem = "is a link to another object (a fetch follows none)"
    elif not isinstance(info.nuid, str) or not _NUID.fullmatch(info.nuid):
        problem = f"has no valid chunk subject (nuid {str(info.nuid)[:40]!r})"
    elif size is None or chunks is None or (size > 0) != (chunks > 0):
        problem = f"has a malformed meta (size {info.size!r:.40}, chunks {info.chunks!r:.40})"
    elif digest is None:
        problem = f"has no valid SHA-256 digest ({str(info.digest)[:60]!r})"
    elif size > cap:
        problem = f"is {size} bytes, over {over}"
    else:
        return _Meta(where=where, nuid=info.nuid, size=size, chunks=chunks, digest=digest)
    raise ArtifactError(f"{where} {problem}", **fields)


async def _read(
    bus: Bus, obs: ObjectStore, name: str, sink: Sink, *, cap: int, over: str, **fields: Any
) -> str | None:
    """Stream object ``name`` into ``sink``; its sha256 (hex), or None when the bucket
    lacks it. At most ``min(cap, the size its meta declares)`` bytes reach ``sink``."""
    where = f"{names.ARTIFACTS_BUCKET}/{name}"
    with bus_errors(f"cannot read {where}", **fields):
        info = await if_found(obs.get_info(name))
    if info is None:
        return None
    meta = _promised(info, where, cap=cap, over=over, **fields)
    sha = hashlib.sha256()

    async def hashed(chunk: bytes) -> None:
        sha.update(chunk)
        await sink(chunk)

    deadline = FETCH_GRACE_S + meta.size / FETCH_MIN_RATE
    try:
        with anyio.fail_after(deadline):
            await _chunks(bus, meta, hashed, **fields)
    except TimeoutError as exc:
        raise ArtifactError(f"{where} was not read within {deadline:.0f} s", **fields) from exc
    if sha.digest() != meta.digest:
        raise ArtifactError(f"{where}: its chunks do not match its meta's digest", **fields)
    return sha.hexdigest()


async def _chunks(bus: Bus, meta: _Meta, sink: Sink, **fields: Any) -> None:
    """The object's chunks, in order, into ``sink``, up to the size the meta declares;
    a chunk past it, past the chunk count, or not there within :data:`CHUNK_IDLE_S` is
    an ArtifactError."""
    if meta.size == 0:
        return
    bucket = names.ARTIFACTS_BUCKET
    subject = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=meta.nuid)
    with bus_errors(f"cannot read {meta.where}", **fields):
        sub = await bus.js.subscribe(
            subject, stream=OBJ_STREAM_TEMPLATE.format(bucket=bucket), ordered_consumer=True
        )
    try:
        got = count = 0
        while got < meta.size:
            msg = await next_msg(sub, CHUNK_IDLE_S)
            count += 1
            problem = _chunk_problem(meta, msg, got, count)
            if problem is not None or msg is None:
                raise ArtifactError(f"{meta.where} {problem}", **fields)
            got += len(msg.data)
            await sink(msg.data)
    finally:
        with (  # a failure here means the connection, and the consumer with it, is gone
            anyio.CancelScope(shield=True),
            suppress(BusError),
            bus_errors(f"cannot unsubscribe from {subject}"),
        ):
            await sub.unsubscribe()


def _chunk_problem(meta: _Meta, msg: Msg | None, got: int, count: int) -> str | None:
    """Why the chunk ``msg`` (None: none came) breaks the meta's promise, if it does."""
    if msg is None:
        return f"sent no chunk within {CHUNK_IDLE_S:g} s after {got} of {meta.size} bytes"
    size = got + len(msg.data)
    if size > meta.size or count > meta.chunks:
        return f"has more than the {meta.size} bytes in {meta.chunks} chunks its meta declares"
    if size < meta.size and (count == meta.chunks or msg.metadata.num_pending == 0):
        return f"has {size} of the {meta.size} bytes its meta declares"
    return None


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
    found = await _read(
        bus, obs, _object(name, version, LOCK_NAME), keep, cap=LOCK_MAX_BYTES, over=over, path=where
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


async def push(bus: Bus, model_dir: Path, *, log: Log = _quiet, replicas: int = 1) -> bool:
    """Put one built model (a directory with a build lock) into the bucket.

    Files the bucket already holds with the same sha256 are not sent again; the lock
    goes last, so a reader never sees a lock whose files are not all there. Returns
    False when the bucket already had exactly this build. A model directory that does
    not match its lock (a file gone, changed, or not a regular file) is an ArtifactError.
    """
    lock = await anyio.to_thread.run_sync(_local_build, model_dir)
    obs = await ensure_bucket(bus, replicas=replicas)
    remote = await _remote_lock(bus, obs, lock.model, lock.version)
    if remote is not None and remote.same_bytes(lock):
        log(f"{lock.model} {lock.version}: already in the artifact bucket")
        return False
    with bus_errors(f"cannot push {lock.model} {lock.version}"):
        for relative, sha in sorted(lock.files.items()):
            name = _object(lock.model, lock.version, relative)
            info = await if_found(obs.get_info(name))
            if (None if info is None else _hex(info.digest)) != sha:
                await _put_file(obs, name, model_dir / relative)
        await obs.put(
            _object(lock.model, lock.version, LOCK_NAME),
            json.dumps(lock.to_json(), sort_keys=True).encode(),
        )
    log(f"{lock.model} {lock.version}: pushed {len(lock.files)} files to the artifact bucket")
    return True


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
            actual = await _read(
                bus, obs, name, sink, cap=max_bytes, over=over, model=lock.model, path=relative
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
