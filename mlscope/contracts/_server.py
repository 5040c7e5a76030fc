"""Requests the server answers: read-only SQL, cancellation, stored evaluations."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
)

from mlscope.contracts._base import CursorId, Ident, _Message


class SqlRequest(_Message):
    """One read-only statement for the server that owns the evaluation database.

    ``format="rows"``: the whole result as msgpack rows (:class:`SqlReply`);
    ``format="arrow"``: the statement runs once and its result comes in pages, each
    at most ``page_rows`` rows and at most what fits one message, as Arrow IPC: the
    first in the reply (:class:`SqlArrowReply`), the rest by cursor
    (:class:`SqlPageRequest`)."""

    kind: Literal["sql"] = "sql"
    sql: str = Field(max_length=1 << 20)
    parameters: dict[str, Any] | None = None
    format: Literal["rows", "arrow"] = "rows"
    page_rows: int = Field(default=100_000, ge=1, le=1 << 31)


class SqlReply(_Message):
    kind: Literal["rows"] = "rows"
    columns: list[str]
    rows: list[list[Any]]


class SqlArrowReply(_Message):
    """One page of a result: an Arrow IPC stream of ``rows`` rows. ``more`` when rows
    follow: then ``cursor`` names the rest of this one execution's result, held by
    server ``server_id``, whose page subject (``mlscope.names.sql_pages``) serves it."""

    kind: Literal["arrow"] = "arrow"
    arrow: bytes
    rows: int = Field(ge=0)
    more: bool
    cursor: CursorId | None = None
    server_id: Ident | None = None


class SqlPageRequest(_Message):
    """The next page of a held result (``mlscope.db.sql.page.<server_id>``), at most
    ``page_rows`` rows and at most what fits one message; answered with a
    :class:`SqlArrowReply` (its ``cursor`` set while rows follow)."""

    kind: Literal["sql_page"] = "sql_page"
    cursor: CursorId
    page_rows: int = Field(default=100_000, ge=1, le=1 << 31)


class SqlCloseRequest(_Message):
    """Release a held result before its last page (``mlscope.db.sql.close.<server_id>``,
    the server holding it): a reader that stops early frees it at once instead of
    leaving it to expire. Answered with a :class:`SqlCloseReply`; a cursor that is not
    held (never opened there, read to its end, expired, closed already) is no error."""

    kind: Literal["sql_close"] = "sql_close"
    cursor: CursorId


class SqlCloseReply(_Message):
    kind: Literal["sql_closed"] = "sql_closed"
    released: bool
    """Whether the server held the result (False: there was nothing to release)."""


class CancelRequest(_Message):
    """Stop a job (``mlscope.job.<job_id>.cancel``): the server running it cancels the
    run and stores it as ``cancelled``; a server that takes it later does not run it."""

    kind: Literal["cancel_request"] = "cancel_request"
    job_id: Ident
    reason: str = Field(default="cancelled by the user", max_length=1024)


class CancelReply(_Message):
    """From the server that was running the job, once its cancelled run is stored."""

    kind: Literal["cancel_reply"] = "cancel_reply"
    job_id: Ident
    evaluation_id: Ident
    server_id: Ident


class EvaluationRequest(_Message):
    kind: Literal["evaluation_request"] = "evaluation_request"
    evaluation_id: Ident


class EvaluationReply(_Message):
    kind: Literal["evaluation"] = "evaluation"
    spec: str
    summary: str
