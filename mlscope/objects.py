"""Reading one object of a JetStream object store that other clients may write.

nats-py's ``ObjectStore.get`` trusts the object's meta: it follows a link into memory
(to any bucket, building the whole object with repeated concatenation), and reads
chunks until the stream runs dry, so a meta whose chunks never come hangs it forever
and one that understates its size writes whatever the chunk subject holds. Any client
that may put objects may also publish a meta and chunks by hand. :func:`read` reads
the meta once, refuses links, deleted objects and metas without a chunk subject or a
digest, then reads the chunks itself, holding them to that one meta: no more bytes
than it declares (nor than the caller's cap), no chunk late by more than
:data:`CHUNK_IDLE_S`, the whole object within a deadline that grows with its size,
its digest checked as the bytes land.
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import anyio
from nats.aio.msg import Msg
from nats.js.api import ObjectInfo
from nats.js.object_store import OBJ_CHUNKS_PRE_TEMPLATE, OBJ_STREAM_TEMPLATE, ObjectStore

from mlscope.bus import Bus, bus_errors, if_found, next_msg
from mlscope.errors import ArtifactError, BusError

__all__ = ["CHUNK_IDLE_S", "FETCH_GRACE_S", "FETCH_MIN_RATE", "Sink", "digest_hex", "read"]

Sink = Callable[[bytes], Awaitable[object]]
"""Where an object's bytes go, chunk by chunk."""
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


def _digest(digest: object) -> bytes | None:
    """nats' ``SHA-256=<base64url>`` digest as its 32 bytes; None when it is not one."""
    if not isinstance(digest, str) or not digest.lower().startswith(_DIGEST):
        return None
    try:
        raw = base64.urlsafe_b64decode(digest[len(_DIGEST) :])
    except ValueError:  # binascii.Error among them
        return None
    return raw if len(raw) == hashlib.sha256().digest_size else None


def digest_hex(digest: str | None) -> str | None:
    """nats' ``SHA-256=<base64url>`` digest as lowercase hex; None when it is not one."""
    raw = _digest(digest)
    return None if raw is None else raw.hex()


@dataclass(frozen=True)
class _Meta:
    """What the one read of an object's meta promised; its chunks are held to it."""

    bucket: str
    where: str
    nuid: str
    size: int
    chunks: int
    digest: bytes


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _promised(
    info: ObjectInfo, bucket: str, where: str, *, cap: int, over: str, **fields: Any
) -> _Meta:
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
        return _Meta(bucket, where, info.nuid, size, chunks, digest)
    raise ArtifactError(f"{where} {problem}", **fields)


async def read(
    bus: Bus,
    obs: ObjectStore,
    bucket: str,
    name: str,
    sink: Sink,
    *,
    cap: int,
    over: str,
    **fields: Any,
) -> str | None:
    """Stream object ``name`` of ``obs`` (the object store ``bucket``) into ``sink``;
    its sha256 (hex), or None when the bucket lacks it. At most ``min(cap, the size its
    meta declares)`` bytes reach ``sink``; ``over`` says what ``cap`` is, and
    ``fields`` go into every ArtifactError."""
    where = f"{bucket}/{name}"
    with bus_errors(f"cannot read {where}", **fields):
        info = await if_found(obs.get_info(name))
    if info is None:
        return None
    meta = _promised(info, bucket, where, cap=cap, over=over, **fields)
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
    bucket = meta.bucket
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
