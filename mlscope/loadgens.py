"""Reading the registry of load-generator services (bucket ``mlscope_loadgens``).

A load-generator service (``mlscope loadgen``, :mod:`broker.lgservice`) puts its
:class:`LoadgenDescription` there once it is subscribed and refreshes it every
heartbeat; the entry expires like an agent's (:data:`mlscope.bus.AGENT_TTL_S`). The
first service creates the bucket (:func:`ensure_bucket`), so a bus that never had a
load-generator service has no such bucket and lists none; the stack's provisioning
(``ensure_infrastructure``), which every role's permissions are written against, is
left as it was.
"""

from __future__ import annotations

import asyncio
import time

import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from mlscope import codec, names
from mlscope.bus import AGENT_TTL_S, Bus
from mlscope.contracts import LoadgenDescription
from mlscope.errors import BusError, WireError
from mlscope.kvread import bucket_keys
from mlscope.serving import MAX_VALUE_BYTES

__all__ = ["ensure_bucket", "list_loadgens"]


async def ensure_bucket(bus: Bus, *, replicas: int = 1) -> KeyValue:
    """The registry bucket, created when missing (TTL and history as the agents')."""
    try:
        try:
            return await bus.js.key_value(names.LOADGENS_BUCKET)
        except nats.js.errors.BucketNotFoundError:
            return await bus.js.create_key_value(
                KeyValueConfig(
                    bucket=names.LOADGENS_BUCKET, ttl=AGENT_TTL_S, history=1, replicas=replicas
                )
            )
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"cannot open the load-generator registry: {exc!r}") from exc


async def list_loadgens(bus: Bus, *, include_stale: bool = False) -> list[LoadgenDescription]:
    """Live load-generator services, sorted by id (an entry whose heartbeat is older
    than the TTL is left out even before the bucket expires it)."""
    try:
        kv = await bus.js.key_value(names.LOADGENS_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        return []  # no load-generator service ever joined this bus
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"cannot read the load-generator registry: {exc!r}") from exc
    try:
        keys = await bucket_keys(bus, names.LOADGENS_BUCKET)

        async def get(key: str) -> bytes | None:
            try:
                return (await kv.get(key)).value
            except nats.js.errors.KeyNotFoundError:
                return None  # withdrawn, or expired between listing and get()

        values = await asyncio.gather(*(get(k) for k in keys))
    except (TimeoutError, nats.errors.Error) as exc:
        raise BusError(f"cannot read the load-generator registry: {exc!r}") from exc
    now = time.time()
    out = []
    for value in values:
        if not value or len(value) > MAX_VALUE_BYTES:
            continue
        try:
            desc = codec.decode_model(LoadgenDescription, value)
        except (WireError, RecursionError):
            continue  # a foreign or hostile entry
        if include_stale or abs(now - desc.heartbeat_at) <= AGENT_TTL_S:
            out.append(desc)
    return sorted(out, key=lambda d: d.loadgen_id)
