"""The NATS boundary: connecting, provisioning streams and buckets, typed requests.

nats-py exceptions are translated into :class:`mlscope.errors.BusError` here and
nowhere else.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any, TypeVar

import anyio
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.kv import KeyValue
from pydantic import BaseModel

from mlscope import codec, names
from mlscope.errors import BusError, MLScopeError, error_from_wire
from mlscope.settings import Settings

__all__ = [
    "AGENT_TTL_S",
    "HEARTBEAT_S",
    "Bus",
    "connect",
    "ensure_infrastructure",
    "error_reply",
    "request",
]

HEARTBEAT_S = 1.0
"""How often an agent refreshes its registry entry."""
AGENT_TTL_S = 5.0
"""Registry entries expire this long after their last heartbeat (SIGKILL bound)."""
TRACES_MAX_AGE_S = 7 * 24 * 3600.0
M = TypeVar("M", bound=BaseModel)


class Bus:
    """A connected client with its JetStream context and the registry buckets."""

    def __init__(self, nc: Client, js: JetStreamContext) -> None:
        self.nc = nc
        self.js = js
        self._kv: dict[str, KeyValue] = {}

    async def kv(self, bucket: str) -> KeyValue:
        if bucket not in self._kv:
            try:
                self._kv[bucket] = await self.js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError as exc:
                raise BusError(f"bucket {bucket} does not exist; is an mlscope server up?",
                               bucket=bucket) from exc
        return self._kv[bucket]


@asynccontextmanager
async def connect(settings: Settings, *, name: str, provision: bool = False,
                  connect_timeout: float = 5.0) -> AsyncIterator[Bus]:
    """Connect to NATS (and optionally create streams/buckets); drain on exit."""
    options: dict[str, Any] = {
        "servers": [settings.nats_url],
        "name": name,
        "connect_timeout": connect_timeout,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "allow_reconnect": True,
    }
    if settings.nats_creds:
        options["user_credentials"] = str(settings.nats_creds)
    try:
        nc = await nats.connect(**options, error_cb=_quiet, disconnected_cb=_noop,
                                reconnected_cb=_noop, closed_cb=_noop)
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        raise BusError(f"cannot connect to NATS at {settings.nats_url}: {exc!r}",
                       url=settings.nats_url) from exc
    try:
        js = nc.jetstream()
        bus = Bus(nc, js)
        if provision:
            await ensure_infrastructure(bus)
        yield bus
    finally:
        # Shielded: a cancelled service must still flush what it published and close
        # the client, or nats-py's reader tasks outlive the event loop.
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(3), suppress(TimeoutError, nats.errors.Error, OSError):
                await nc.flush(timeout=2)
            await nc.close()


async def _quiet(exc: Exception) -> None:
    """nats-py reports reconnect noise through this callback; the caller sees BusError."""


async def _noop() -> None:
    return None


async def ensure_infrastructure(bus: Bus, *, replicas: int = 1) -> None:
    """Create (or update) every stream and bucket; idempotent."""
    streams = [
        StreamConfig(
            name=names.JOBS_STREAM,
            subjects=[names.JOBS_SUBJECT],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_msg_size=1 << 20,
        ),
        StreamConfig(
            name=names.TRACES_STREAM,
            subjects=[names.traces_wildcard()],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=TRACES_MAX_AGE_S,
            num_replicas=replicas,
            duplicate_window=120.0,
        ),
    ]
    try:
        for cfg in streams:
            try:
                await bus.js.add_stream(cfg)
            except nats.js.errors.BadRequestError:
                await bus.js.update_stream(cfg)
        await bus.js.create_key_value(KeyValueConfig(
            bucket=names.AGENTS_BUCKET, ttl=AGENT_TTL_S, history=1, replicas=replicas))
        await bus.js.create_key_value(KeyValueConfig(
            bucket=names.MODELS_BUCKET, history=5, replicas=replicas))
    except nats.errors.Error as exc:
        raise BusError(f"cannot provision JetStream: {exc!r}") from exc


def error_reply(exc: MLScopeError) -> bytes:
    """The bytes of an error reply (decoded by :func:`request`)."""
    return codec.encode({"kind": "error", "error": exc.to_wire()})


async def request(bus: Bus, subject: str, payload: bytes, *, timeout: float) -> Any:
    """Request/reply; an error reply is raised as its typed error."""
    try:
        msg = await bus.nc.request(subject, payload, timeout=timeout)
    except nats.errors.NoRespondersError as exc:
        raise BusError(f"nobody serves {subject}", subject=subject) from exc
    except (TimeoutError, nats.errors.TimeoutError) as exc:
        raise BusError(f"no reply on {subject} within {timeout}s", subject=subject) from exc
    data = codec.decode(msg.data)
    if isinstance(data, dict) and data.get("kind") == "error":
        raise error_from_wire(data["error"])
    return data
