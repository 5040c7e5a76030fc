"""Reading the agent registry (the KV bucket agents heartbeat into)."""

from __future__ import annotations

import asyncio
import time

import anyio

from mlscope import codec, names
from mlscope.bus import Bus, bus_errors, if_found
from mlscope.contracts import AgentDescription
from mlscope.errors import BusDenied, BusError, BusNotFound, WireError
from mlscope.kvread import BucketWatch, bucket_keys
from mlscope.provision import AGENT_TTL_S
from mlscope.serving import MAX_VALUE_BYTES

__all__ = ["AgentCache", "list_agents"]

FUTURE_TOLERANCE_S = 86_400.0
"""A heartbeat more than a day ahead of this clock is refused: no clock is that wrong, and
it would keep a dead agent listed (resolution also pings an agent before using it)."""


async def list_agents(
    bus: Bus, *, include_stale: bool = False, attempts: int = 5
) -> list[AgentDescription]:
    """Live agents, sorted by id. Entries whose heartbeat is older than the TTL are
    left out even before the bucket expires them (a frozen agent is not live).

    Retried while the bucket does not answer (a cluster moving its leader)."""
    for attempt in range(attempts):
        try:
            with bus_errors("cannot read the agent registry"):
                return await _list_agents(bus, include_stale)
        except BusError as exc:
            if isinstance(exc, BusNotFound | BusDenied) or attempt == attempts - 1:
                raise
            await asyncio.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


async def _list_agents(bus: Bus, include_stale: bool) -> list[AgentDescription]:
    kv = await bus.kv(names.AGENTS_BUCKET)
    keys = await bucket_keys(bus, names.AGENTS_BUCKET)
    out = []

    async def get(key: str) -> bytes | None:
        entry = await if_found(kv.get(key))  # None: withdrawn, or expired since the listing
        return None if entry is None else entry.value

    # All gets in flight at once: with 32 agents one round trip, not 32.
    values = await asyncio.gather(*(get(k) for k in keys))
    for key, value in zip(keys, values, strict=True):
        desc = _description(key, value)
        if desc is None:
            continue  # a foreign, older or hostile entry: not an agent we can use
        if include_stale or time.time() - desc.heartbeat_at <= AGENT_TTL_S:
            out.append(desc)
    return sorted(out, key=lambda d: d.agent_id)


class AgentCache:
    """The registry kept in memory by a watch on the bucket.

    ``agents()`` answers without a round trip (job resolution with many agents stays
    well under a millisecond); :func:`list_agents` remains the one-shot read.
    """

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._entries: dict[str, AgentDescription] = {}
        self.ready = anyio.Event()

    def agents(self, *, include_stale: bool = False) -> list[AgentDescription]:
        now = time.time()
        return sorted(
            (
                d
                for d in self._entries.values()
                if include_stale or now - d.heartbeat_at <= AGENT_TTL_S
            ),
            key=lambda d: d.agent_id,
        )

    async def run(self) -> None:
        """Watch forever; re-watch after a failover."""
        while True:
            try:
                async with BucketWatch(self.bus, names.AGENTS_BUCKET) as watch:
                    async for entry in watch:
                        if entry is None:  # the initial values are in
                            self.ready.set()
                            continue
                        self._apply(entry.key, entry.value, entry.operation)
            except BusError:
                await anyio.sleep(0.5)

    def _apply(self, key: str, value: bytes | None, operation: str | None) -> None:
        if operation in ("DEL", "PURGE") or not value:
            self._entries.pop(key, None)
            return
        desc = _description(key, value)
        if desc is None:
            self._entries.pop(key, None)
        else:
            self._entries[key] = desc


def _description(key: str, value: bytes | None) -> AgentDescription | None:
    """A registry value as a description; None for one that is not (size-limited
    before decoding; the contract refuses a negative pid, a heartbeat in the future),
    or that describes an agent other than its key names: an agent's own user writes
    only its own key, so a description under another key is a forgery (one agent
    listed twice, or a dead one kept alive)."""
    if not value or len(value) > MAX_VALUE_BYTES:
        return None
    try:
        desc = codec.decode_model(AgentDescription, value)
    except (WireError, RecursionError):
        return None
    if desc.agent_id != key:
        return None
    return desc if desc.heartbeat_at <= time.time() + FUTURE_TOLERANCE_S else None
