"""Reading the agent registry (the KV bucket agents heartbeat into)."""

from __future__ import annotations

import time

import nats.js.errors

from mlscope import codec, names
from mlscope.bus import AGENT_TTL_S, Bus
from mlscope.contracts import AgentDescription
from mlscope.errors import WireError

__all__ = ["list_agents"]


async def list_agents(bus: Bus, *, include_stale: bool = False) -> list[AgentDescription]:
    """Live agents, sorted by id. Entries whose heartbeat is older than the TTL are
    left out even before the bucket expires them (a frozen agent is not live)."""
    kv = await bus.kv(names.AGENTS_BUCKET)
    try:
        keys = await kv.keys()
    except nats.js.errors.NoKeysError:
        return []
    out = []
    for key in keys:
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue  # expired between keys() and get()
        if not entry.value:
            continue
        try:
            desc = codec.decode_model(AgentDescription, entry.value)
        except WireError:
            continue  # a foreign or older entry: not an agent we can use
        if include_stale or time.time() - desc.heartbeat_at <= AGENT_TTL_S:
            out.append(desc)
    return sorted(out, key=lambda d: d.agent_id)
