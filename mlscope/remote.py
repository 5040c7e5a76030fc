"""Reaching the evaluation database through the process that owns it (over the bus).

chDB allows one process per data directory; the server owns it and answers
read-only SQL on ``mlscope.db.sql``. With a ClickHouse server, clients may instead
connect directly with clickhouse-connect; these functions work in both cases.
:func:`sql` returns msgpack rows (small results); :func:`arrow` reads bulk results as
Arrow IPC pages, each under the bus's max payload.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from mlscope import codec, names
from mlscope.bus import Bus, request
from mlscope.contracts import EvaluationReply, EvaluationSummary
from mlscope.errors import ConfigError, WireError

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa

__all__ = [
    "ARROW_PAGE_ROWS",
    "arrow",
    "evaluation",
    "orders_rows",
    "read_ipc",
    "sql",
    "to_frame",
]

ARROW_PAGE_ROWS = 100_000
"""Rows asked for per Arrow page; the server sends fewer when they would not fit one
message, and never more than its ``max_result_rows``."""


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


async def arrow(
    bus: Bus,
    query: str,
    parameters: dict[str, Any] | None = None,
    *,
    page_rows: int = ARROW_PAGE_ROWS,
    timeout: float = 30.0,
) -> pa.Table:
    """Run one read-only statement; the whole result as one ``pyarrow.Table``, read in
    Arrow IPC pages that each fit one message. The statement runs once per page, so
    a result longer than a page needs an ORDER BY that makes its order stable: one
    without any is refused (a ConfigError) once a second page is needed, since
    ClickHouse may give its rows in another order each time and the pages would
    repeat some rows and miss others."""
    import pyarrow as pa

    tables: list[pa.Table] = []
    offset, limit = 0, page_rows
    while True:
        reply = await request(
            bus,
            names.SQL_SUBJECT,
            codec.encode(
                {
                    "sql": query,
                    "parameters": parameters or {},
                    "format": "arrow",
                    "offset": offset,
                    "limit": limit,
                }
            ),
            timeout=timeout,
        )
        page = read_ipc(reply["arrow"])
        tables.append(page)
        rows = int(reply["rows"])
        if not reply["more"] or rows == 0:
            break
        if not orders_rows(query):
            raise ConfigError(
                f"the result is longer than one page ({rows:,} rows) and the statement "
                "has no ORDER BY: it runs again for each page, so unordered pages would "
                "repeat some rows and miss others; add an ORDER BY on a unique key "
                "(queries: evaluation_id, query_index; spans: evaluation_id, span_id)",
                argument="sql",
            )
        offset += rows
        limit = rows if rows < limit else limit  # what fits one message: ask for that
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|`[^`]*`|\"[^\"]*\"|--[^\n]*|/\*.*?\*/", re.S)
_PARENS = re.compile(r"\([^()]*\)")
_ORDER_BY = re.compile(r"\border\s+by\b", re.I)


def orders_rows(query: str) -> bool:
    """Whether ``query`` orders its result: an ORDER BY outside any parentheses (one in
    a subquery or a window orders nothing of the outer result), quotes and comments
    set aside."""
    text = _QUOTED.sub(" ", query)
    while (flat := _PARENS.sub(" ", text)) != text:
        text = flat
    return _ORDER_BY.search(text) is not None


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
