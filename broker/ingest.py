"""The trace ingester: JetStream span and sample batches -> columnar inserts.

A durable pull consumer survives ingester restarts: batches published while it is
down wait in the stream. Messages are acknowledged only after their rows are
inserted, so a crash between insert and ack redelivers them (after the consumer's
ack wait, :data:`TRACE_ACK_WAIT_S`; while a fetch is decoded, queued and inserted the
ingester renews its hold on it, so a slow insert is never delivered twice); each table's
ReplacingMergeTree key ((evaluation_id, agent_id, span_id) for spans, (evaluation_id,
agent_id, metric, device, ts_ns) for samples) and FINAL reads make that redelivery
invisible. One fetch of up to ``fetch_batch`` messages (and about ``INSERT_ROWS`` rows) becomes
one Arrow insert per table (:mod:`broker.ingest_columns`: numbers as typed arrays,
strings dictionary-encoded as the tracer sends them).

Poison is bounded (through the server's serving boundary): every column is checked
against its table's type before anything is inserted, every string against its bound
(:data:`mlscope.schema.STRING_BOUNDS`: a dictionary's words once each, a plain column
in pydantic's own loop, so an over-long name costs no per-row Python), and a message
that does not decode or validate is dead-lettered at once; a batch whose insert fails (a full or
read-only disk) is redelivered after a pause, and dead-lettered after
``MAX_DELIVER`` deliveries. The stream is never blocked and the server never stops.

A batch is stored only in the name of the agent whose subject it came on, and not
under an evaluation stored as run on another agent (the id a batch names is the
agent's word: :data:`mlscope.tracerows.RAN_ON`, read once per fetch). One still
running has no row yet and takes any agent's; once stored, its readers take its own
agent's rows only (:func:`mlscope.tracerows.trace_rows`).

Once stored, batches leave the stream: every ``trim_s`` the ingester purges the traces
stream below its consumer's ack floor (every message before it is stored), so the
stream holds what is not yet ingested, not seven days of spans (its byte cap is the
backstop while no ingester runs).
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import anyio.abc
import nats.errors
import numpy as np
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from broker.db import Database
from broker.ingest_batch import check_agent, decode
from broker.ingest_columns import Columns
from mlscope import names, schema, tracerows
from mlscope.bus import Bus
from mlscope.consumers import durable_pull, keep_holding
from mlscope.contracts import SampleBatch, SpanBatch
from mlscope.errors import MLScopeError
from mlscope.serving import Boundary, delivered
from mlscope.tuning import ProcessTuning

__all__ = ["Ingester"]

FETCH_BYTES = 16 * 1024 * 1024
"""Bytes asked for per fetch: well under nats-py's 256 MiB pending limit per subscription."""
_Decoded = tuple[Columns, Columns, list[Msg], list[tuple[Msg, MLScopeError]]]
"""(span rows, sample rows, messages to ack, messages to dead-letter with why)."""
INSERT_ROWS = 50_000
"""Rows asked for per fetch (estimated from the rows per message so far): each insert
has a fixed cost of a few ms, so ~50k rows keep it small, and the next fetch is
decoded while this one is inserted."""
MAX_DELIVER = 20
"""Deliveries of a batch whose insert keeps failing before it is dead-lettered."""
RETRY_S = 2.0
DRAIN_POLL_S = 0.2
"""How often :meth:`Ingester.drained` asks the consumer what is left."""
TRACE_ACK_WAIT_S = 10.0
"""How long a trace batch delivered to an ingester that stopped renewing its hold
(killed, frozen, cut off) waits before JetStream delivers it again: the batches a lost
server held come back to another one after this long."""
log = logging.getLogger("mlscope.ingest")


class Ingester:
    def __init__(
        self,
        bus: Bus,
        db: Database,
        *,
        fetch_batch: int = 512,
        fetch_timeout: float = 1.0,
        ack_wait_s: float = TRACE_ACK_WAIT_S,
        boundary: Boundary | None = None,
        trim_s: float = 10.0,
        tuning: ProcessTuning | None = None,
    ) -> None:
        self.bus, self.db, self.ack_wait_s = bus, db, ack_wait_s
        self.boundary = boundary or Boundary(bus, service="ingester", logger=log)
        self.fetch_batch, self.fetch_timeout = fetch_batch, fetch_timeout
        self.trim_s = trim_s
        self.tuning = tuning
        """Whose loads the ingester waits out (None: it never waits)."""
        self.trimmed_below = 0
        """Stream sequence below which the traces stream has been purged."""
        self.ingested = 0
        self.samples = 0
        self.rejected = 0
        self.redelivered = 0
        """Messages stored that JetStream had delivered before (the dedup path ran)."""
        self._send: anyio.abc.ObjectSendStream[_Decoded] | None = None
        self._rows_per_msg = 5000.0
        """Rows per message, running estimate (start: a full tracer batch)."""
        self._held: dict[int, Msg] = {}
        """Fetched messages not yet acknowledged, nak'ed or dead-lettered, by id()."""

    async def run(self) -> None:
        config = ConsumerConfig(
            filter_subject=names.traces_wildcard(),
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            deliver_policy=DeliverPolicy.ALL,
            max_ack_pending=20_000,
            max_deliver=MAX_DELIVER,
        )
        sub = await durable_pull(self.bus, names.TRACES_STREAM, names.TRACES_CONSUMER, config)
        # Fetch and decode the next messages while the previous ones are inserted.
        send, receive = anyio.create_memory_object_stream[_Decoded](1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._writer, receive)
            tg.start_soon(self._trimmer, sub)
            tg.start_soon(keep_holding, self._held.values, self.ack_wait_s)
            self._send = send
            try:
                avg = float(1 << 20)  # bytes per message, running estimate (start: max)
                while True:
                    if self.tuning is not None:  # during a load spans wait in the stream
                        await self.tuning.wait_idle()
                    # Messages of one fetch land in the client's pending buffer at once;
                    # past its byte limit nats-py drops them (slow consumer) and they
                    # come back only after ack_wait. So a fetch asks for FETCH_BYTES.
                    # Rows per fetch are bounded too, so that the next fetch is decoded
                    # while this one is inserted (one huge insert would serialize them).
                    n = max(
                        1,
                        min(
                            self.fetch_batch,
                            int(FETCH_BYTES / avg),
                            int(INSERT_ROWS / self._rows_per_msg),
                        ),
                    )
                    try:
                        msgs = await sub.fetch(n, timeout=self.fetch_timeout)
                    except (nats.errors.TimeoutError, TimeoutError):
                        continue
                    except nats.errors.Error:
                        await anyio.sleep(0.5)  # cluster failover: the consumer's leader moves
                        continue
                    if not msgs:
                        continue
                    avg = 0.5 * avg + 0.5 * sum(len(m.data) for m in msgs) / len(msgs)
                    self._held.update((id(m), m) for m in msgs)
                    await self._store(msgs)
            finally:
                self._send = None
                self._held.clear()  # what it did not finish comes back after the ack wait
                send.close()

    async def _trimmer(self, sub: Any) -> None:
        while True:
            await anyio.sleep(self.trim_s)
            try:
                await self.trim(sub)
            except (TimeoutError, nats.errors.Error) as exc:  # next round
                log.debug("traces stream not trimmed: %r", exc)

    async def trim(self, sub: Any) -> None:
        """Purge the traces stream below the consumer's ack floor (all stored)."""
        floor = int((await sub.consumer_info()).ack_floor.stream_seq or 0)
        if floor + 1 > self.trimmed_below:
            await self.bus.js.purge_stream(names.TRACES_STREAM, seq=floor + 1)
            self.trimmed_below = floor + 1

    async def drained(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until every trace batch published so far is
        stored: the consumer has nothing pending nor awaiting its ack. False when it
        was not within the time, or the stream cannot be asked."""
        with anyio.move_on_after(timeout_s):
            while True:
                try:
                    info = await self.bus.js.consumer_info(
                        names.TRACES_STREAM, names.TRACES_CONSUMER
                    )
                except (TimeoutError, nats.errors.Error) as exc:
                    log.warning("trace ingest not checked: %r", exc)
                    return False
                if not info.num_pending and not info.num_ack_pending:
                    return True
                await anyio.sleep(DRAIN_POLL_S)
        return False

    async def _writer(self, receive: anyio.abc.ObjectReceiveStream[_Decoded]) -> None:
        async with receive:
            async for decoded in receive:
                await self._write(decoded)

    async def _store(self, msgs: list[Msg]) -> None:
        """Decode one fetch; hand it to the writer (inside run) or write it now. Off the
        event loop: checking a fetch of large batches takes a second of CPU, which the
        server's other services on the loop must not wait for."""
        decoded = await anyio.to_thread.run_sync(self._decode, msgs)
        if self._send is not None:
            await self._send.send(decoded)
        else:
            await self._write(decoded)

    def _decode(self, msgs: list[Msg]) -> _Decoded:
        spans, samples = Columns(schema.SPANS), Columns(schema.SYSTEM_SAMPLES)
        good: list[Msg] = []
        bad: list[tuple[Msg, MLScopeError]] = []
        checked: list[tuple[Msg, SpanBatch | SampleBatch, dict[str, np.ndarray]]] = []
        for msg in msgs:
            if delivered(msg) > 1:
                self.redelivered += 1
            try:
                checked.append((msg, *decode(msg.data, msg.subject)))
            except Exception as exc:  # whatever the bytes: this message never stores
                bad.append((msg, self.boundary.failed(exc, msg.subject)))
        ran_on = self._ran_on({batch.evaluation_id for _, batch, _ in checked})
        for msg, batch, codes in checked:
            try:
                check_agent(batch, ran_on)
                (spans if isinstance(batch, SpanBatch) else samples).add(batch, codes)
            except Exception as exc:  # another agent's evaluation, or rows that never store
                bad.append((msg, self.boundary.failed(exc, msg.subject)))
                continue
            good.append(msg)
        if good:
            rows = (spans.rows + samples.rows) / len(good)
            self._rows_per_msg = max(1.0, 0.5 * self._rows_per_msg + 0.5 * rows)
        return spans, samples, good, bad

    def _ran_on(self, ids: set[str]) -> dict[str, str]:
        """The agent each stored evaluation of ``ids`` ran on (not stored: not listed).
        Read per fetch, never cached: a lost attempt's runs are stored again by the
        next, maybe on another agent. Where the database does not answer, none (what is
        then stored unchecked, readers still take by agent)."""
        if not ids:
            return {}
        try:
            rows = self.db.rows(tracerows.RAN_ON, {"ids": sorted(ids)})
        except MLScopeError as exc:
            log.warning("evaluations' agents not read; batches not checked: %s", exc)
            return {}
        return {str(e): str(a) for e, a in rows}

    async def _write(self, decoded: _Decoded) -> None:
        try:
            await self._settle(decoded)
        finally:
            for msg in (*decoded[2], *(m for m, _ in decoded[3])):
                self._held.pop(id(msg), None)

    async def _settle(self, decoded: _Decoded) -> None:
        """Store the good messages' rows and ack them (nak them when the insert
        fails); dead-letter the bad ones."""
        spans, samples, good, bad = decoded
        for msg, err in bad:  # a message that can never decode must not block the stream
            self.rejected += 1
            await self.boundary.dead_letter(msg, names.TRACES_STREAM, err)
        try:
            await self._insert(spans, samples)
        except Exception as exc:  # a storage fault: the batches come back after a pause
            err = self.boundary.failed(exc, names.TRACES_STREAM, what="insert of")
            for msg in good:
                if delivered(msg) >= MAX_DELIVER:
                    await self.boundary.dead_letter(msg, names.TRACES_STREAM, err)
                else:
                    with anyio.move_on_after(5):
                        await _quiet(msg.nak(delay=RETRY_S))
            await anyio.sleep(RETRY_S)
            return
        for msg in good:
            with anyio.move_on_after(5):
                await _quiet(msg.ack())

    async def _insert(self, spans: Columns, samples: Columns) -> None:
        """Each table's rows, built into Arrow and inserted off the event loop."""
        for table, rows in (("spans", spans), ("system_samples", samples)):
            if rows.rows:
                await anyio.to_thread.run_sync(self._insert_rows, table, rows)
        self.ingested += spans.rows
        self.samples += samples.rows

    def _insert_rows(self, table: str, rows: Columns) -> None:
        self.db.insert_arrow(table, rows.arrow())


async def _quiet(aw: Any) -> None:
    try:
        await aw
    except (TimeoutError, nats.errors.Error):
        log.debug("ack or nak not sent; JetStream redelivers after ack_wait")
