"""Replies from the executor's threads to the bus, one event-loop wake-up per burst.

nats-py belongs to the event loop, so a reply made on the predict thread must cross
back to it. Waking the loop per reply (``call_soon_threadsafe`` → a task → ``publish``
→ the client's flusher) costs a self-pipe write, two tasks and three loop turns for
every query. The outbox queues encoded replies under a lock and wakes the loop only
when the queue goes from empty to not empty; the loop then publishes everything
queued in one go, and nats-py writes it to the socket in one flush. Under load the
replies of a merged batch, or of queries that finish while the loop is busy, leave
together; a reply alone costs one wake-up and one task instead of two.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

from mlscope import codec
from mlscope.contracts import ErrorReply
from mlscope.errors import BusError, ReplyTooLarge

__all__ = ["Outbox"]

Publish = Callable[[str, bytes], Awaitable[None]]


class Outbox:
    """Thread-safe queue of (subject, bytes) that the event loop publishes in bursts.

    ``on_error(exc, subject)`` is called on the loop for a reply that could not be
    published (the connection closed: the requester times out). A reply over
    ``max_bytes`` (the bus's max payload) is replaced by a :class:`ReplyTooLarge` error
    reply naming its query, so the requester hears why at once.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        publish: Publish,
        on_error: Callable[[BaseException, str], object],
        *,
        max_bytes: int,
    ) -> None:
        self._loop, self._publish, self._on_error = loop, publish, on_error
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._queued: list[tuple[str, bytes]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_thread = threading.get_ident()
        """Made on the loop's thread: a put from it needs no self-pipe wake-up."""

    def put(self, subject: str, data: bytes) -> None:
        """Queue one reply (any thread); wakes the loop if nothing was queued."""
        with self._lock:
            self._queued.append((subject, data))
            wake = len(self._queued) == 1
        if not wake:
            return
        if threading.get_ident() == self._loop_thread:  # a query answered inline
            self._loop.call_soon(self._drain)
        else:
            self._loop.call_soon_threadsafe(self._drain)

    async def flush(self) -> None:
        """Publish what is queued now, from a coroutine on the loop (a query answered
        inline: its reply leaves in the same loop turn, as an echo's would)."""
        with self._lock:
            batch, self._queued = self._queued, []
        if batch:
            await self._send(batch)

    def _drain(self) -> None:  # on the loop
        with self._lock:
            batch, self._queued = self._queued, []
        if batch:
            task = self._loop.create_task(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[str, bytes]]) -> None:
        for subject, data in batch:
            try:
                if len(data) > self._max_bytes:
                    data = self._too_large(subject, data)
                await self._publish(subject, data)
            except Exception as exc:  # one reply lost; the rest still go
                self._on_error(BusError(f"reply not published: {exc!r}"), subject)

    def _too_large(self, subject: str, data: bytes) -> bytes:
        """The error reply that replaces ``data``, naming its query (as a reply does)."""
        raw = codec.decode(data)
        index = raw.get("index") if isinstance(raw, dict) else None
        err = ReplyTooLarge(
            f"the answer is {len(data):,} bytes, over the bus's max payload of "
            f"{self._max_bytes:,}: ask for smaller batches or fewer outputs",
            **({"index": index} if isinstance(index, int) else {}),
        )
        self._on_error(err, subject)
        return codec.encode_model(ErrorReply(error=err.to_wire()))
