"""The server's database responder: every other process reaches the evaluation
database through it (``mlscope.db.*``), on read-only, limited connections
(:mod:`broker.readonly`), never the writer's.

``mlscope.db.sql`` (a queue group: any replica answers) runs client SQL and answers
rows, or the first Arrow page of the result with the rest held under a cursor
(:mod:`broker.cursors`); the later pages are asked of the replica holding them on its
own subject (``mlscope.db.sql.page.<server id>``, no queue group), and a reader that
stops before the last page releases the rest there too (``mlscope.db.sql.close.<server
id>``).
``mlscope.db.evaluation`` answers one stored evaluation's specification and summary.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
from anyio.abc import TaskStatus
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from broker.cursors import Cursors
from broker.db import Database
from broker.readonly import ArrowPage, ReadOnlyDatabase
from mlscope import names
from mlscope.bus import Bus
from mlscope.contracts import (
    EvaluationReply,
    EvaluationRequest,
    SqlArrowReply,
    SqlCloseReply,
    SqlCloseRequest,
    SqlPageRequest,
    SqlReply,
    SqlRequest,
)
from mlscope.errors import EvaluationNotFound
from mlscope.serving import Boundary

__all__ = ["ARROW_REPLY_MARGIN", "DB_QUEUE", "SQL_IN_FLIGHT", "DatabaseResponder"]

DB_QUEUE = "mlscope-servers"
"""The queue group of the requests any replica may answer."""
SQL_IN_FLIGHT = 16
"""Client SQL requests handled at once (they wait for the read pool's connections);
more stay queued in the subscription."""
ARROW_REPLY_MARGIN = 4096
"""Bytes of a max payload kept for the envelope of an Arrow page (its msgpack keys,
cursor and server id)."""


@dataclass
class DatabaseResponder:
    bus: Bus
    boundary: Boundary
    db: Database
    """The writer's connection: only the stored evaluation is read from it."""
    reader: ReadOnlyDatabase
    cursors: Cursors
    server_id: str

    async def subscribe(self) -> list[Subscription]:
        """The request subscriptions answered one at a time (the evaluation request,
        in the replicas' queue group; this replica's cursor pages and closes); the
        client SQL is :meth:`serve_sql`'s."""
        serve = self.boundary.subscribe
        return [
            await serve(names.EVALUATION_SUBJECT, EvaluationRequest, self._on_eval, queue=DB_QUEUE),
            # No queue group: only this replica holds its cursors.
            await serve(names.sql_pages(self.server_id), SqlPageRequest, self._on_page),
            await serve(names.sql_close(self.server_id), SqlCloseRequest, self._on_close),
        ]

    async def serve_sql(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Answer client SQL concurrently: a subscription callback runs one message at
        a time, and one slow query would make every other client wait for it. Each
        request goes through the serving boundary (typed contract, typed error reply)."""
        respond = self.boundary.responder(SqlRequest, self._on_sql)
        sub = await self.bus.nc.subscribe(names.SQL_SUBJECT, queue=DB_QUEUE)
        slots = anyio.Semaphore(SQL_IN_FLIGHT)

        async def answer(msg: Msg) -> None:
            try:
                await respond(msg)
            finally:
                slots.release()

        try:
            async with anyio.create_task_group() as tg:
                task_status.started()
                async for msg in sub.messages:
                    await slots.acquire()
                    tg.start_soon(answer, msg)
        finally:
            with anyio.CancelScope(shield=True):
                await sub.unsubscribe()

    async def _on_sql(self, req: SqlRequest, msg: Msg) -> SqlReply | SqlArrowReply:
        """{sql, parameters} -> {columns, rows}, or the first Arrow page of the result
        under the max payload (the rest held for :meth:`_on_page`)."""
        if req.format == "arrow":
            table = await anyio.to_thread.run_sync(self.reader.arrow, req.sql, req.parameters)
            page, cursor = await anyio.to_thread.run_sync(
                functools.partial(
                    self.cursors.first_page,
                    table,
                    rows=req.page_rows,
                    max_bytes=self.bus.nc.max_payload - ARROW_REPLY_MARGIN,
                )
            )
            return self._arrow_reply(page, cursor)
        frame = await anyio.to_thread.run_sync(self.reader.frame, req.sql, req.parameters)
        rows = [[_plain(v) for v in row] for row in frame.itertuples(index=False)]
        return SqlReply(columns=[str(c) for c in frame.columns], rows=rows)

    async def _on_page(self, req: SqlPageRequest, msg: Msg) -> SqlArrowReply:
        """The next page of a result this server holds (broker.cursors)."""
        page = await anyio.to_thread.run_sync(
            functools.partial(
                self.cursors.next_page,
                req.cursor,
                rows=req.page_rows,
                max_bytes=self.bus.nc.max_payload - ARROW_REPLY_MARGIN,
            )
        )
        return self._arrow_reply(page, req.cursor if page.more else None)

    async def _on_close(self, req: SqlCloseRequest, msg: Msg) -> SqlCloseReply:
        """Release a result this server holds before its last page (broker.cursors)."""
        return SqlCloseReply(released=self.cursors.close(req.cursor))

    def _arrow_reply(self, page: ArrowPage, cursor: str | None) -> SqlArrowReply:
        return SqlArrowReply(
            arrow=page.data,
            rows=page.rows,
            more=page.more,
            cursor=cursor,
            server_id=self.server_id if cursor else None,
        )

    async def _on_eval(self, req: EvaluationRequest, msg: Msg) -> EvaluationReply:
        rows = await anyio.to_thread.run_sync(
            self.db.rows,
            "SELECT spec, summary FROM evaluations FINAL WHERE evaluation_id = {id:String}",
            {"id": req.evaluation_id},
        )
        if not rows:
            raise EvaluationNotFound(
                f"no evaluation {req.evaluation_id!r}", evaluation_id=req.evaluation_id
            )
        return EvaluationReply(spec=rows[0][0], summary=rows[0][1])


_MAX_CELL_DEPTH = 16
"""Deepest nesting of arrays, tuples and maps a cell is answered as; deeper, its text."""


def _plain(v: Any, depth: int = 0) -> Any:
    """A cell as a value a reply carries: an array or tuple as a list, a map as a map,
    each of their values the same way; what msgpack cannot carry (an Int128 or UInt256
    past 64 bits, a Decimal, a UUID, a date) as its text."""
    if isinstance(v, np.ndarray):  # an array column's cell
        v = v.tolist()
    elif hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, int) and not -(2**63) <= v < 2**64:
        return str(v)
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if depth < _MAX_CELL_DEPTH:
        if isinstance(v, list | tuple):
            return [_plain(x, depth + 1) for x in v]
        if isinstance(v, dict):
            return {str(k): _plain(x, depth + 1) for k, x in v.items()}
    return str(v)
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)
