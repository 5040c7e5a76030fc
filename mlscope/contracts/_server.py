"""Requests the server answers: read-only SQL, cancellation, stored evaluations."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
)

from mlscope.contracts._base import Ident, _Message


class SqlRequest(_Message):
    """One read-only statement for the server that owns the evaluation database.

    ``format="rows"``: the whole result as msgpack rows (:class:`SqlReply`);
    ``format="arrow"``: one page of it, rows ``offset`` onwards, at most ``limit`` and
    at most what fits one message, as Arrow IPC (:class:`SqlArrowReply`)."""

    kind: Literal["sql"] = "sql"
    sql: str = Field(max_length=1 << 20)
    parameters: dict[str, Any] | None = None
    format: Literal["rows", "arrow"] = "rows"
    offset: int = Field(default=0, ge=0, le=1 << 53)
    limit: int = Field(default=100_000, ge=1, le=1 << 31)


class SqlReply(_Message):
    kind: Literal["rows"] = "rows"
    columns: list[str]
    rows: list[list[Any]]


class SqlArrowReply(_Message):
    """One page of a result: an Arrow IPC stream of ``rows`` rows; ``more`` when rows
    may follow (ask again from ``offset + rows``)."""

    kind: Literal["arrow"] = "arrow"
    arrow: bytes
    rows: int = Field(ge=0)
    more: bool


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
