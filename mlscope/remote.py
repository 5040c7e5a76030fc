"""Reaching the evaluation database through the process that owns it (over the bus).

chDB allows one process per data directory; the server owns it and answers
read-only SQL on ``mlscope.db.sql``. With a ClickHouse server, clients may instead
connect directly with clickhouse-connect; these functions work in both cases.
:func:`sql` returns msgpack rows (small results); :func:`arrow` and
:func:`arrow_pages` read bulk results as Arrow IPC pages, each under the bus's max
payload, of one execution of the statement held by the server between pages (and
released as soon as a reader stops before the last one).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import ValidationError

from mlscope import codec, names
from mlscope.bus import Bus, request
from mlscope.contracts import (
    EvaluationReply,
    EvaluationSummary,
    SqlArrowReply,
    SqlCloseReply,
    SqlCloseRequest,
)
from mlscope.errors import BusError, CursorNotFound, MLScopeError, QueryRefused, WireError

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

__all__ = [
    "ARROW_PAGE_ROWS",
    "CLOSE_TIMEOUT_S",
    "KEYSET_ROWS",
    "arrow",
    "arrow_pages",
    "close_cursor",
    "evaluation",
    "fewer_rows",
    "keyset_pages",
    "keyset_sql",
    "read_ipc",
    "sql",
    "to_frame",
]

ARROW_PAGE_ROWS = 100_000
"""Rows asked for per Arrow page; the server sends fewer when they would not fit one
message."""


async def sql(
    bus: Bus, query: str, parameters: dict[str, Any] | None = None, *, timeout: float = 30.0
) -> tuple[list[str], list[list[Any]]]:
    """Run one read-only statement; returns (column names, rows)."""
    reply = await request(
        bus,
        names.SQL_SUBJECT,
        codec.encode({"sql": query, "parameters": parameters or {}}),
        timeout=timeout,
    )
    return list(reply["columns"]), [list(r) for r in reply["rows"]]


async def arrow_pages(
    bus: Bus,
    query: str,
    parameters: dict[str, Any] | None = None,
    *,
    page_rows: int = ARROW_PAGE_ROWS,
    timeout: float = 30.0,
) -> AsyncGenerator[pa.Table, None]:
    """Run one read-only statement once; its result page by page, each page an Arrow
    IPC message under the bus's max payload (at least one page, with the result's
    columns, even when it has no rows).

    The server holds the result of that one execution for its pages (a cursor on the
    replica that ran it), so the pages are consistent for any statement, ordered or
    not. A consumer that stops early should close the iterator
    (``contextlib.aclosing``, or ``await pages.aclose()``): stopping before the last
    page, however (closed, failed, cancelled), releases the rest on the server at once
    (:func:`close_cursor`) rather than leave it held until it expires. A DatabaseError
    (:class:`~mlscope.errors.CursorNotFound`) when the rest expired first, or the
    server holding it is gone."""
    reply = await _arrow_reply(
        bus,
        names.SQL_SUBJECT,
        {"sql": query, "parameters": parameters or {}, "format": "arrow", "page_rows": page_rows},
        timeout,
    )
    try:
        yield read_ipc(reply.arrow)
        while reply.more:
            reply = await _next_page(bus, reply, page_rows, timeout)
            yield read_ipc(reply.arrow)
    finally:
        if reply.more and reply.cursor is not None and reply.server_id is not None:
            await close_cursor(bus, reply.server_id, reply.cursor)


async def _next_page(
    bus: Bus, reply: SqlArrowReply, page_rows: int, timeout: float
) -> SqlArrowReply:
    """The page after ``reply``, asked of the server holding the rest."""
    if reply.cursor is None or reply.server_id is None:
        raise WireError("an Arrow page says more rows follow but names no cursor")
    subject = names.sql_pages(reply.server_id)
    try:
        return await _arrow_reply(
            bus, subject, {"cursor": reply.cursor, "page_rows": page_rows}, timeout
        )
    except BusError as exc:
        raise CursorNotFound(
            f"the server holding the rest of the result ({reply.server_id}) does not "
            f"answer: {exc.message}; run the statement again",
            server_id=reply.server_id,
        ) from exc


CLOSE_TIMEOUT_S = 2.0
"""Longest a reader that stops early waits for the server to release its cursor."""


async def close_cursor(bus: Bus, server_id: str, cursor: str) -> bool:
    """Ask server ``server_id`` to release the result it holds under ``cursor`` (its
    reader stopped before the last page); whether it held it. Shielded, so that a
    cancelled reader still releases it, and never raises: a server that does not answer
    drops the result anyway when it has been idle for its expiry."""
    with anyio.move_on_after(CLOSE_TIMEOUT_S, shield=True), contextlib.suppress(MLScopeError):
        reply = await request(
            bus,
            names.sql_close(server_id),
            codec.encode_model(SqlCloseRequest(cursor=cursor)),
            timeout=CLOSE_TIMEOUT_S,
        )
        return codec.validate(SqlCloseReply, reply).released
    return False


async def arrow(
    bus: Bus,
    query: str,
    parameters: dict[str, Any] | None = None,
    *,
    page_rows: int = ARROW_PAGE_ROWS,
    timeout: float = 30.0,
) -> pa.Table:
    """Run one read-only statement once; the whole result as one ``pyarrow.Table``,
    read in pages (:func:`arrow_pages`)."""
    import pyarrow as pa

    pages = arrow_pages(bus, query, parameters, page_rows=page_rows, timeout=timeout)
    async with contextlib.aclosing(pages):
        tables = [page async for page in pages]
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


async def _arrow_reply(
    bus: Bus, subject: str, body: dict[str, Any], timeout: float
) -> SqlArrowReply:
    reply = await request(bus, subject, codec.encode(body), timeout=timeout)
    return codec.validate(SqlArrowReply, reply)


KEYSET_ROWS = 50_000
"""Rows per statement of a keyset read (halved while a frame is over what the server
holds for one result, ``max_paged_bytes``)."""


def keyset_sql(
    select: str,
    key: Sequence[tuple[str, str]],
    *,
    rows: int,
    last: Mapping[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """One frame of a keyset read, and the parameters it adds: ``select`` (a SELECT
    ending in its WHERE clause: no ORDER BY or LIMIT) ordered by ``key`` ((column,
    ClickHouse type) pairs, unique over its rows, each a column of its result), at most
    ``rows`` rows, starting right after row ``last`` (None: from the first). Each frame
    is a statement of its own and costs the same however deep into the table it starts
    (an OFFSET would read every earlier row again), so a table of any length is read
    without the server or the reader holding more than a frame of it."""
    cols = ", ".join(c for c, _ in key)
    tail = f" ORDER BY {cols} LIMIT {int(rows)}"
    if last is None:
        return select + tail, {}
    bound = ", ".join(f"{{_k{i}:{t}}}" for i, (_, t) in enumerate(key))
    params = {f"_k{i}": _scalar(last[c]) for i, (c, _) in enumerate(key)}
    return f"{select} AND ({cols}) > ({bound}){tail}", params


def fewer_rows(exc: QueryRefused, rows: int) -> int:
    """Rows to ask a keyset frame again in after ``exc``: half as many where the frame
    was over what the server holds for one result; ``exc`` itself otherwise."""
    if exc.fields.get("limit") != "max_paged_bytes" or rows <= 1:
        raise exc
    return rows // 2


async def keyset_pages(
    bus: Bus,
    select: str,
    parameters: dict[str, Any],
    key: Sequence[tuple[str, str]],
    *,
    rows: int = KEYSET_ROWS,
    timeout: float = 30.0,
) -> AsyncIterator[pa.Table]:
    """Every row of ``select`` in frames of at most ``rows`` (:func:`keyset_sql`), each
    read with :func:`arrow`; at least one frame, which may be empty."""
    last: dict[str, Any] | None = None
    while True:
        sql, bound = keyset_sql(select, key, rows=rows, last=last)
        try:
            table = await arrow(
                bus,
                sql,
                {**parameters, **bound},
                page_rows=min(rows, ARROW_PAGE_ROWS),
                timeout=timeout,
            )
        except QueryRefused as exc:
            rows = fewer_rows(exc, rows)
            continue
        yield table
        if table.num_rows < rows:
            return
        last = table.slice(table.num_rows - 1).to_pylist()[0]


def _scalar(value: Any) -> Any:
    """A value of a row (numpy's or Arrow's) as a plain Python one: a parameter."""
    return value.item() if hasattr(value, "item") else value


def read_ipc(data: bytes) -> pa.Table:
    """An Arrow IPC stream (one page of a result) as a table."""
    import pyarrow as pa

    with pa.ipc.open_stream(pa.py_buffer(data)) as reader:
        return reader.read_all()


def to_frame(table: pa.Table) -> pd.DataFrame:
    """A result table as the frame clickhouse-connect's ``query_df`` gives: times
    without a zone (UTC), so reads over the bus and direct reads look the same."""
    import pandas as pd

    frame = table.to_pandas()
    for name in frame.columns:
        col = frame[name]
        if isinstance(col.dtype, pd.DatetimeTZDtype):
            frame[name] = col.dt.tz_convert("UTC").dt.tz_localize(None)
    return frame


async def evaluation(
    bus: Bus, evaluation_id: str, *, timeout: float = 10.0
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(specification, summary) of one stored evaluation: a DatabaseError when none is
    stored, a WireError when the reply or its JSON is not what the server sends."""
    reply = codec.validate(
        EvaluationReply,
        await request(
            bus,
            names.EVALUATION_SUBJECT,
            codec.encode({"evaluation_id": evaluation_id}),
            timeout=timeout,
        ),
    )
    try:
        spec, summary = json.loads(reply.spec), json.loads(reply.summary)
    except ValueError as exc:
        raise WireError(f"evaluation {evaluation_id}: stored JSON unreadable: {exc}") from exc
    if not isinstance(spec, dict) or not isinstance(summary, dict):
        raise WireError(f"evaluation {evaluation_id}: its stored spec or summary is no object")
    return spec, summary


async def stored_summary(
    bus: Bus, evaluation_id: str, *, timeout: float = 10.0
) -> EvaluationSummary:
    """The stored summary of one evaluation: a DatabaseError when none is stored, a
    WireError when the stored one is not a summary this version reads."""
    _, summary = await evaluation(bus, evaluation_id, timeout=timeout)
    try:
        return EvaluationSummary.model_validate(summary)
    except ValidationError as exc:
        why = str(exc.errors(include_url=False, include_input=False))[: codec.MAX_ERROR_CHARS]
        raise WireError(
            f"evaluation {evaluation_id}: its stored summary is not one this version of "
            f"mlscope reads: {why}"
        ) from exc
