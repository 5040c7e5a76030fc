"""Reading a KV bucket completely: its keys now, and a watch that knows when it is caught up.

nats-py's ``KeyValue.keys()`` and ``watchall()`` signal "no more initial values" from a
consumer-info reply that can overtake messages already on their way to the client: on a
busy machine ``keys()`` then returns nothing although the bucket is full, and a watcher
reports ready before the values it was sent. Here the keys come from the stream's own
per-subject state, and a watch counts as caught up only at the entry the server sent
with nothing left pending (or when the bucket is really empty).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import anyio
from nats.js.kv import KeyValue

from mlscope.bus import Bus, bus_errors

__all__ = ["BucketWatch", "bucket_keys"]


_KEY = re.compile(r"[-/_=a-zA-Z0-9]+(\.[-/_=a-zA-Z0-9]+)*")
"""A key a KV client may read: letters, digits, ``-/_=``, dots between them."""


async def bucket_keys(bus: Bus, bucket: str) -> list[str]:
    """The keys that have a message in ``bucket`` now, sorted. A key whose last message is
    a delete marker is included: its ``get`` finds nothing (:func:`mlscope.bus.if_found`).
    A subject no KV client can read as a key (published into the bucket's stream by
    whoever may write there, e.g. ``bad#key``) is left out: a ``get`` of it raises,
    and one such key would fail the whole listing."""
    prefix = f"$KV.{bucket}."
    with bus_errors(f"cannot list the keys of {bucket}", bucket=bucket):
        info = await bus.js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
    keys = (s[len(prefix) :] for s in (info.state.subjects or {}))
    return sorted(k for k in keys if _KEY.fullmatch(k))


class BucketWatch:
    """``async with BucketWatch(bus, bucket) as watch: async for entry in watch: ...``

    Yields the last entry of every key (deletes included, ``operation`` set), then
    ``None`` exactly once when those are all in, then every change as it happens.
    """

    def __init__(self, bus: Bus, bucket: str) -> None:
        self.bus, self.bucket = bus, bucket
        self.caught_up = False
        self._watcher: Any = None

    async def __aenter__(self) -> BucketWatch:
        kv: KeyValue = await self.bus.kv(self.bucket)
        with bus_errors(f"cannot watch {self.bucket}", bucket=self.bucket):
            self._watcher = await kv.watchall()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(2),
            bus_errors(f"cannot stop watching {self.bucket}"),
        ):
            await self._watcher.stop()

    def __aiter__(self) -> AsyncIterator[KeyValue.Entry | None]:
        return self._entries()

    async def _entries(self) -> AsyncIterator[KeyValue.Entry | None]:
        with bus_errors(f"cannot watch {self.bucket}", bucket=self.bucket):
            async for entry in self._entries_raw():
                yield entry

    async def _entries_raw(self) -> AsyncIterator[KeyValue.Entry | None]:
        async for entry in self._watcher:
            if entry is None:  # nats-py's marker: trusted only for an empty bucket
                if not self.caught_up and not await bucket_keys(self.bus, self.bucket):
                    self.caught_up = True
                    yield None
                continue
            yield entry
            if not self.caught_up and entry.delta == 0:
                self.caught_up = True
                yield None
