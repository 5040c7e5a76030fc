"""Shipping a local run's rows (placement agent): :func:`serve_run` runs a prepared
:class:`~agent.localrun.LocalRun` on a worker thread and sends its rows to the server
every :data:`~mlscope.contracts.ROWS_EVERY_S` while it runs (each up to its first
query still in flight), then the rest with the run's totals (its CPU time among them,
:mod:`agent.localcpu`): a run stopped early (its evaluation released, as when its job
is cancelled) ships every query it issued, those in flight included, as
:class:`~mlscope.contracts.RunRows` messages each within the max payload
(:func:`rows_messages`). The server side is ``broker/agentrun.py``.

Rows are flow-controlled: after each :data:`ACK_EVERY_BYTES` the agent sends a message
as a request and waits until the server has read it (:func:`rows_publisher`). An
overloaded run's final rows are hundreds of MB at once, and nats-server cuts off a
client that leaves more than its max pending (64 MiB by default) unread as a slow
consumer, losing the messages (and the server's other subscriptions' with them).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np

from agent.localrun import LocalRun
from mlscope import codec
from mlscope.bus import Bus, bus_errors
from mlscope.contracts import ROWS_EVERY_S, RunOp, RunRows
from mlscope.errors import BusError
from mlscope.serving import as_error

__all__ = ["ACK_EVERY_BYTES", "Publish", "rows_messages", "rows_publisher", "serve_run"]

log = logging.getLogger("mlscope.agent")
HEADROOM = 4096
"""Bytes of a rows message kept for its fields other than the rows and their errors."""
ERROR_OVERHEAD = 14
"""Bytes an error costs in a rows message besides its text, at most: its key (up to 9)
and its text's msgpack header (up to 5)."""
SHIP_TIMEOUT_S = 10.0
"""How long one rows message may take to send (a bus that takes none is gone)."""
ACK_EVERY_BYTES = 8 << 20
"""Bytes of rows messages sent between two that wait until the server has read them:
at most about this much of one run's rows is unread at the server, well within
nats-server's default max pending for its connection (64 MiB, which it shares with
the trace ingester's fetches and the other runs' rows)."""
ACK_WAIT_S = 5.0
"""How long a message that asks waits for the server's word that it is read. Flow
control only: past it (a server stuck, or gone) the shipment goes on."""
Publish = Callable[[bytes, bool], Awaitable[None]]
"""Sends one rows message; True: and waits (up to :data:`ACK_WAIT_S`) until the
server has read it."""
PACER_STOP_S = 1.0
"""How long the final rows of a stopped run wait for its pacer to stop (it does within
a few ms), so that they carry its load generator's CPU time."""


def rows_messages(
    evaluation_id: str,
    start: int,
    columns: dict[str, np.ndarray],
    errors: dict[int, str],
    *,
    seq: int,
    max_bytes: int,
    **extra: Any,
) -> list[bytes]:
    """``RunRows`` messages for these rows, each under ``max_bytes`` (split by rows, a
    row's bytes being its columns' and its error's; ``extra`` goes on the last).

    Linear in the rows and errors: an overloaded run refuses most of its queries, each
    with its error, and a shipment of millions of such rows must not hold the agent's
    event loop (a message per row, each looking through every error, held it for
    hours and let its registry entry expire)."""
    n = len(next(iter(columns.values()))) if columns else 0
    keys = np.array(sorted(i for i in errors if start <= i < start + n), np.int64)
    cost = np.full(n, sum(c[:1].nbytes for c in columns.values()) or 1, np.int64)
    if keys.size:  # an error costs its text (UTF-8), its key and msgpack's headers
        text = np.fromiter((len(errors[int(i)].encode()) for i in keys), np.int64, keys.size)
        np.add.at(cost, keys - start, text + ERROR_OVERHEAD)
    ends = np.cumsum(cost)
    budget = max(max_bytes - HEADROOM, 1)
    out: list[bytes] = []
    a = 0
    while True:
        before = int(ends[a - 1]) if a else 0
        b = max(a + 1, int(np.searchsorted(ends, before + budget, side="right"))) if n else 0
        b = min(b, n)
        last = b >= n
        lo, hi = np.searchsorted(keys, [start + a, start + b])
        msg = RunRows(
            evaluation_id=evaluation_id,
            seq=seq + len(out),
            start=start + a,
            columns={k: v[a:b] for k, v in columns.items()},
            errors={int(i): errors[int(i)] for i in keys[lo:hi]},
            **(extra if last else {k: v for k, v in extra.items() if k == "issued"}),
        )
        out.append(codec.encode_model(msg))
        if last:
            return out
        a = b


async def serve_run(
    run: LocalRun,
    req: RunOp,
    publish: Publish,
    service: str,
    *,
    held: contextlib.ExitStack,
    max_bytes: int,
) -> None:
    """Run ``run`` (prepared) on a worker thread; ship its rows every
    :data:`~mlscope.contracts.ROWS_EVERY_S` while it runs and the rest, with the
    totals, when it ends: also when it fails (its typed error goes in the final rows)
    or the agent shuts down. ``held`` (the process tuning taken for the run) is let go
    once the run has ended, on this event loop.
    Messages are at most ``max_bytes`` (what the request asked, within the bus's max
    payload). Nothing here ends the agent: rows that cannot be shipped are logged, and
    the server, which never hears the run's end, fails it after its deadline."""
    rows = _Shipper(run, req, publish, service, max_bytes)

    async def shipper() -> None:
        while True:
            await anyio.sleep(ROWS_EVERY_S)
            # Rows taken are sent whole: a shipment cut off by the run's end would lose
            # them (the final rows start after them) and the run would read as broken.
            with anyio.CancelScope(shield=True):
                await rows.ship()

    error: dict[str, Any] | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(shipper)
            try:
                await anyio.to_thread.run_sync(run.run, abandon_on_cancel=True)
            finally:
                run.stop()
            tg.cancel_scope.cancel()
    except Exception as exc:  # the run's failure goes to the server in its rows
        error = as_error(exc, service=service).to_wire()
        log.warning("%s: local run %s failed: %r", service, req.evaluation_id, exc)
    finally:  # also on shutdown: the server stores what was measured
        held.close()
        with anyio.CancelScope(shield=True):
            # A stopped run's thread may still drain: its pacer's time once it stopped.
            await anyio.to_thread.run_sync(run.cpu.wait_stopped, PACER_STOP_S)
            process_cpu_s, loadgen_cpu_s = run.cpu.spent()
            try:
                await rows.ship(
                    final=True,
                    not_issued=run.rec.not_issued,
                    time_up=run.rec.time_up_ns,
                    process_cpu_s=process_cpu_s,
                    loadgen_cpu_s=loadgen_cpu_s,
                    error=error,
                )
            except Exception as exc:  # a lost link, a refused message: this run only
                log.error("%s: local run %s: rows not shipped: %r", service, req.evaluation_id, exc)


class _Shipper:
    """A local run's rows on their way to the server: each shipment takes the rows not
    shipped yet and sends them as numbered messages (``seq``)."""

    def __init__(
        self,
        run: LocalRun,
        req: RunOp,
        publish: Publish,
        service: str,
        max_bytes: int,
        ack_every: int = ACK_EVERY_BYTES,
    ) -> None:
        self.run, self.req, self.publish = run, req, publish
        self.service, self.max_bytes, self.ack_every = service, max_bytes, ack_every
        self.seq = 0
        """Messages sent so far: the next one's number."""

    def messages(self, final: bool, extra: dict[str, Any]) -> list[bytes]:
        """The rows not shipped yet, as messages (``final``: every row the run has)."""
        run = self.run
        start, cols, errors = run.take(final=final)
        if final:  # the run's rows: every one it has (a stopped run's issued ones)
            extra["queries"] = start + len(cols["ok"])
        elif not len(cols["ok"]):
            return []
        return rows_messages(
            self.req.evaluation_id,
            start,
            cols,
            errors,
            seq=self.seq,
            max_bytes=self.max_bytes,
            issued=run.issued,
            final=final,
            **extra,
        )

    async def ship(self, *, final: bool = False, **extra: Any) -> None:
        """Take the rows not shipped and send them, the messages built off the event
        loop (a shipment of an overloaded run's millions of rows takes seconds), each
        :attr:`ack_every` bytes waiting until the server has read them."""
        built = await anyio.to_thread.run_sync(self.messages, final, extra)
        sent = unread = 0
        for data in built:
            unread += len(data)
            wait = unread >= self.ack_every
            with anyio.move_on_after(SHIP_TIMEOUT_S) as sending:
                await self.publish(data, wait)
            if sending.cancelled_caught:
                break
            self.seq += 1
            sent += 1
            unread = 0 if wait else unread
        if sent < len(built):  # the server sees the gap; the agent says why
            log.error(
                "%s: local run %s: %d of %d rows messages not sent: one was not taken "
                "within %g s (the bus took none)",
                self.service,
                self.req.evaluation_id,
                len(built) - sent,
                len(built),
                SHIP_TIMEOUT_S,
            )


def rows_publisher(bus: Bus, subject: str) -> Publish:
    """A run's :data:`Publish` on its rows subject."""

    async def publish(data: bytes, wait: bool) -> None:
        with bus_errors(f"rows on {subject}", subject=subject):
            if not wait:
                await bus.nc.publish(subject, data)
                return
            try:
                with bus_errors(f"no word that the rows on {subject} were read"):
                    await bus.nc.request(subject, data, timeout=ACK_WAIT_S)
            except BusError as exc:  # sent all the same: the shipment goes on
                log.debug("%s", exc)

    return publish
