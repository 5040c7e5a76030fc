"""What one trace batch must be to store (:mod:`broker.ingest` stores it): a span or
sample batch that validates, from its own agent's subject, every column of the table's
type with strings within their bounds, dictionary indices within their words, times on
an agent's monotonic clock, and, naming an evaluation stored already, from the agent
that evaluation ran on. Anything else is a :class:`~mlscope.errors.WireError` that the
ingester dead-letters."""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import Field, TypeAdapter, ValidationError

from broker.ingest_columns import codes_of
from mlscope import codec, names, schema
from mlscope.contracts import SampleBatch, SpanBatch
from mlscope.errors import WireError

__all__ = ["TIME_LIMIT_NS", "check_agent", "decode"]

_SPAN_FIELDS = tuple(c.name for c in schema.SPAN_FIELDS)
_SAMPLE_FIELDS = tuple(c.name for c in schema.SAMPLE_FIELDS)
TIME_LIMIT_NS = 1 << 62
"""Span and sample times are below this (an agent's monotonic clock, ns)."""
_U64 = Annotated[int, Field(strict=True, ge=0, lt=1 << 64)]
_I64 = Annotated[int, Field(strict=True, ge=-(1 << 63), lt=1 << 63)]
_U8 = Annotated[int, Field(strict=True, ge=0, lt=256)]
_F64 = Annotated[float, Field(allow_inf_nan=True)]
_LIST_OF: dict[str, TypeAdapter[Any]] = {
    "UInt64": TypeAdapter(list[_U64]),
    "Int64": TypeAdapter(list[_I64]),
    "UInt8": TypeAdapter(list[_U8]),
    "Float64": TypeAdapter(list[_F64]),
}
"""A numeric column of each ClickHouse type, as the Python values that insert into it."""


def _column_type(c: schema.Column) -> TypeAdapter[Any]:
    if c.base_type != "String":
        return _LIST_OF[c.base_type]
    bound = schema.STRING_BOUNDS[c.name]  # every string an agent writes has one
    return TypeAdapter(list[Annotated[str, Field(strict=True, max_length=bound)]])


_FIELDS = (*schema.SPAN_FIELDS, *schema.SAMPLE_FIELDS)
_COLUMN_TYPES: dict[str, TypeAdapter[Any]] = {c.name: _column_type(c) for c in _FIELDS}
"""Each column's type as its table stores it, strings within their bound: a value that
would fail the insert (or store a megabyte per row) is refused at decoding, so it never
takes a whole fetch down with it."""
_STRINGS = frozenset(c.name for c in _FIELDS if c.base_type == "String")
_BATCHES: dict[str, type[SpanBatch] | type[SampleBatch]] = {
    "spans": SpanBatch,
    "samples": SampleBatch,
}


def decode(data: bytes, subject: str) -> tuple[SpanBatch | SampleBatch, dict[str, np.ndarray]]:
    """A checked batch and its dictionary-encoded columns' indices (as arrays).

    A batch is stored only from its own agent's subject: the stream keeps it under
    :func:`mlscope.names.stored_traces` of the agent whose subject it was published on
    (or, stored before the stream had that transform, under
    :func:`mlscope.names.traces` of the evaluation and agent). An agent's own user may
    publish only on its own trace subjects, and the hub sources an edge buffer's
    batches of the edge's agent only, keeping their subject, so no batch writes rows
    in another agent's name."""
    raw = codec.decode(data)
    cls = _BATCHES.get(raw.get("kind", "")) if isinstance(raw, dict) else None
    if cls is None:
        raise WireError("not a span or sample batch")
    try:
        batch = cls.model_validate(raw)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise WireError(f"invalid {cls.__name__}: {exc}") from exc
    if subject not in (
        names.stored_traces(batch.agent_id),
        names.traces(batch.evaluation_id, batch.agent_id),
    ):
        raise WireError(
            f"{cls.__name__} {batch.batch_id}: stored as {subject[:300]!r}, not under the "
            "trace subject of the agent it names"
        )
    fields = _SPAN_FIELDS if cls is SpanBatch else _SAMPLE_FIELDS
    n = len(batch)
    if any(len(batch.columns.get(f, ())) != n for f in fields):
        raise WireError(f"{cls.__name__} {batch.batch_id}: missing or ragged columns")
    codes: dict[str, np.ndarray] = {}
    for f in fields:
        if f in batch.dicts:
            codes[f] = _dictionary_column(batch, f)
        else:
            _check(batch, f, batch.columns[f], what="row")
    _check_times(batch)
    return batch, codes


def check_agent(batch: SpanBatch | SampleBatch, ran_on: dict[str, str]) -> None:
    """A batch naming a stored evaluation is stored only from the agent it ran on
    (``ran_on``: evaluation id -> agent, as the ingester read them for its fetch): an
    agent's credentials let it publish under any evaluation id, in its own name."""
    agent = ran_on.get(batch.evaluation_id)
    if agent is not None and agent != batch.agent_id:
        raise WireError(
            f"{type(batch).__name__} {batch.batch_id}: evaluation {batch.evaluation_id} ran "
            f"on agent {agent}, not on {batch.agent_id}, which sent it",
            evaluation_id=batch.evaluation_id,
            agent_id=batch.agent_id,
            ran_on=agent,
        )


def _check_times(batch: SpanBatch | SampleBatch) -> None:
    """Times on an agent's monotonic clock: ``0 <= start <= end < 2**62`` ns (146 years
    since its boot), so no stored duration is negative or wraps when taken."""
    if isinstance(batch, SpanBatch):
        start = np.asarray(batch.columns["start_ns"], np.int64)
        end = np.asarray(batch.columns["end_ns"], np.int64)
        bad = (start < 0) | (end < start) | (end >= TIME_LIMIT_NS)
        what = "times must be 0 <= start_ns <= end_ns < 2**62"
    else:
        ts = np.asarray(batch.columns["ts_ns"], np.int64)
        bad = (ts < 0) | (ts >= TIME_LIMIT_NS)
        what = "ts_ns must be 0 <= ts_ns < 2**62"
    if bad.any():
        row = int(np.argmax(bad))
        raise WireError(f"{type(batch).__name__} {batch.batch_id}: {what} at row {row}")


def _dictionary_column(batch: SpanBatch | SampleBatch, f: str) -> np.ndarray:
    """A dictionary-encoded string column's indices, checked against its values."""
    name = type(batch).__name__
    if f not in _STRINGS:
        raise WireError(f"{name} {batch.batch_id}: column {f} is not a string column", column=f)
    values = batch.dicts[f]
    _check(batch, f, values, what="dictionary word")
    codes = codes_of(batch.columns[f], len(values))
    if codes is None:
        raise WireError(
            f"{name} {batch.batch_id}: column {f}: indices must be integers below {len(values)}",
            column=f,
        )
    return codes


def _check(batch: SpanBatch | SampleBatch, f: str, values: list[Any], *, what: str) -> None:
    """``values`` (a column's rows, or its dictionary's words: ``what``) are of the
    column's type, strings within its bound."""
    try:
        _COLUMN_TYPES[f].validate_python(values)
    except ValidationError as exc:
        first = exc.errors(include_url=False, include_input=False)[0]
        at = f"{type(batch).__name__} {batch.batch_id}: column {f}: {what} {first['loc'][0]}"
        if first["type"] == "string_too_long":
            bound = schema.STRING_BOUNDS[f]
            chars = len(values[int(first["loc"][0])])
            raise WireError(
                f"{at}: {chars} characters, over the bound of {bound} "
                f"(mlscope.schema.STRING_BOUNDS[{f!r}])",
                column=f,
                bound=bound,
                chars=chars,
            ) from exc
        raise WireError(f"{at}: {first['msg']}", column=f) from exc
