"""Reading the registry of load-generator services (bucket ``mlscope_loadgens``).

A load-generator service (``mlscope loadgen``, :mod:`broker.lgservice`) puts its
:class:`LoadgenDescription` there once it is subscribed and refreshes it every
heartbeat; the entry expires like an agent's (:data:`mlscope.provision.AGENT_TTL_S`). The
first service creates the bucket (:func:`ensure_bucket`), so a bus that never had a
load-generator service has no such bucket and lists none; the stack's provisioning
(``ensure_infrastructure``), which every role's permissions are written against, is
left as it was.
"""

from __future__ import annotations

import asyncio
import time

from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from mlscope import codec, names
from mlscope.bus import Bus, bus_errors, if_found
from mlscope.contracts import LoadgenDescription
from mlscope.errors import WireError
from mlscope.kvread import bucket_keys
from mlscope.provision import AGENT_TTL_S
from mlscope.serving import MAX_VALUE_BYTES

__all__ = ["ensure_bucket", "list_loadgens"]


async def ensure_bucket(bus: Bus, *, replicas: int = 1) -> KeyValue:
    """The registry bucket, created when missing (TTL and history as the agents')."""
    with bus_errors("cannot open the load-generator registry"):
        kv = await if_found(bus.js.key_value(names.LOADGENS_BUCKET))
        if kv is not None:
            return kv
        return await bus.js.create_key_value(
            KeyValueConfig(
                bucket=names.LOADGENS_BUCKET, ttl=AGENT_TTL_S, history=1, replicas=replicas
            )
        )


async def list_loadgens(bus: Bus, *, include_stale: bool = False) -> list[LoadgenDescription]:
    """Live load-generator services, sorted by id (an entry whose heartbeat is older
    than the TTL is left out even before the bucket expires it)."""
    with bus_errors("cannot read the load-generator registry"):
        kv = await if_found(bus.js.key_value(names.LOADGENS_BUCKET))
        if kv is None:
            return []  # no load-generator service ever joined this bus
        keys = await bucket_keys(bus, names.LOADGENS_BUCKET)

        async def get(key: str) -> bytes | None:
            entry = await if_found(kv.get(key))  # None: withdrawn, or expired since listed
            return None if entry is None else entry.value

        values = await asyncio.gather(*(get(k) for k in keys))
    now = time.time()
    out = []
    for key, value in zip(keys, values, strict=True):
        if not value or len(value) > MAX_VALUE_BYTES:
            continue
        try:
            desc = codec.decode_model(LoadgenDescription, value)
        except (WireError, RecursionError):
            continue  # a foreign or hostile entry
        if desc.loadgen_id != key:
            continue  # a service describes itself under its own id only
        if include_stale or abs(now - desc.heartbeat_at) <= AGENT_TTL_S:
            out.append(desc)
    return sorted(out, key=lambda d: d.loadgen_id)
