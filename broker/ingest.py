"""The trace ingester: JetStream span batches -> columnar inserts into ``spans``.

A durable pull consumer survives ingester restarts: spans published while it is down
wait in the stream. Messages are acknowledged only after their rows are inserted, so
a crash between insert and ack redelivers them; the table's ReplacingMergeTree key
(evaluation_id, agent_id, span_id) and FINAL reads make that redelivery invisible.
"""

from __future__ import annotations

import anyio
import nats.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from broker import loadgen
from broker.db import SPAN_COLUMNS, Database
from mlscope import codec, names
from mlscope.bus import Bus
from mlscope.contracts import SpanBatch
from mlscope.errors import WireError

__all__ = ["Ingester"]


class Ingester:
    def __init__(self, bus: Bus, db: Database, *, fetch_batch: int = 512,
                 fetch_timeout: float = 0.25, ack_wait_s: float = 30.0) -> None:
        self.bus, self.db, self.ack_wait_s = bus, db, ack_wait_s
        self.fetch_batch, self.fetch_timeout = fetch_batch, fetch_timeout
        self.ingested = 0
        self.rejected = 0

    async def run(self) -> None:
        sub = await self.bus.js.pull_subscribe(
            names.traces_wildcard(), durable=names.TRACES_CONSUMER, stream=names.TRACES_STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=self.ack_wait_s,
                                  deliver_policy=DeliverPolicy.ALL,
                                  max_ack_pending=20_000))
        while True:
            await loadgen.wait_idle()  # during a load run spans wait in the stream
            try:
                msgs = await sub.fetch(self.fetch_batch, timeout=self.fetch_timeout)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            except nats.errors.Error:
                await anyio.sleep(0.5)  # cluster failover: the consumer's leader moves
                continue
            await self._store(msgs)

    async def _store(self, msgs: list[Msg]) -> None:
        cols: dict[str, list[object]] = {c: [] for c in SPAN_COLUMNS}
        good, bad = [], []
        for msg in msgs:
            try:
                batch = codec.decode_model(SpanBatch, msg.data)
            except WireError:
                bad.append(msg)
                continue
            n = len(batch)
            for col in ("span_id", "parent_id", "query_index", "level", "kind", "name",
                        "start_ns", "end_ns", "attrs"):
                cols[col].extend(batch.columns[col])
            for col, value in (("evaluation_id", batch.evaluation_id),
                               ("agent_id", batch.agent_id), ("host", batch.host),
                               ("batch_id", batch.batch_id)):
                cols[col].extend([value] * n)
            good.append(msg)
        if cols["span_id"]:
            await anyio.to_thread.run_sync(
                self.db.insert, "spans", [cols[c] for c in SPAN_COLUMNS], SPAN_COLUMNS)
            self.ingested += len(cols["span_id"])
        for msg in good:
            await msg.ack()
        for msg in bad:  # a message that can never decode must not block the stream
            self.rejected += 1
            await msg.term()
