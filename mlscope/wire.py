"""The per-query hot path on the wire: :class:`~mlscope.contracts.Query` and
:class:`~mlscope.contracts.QueryReply` without pydantic.

A served run sends every query and every reply through these functions, a thousand or
more a second. Pydantic validation and ``model_dump`` cost tens of µs per message, so
the trusted sides (a load generator building its queries, an agent building its
replies, a load generator reading them) use plain msgpack maps with the contracts'
field names, and the one untrusted side (an agent reading a query off the bus) checks
the structure with :func:`decode_query`: the same fields, types and rules as the
contract (``extra="forbid"``, a numpy array where the contract has ``NDArray``), each
failure a :class:`~mlscope.errors.WireError` naming the field; it is stricter where
pydantic's lax mode is generous (no numbers or booleans from strings). The contracts stay the
definition: ``tests/test_wire.py`` checks that both paths accept and refuse the same
messages and produce the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mlscope import codec
from mlscope.contracts import (
    MAX_BATCH,
    MAX_ID_CHARS,
    QUERY_INDEX_LIMIT,
    SCHEMA,
    QueryReply,
    TraceLevel,
)
from mlscope.errors import OverloadedError, WireError

__all__ = [
    "AGENT_SPAN_TOO_LONG",
    "AGENT_TIME_LIMIT",
    "DISORDERED_TIMES",
    "QueryView",
    "ReplyView",
    "agent_span_fits",
    "agent_times_ordered",
    "decode_query",
    "encode_query",
    "encode_reply",
    "encode_samples_query",
    "read_reply",
]

_QUERY_FIELDS = frozenset(("schema", "kind", "evaluation_id", "index", "inputs")) | frozenset(
    ("trace_level", "raw", "labels", "more_inputs", "schema_")
)
_DEFAULT_LEVEL = int(TraceLevel.MODEL)
"""``Query.trace_level``'s default."""
_MAX_MORE_INPUTS = 64
"""More further inputs than any model has: refused before they are looked at."""


def encode_query(
    evaluation_id: str, index: int, inputs: np.ndarray, trace_level: int, **extra: Any
) -> bytes:
    """The wire bytes of a :class:`Query` (``extra``: its optional fields), as
    ``codec.encode_model(Query(...))`` makes them but without validating."""
    msg = {
        "schema": SCHEMA,
        "kind": "query",
        "evaluation_id": evaluation_id,
        "index": index,
        "inputs": inputs,
        "trace_level": int(trace_level),
        "raw": bool(extra.pop("raw", False)),
        "labels": bool(extra.pop("labels", False)),
        "more_inputs": tuple(extra.pop("more_inputs", ())),
    }
    if extra:
        raise WireError(f"a query has no field(s) {sorted(extra)}")
    return codec.encode(msg)


def encode_samples_query(evaluation_id: str, index: int, samples: np.ndarray) -> bytes:
    """The wire bytes of a :class:`SamplesQuery` (``samples``: int64 data-set
    indices), as ``codec.encode_model(SamplesQuery(...))`` makes them but without
    validating."""
    msg = {
        "schema": SCHEMA,
        "kind": "samples_query",
        "evaluation_id": evaluation_id,
        "index": index,
        "samples": samples,
    }
    return codec.encode(msg)


@dataclass(slots=True)
class QueryView:
    """A checked :class:`Query`'s fields (building the model itself costs more than
    checking them: ``model_construct`` ~4 µs against ~0.3 µs for this; not frozen,
    whose construction alone costs ~1.3 µs)."""

    evaluation_id: str
    index: int
    inputs: np.ndarray
    trace_level: int
    raw: bool
    labels: bool
    more_inputs: tuple[np.ndarray, ...]


def decode_query(data: bytes) -> QueryView:
    """An untrusted query, checked field by field as the contract would, built without
    validation; every failure a WireError (never the input echoed back)."""
    raw = codec.decode(data)
    if not isinstance(raw, dict):
        raise WireError(f"invalid Query: expected a map, got {type(raw).__name__}")
    unknown = [k for k in raw if k not in _QUERY_FIELDS]
    if unknown:
        raise WireError(f"invalid Query: unexpected field(s) {_names(unknown)}")
    _int(raw.get("schema", raw.get("schema_", SCHEMA)), "schema")
    if raw.get("kind", "query") != "query":
        raise WireError("invalid Query: kind must be 'query'")
    ev, index, inputs = raw.get("evaluation_id"), raw.get("index"), raw.get("inputs")
    if not isinstance(ev, str) or len(ev) > MAX_ID_CHARS:
        raise WireError(f"invalid Query: evaluation_id must be a string of at most {MAX_ID_CHARS}")
    index = _int(index, "index")
    if not 0 <= index < QUERY_INDEX_LIMIT:
        raise WireError(f"invalid Query: index must be 0 .. {QUERY_INDEX_LIMIT - 1}")
    if not isinstance(inputs, np.ndarray):
        raise WireError("invalid Query: inputs must be a numpy array")
    if inputs.ndim and inputs.shape[0] > MAX_BATCH:  # an empty array's axes cost no bytes
        raise WireError(f"invalid Query: inputs carry at most {MAX_BATCH} samples")
    more = raw.get("more_inputs", ())
    if not isinstance(more, list | tuple) or len(more) > _MAX_MORE_INPUTS:
        raise WireError("invalid Query: more_inputs must be a short list of arrays")
    if not all(isinstance(m, np.ndarray) for m in more):
        raise WireError("invalid Query: more_inputs must hold numpy arrays")
    return QueryView(
        evaluation_id=ev,
        index=index,
        inputs=inputs,
        trace_level=_level(raw.get("trace_level", _DEFAULT_LEVEL)),
        raw=_bool(raw.get("raw", False), "raw"),
        labels=_bool(raw.get("labels", False), "labels"),
        more_inputs=tuple(more),
    )


def encode_reply(reply: QueryReply) -> bytes:
    """A reply's wire bytes, as ``codec.encode_model(reply)`` makes them, without
    ``model_dump`` (the fields are read straight from the model)."""
    return codec.encode(
        {
            "schema": SCHEMA,
            "kind": "reply",
            "index": reply.index,
            "ok": reply.ok,
            "outputs": reply.outputs,
            "error": reply.error,
            "t_received": reply.t_received,
            "t_predict_start": reply.t_predict_start,
            "t_predict_end": reply.t_predict_end,
            "t_replied": reply.t_replied,
            "raw_outputs": reply.raw_outputs,
            "labels": reply.labels,
        }
    )


@dataclass(slots=True)
class ReplyView:
    """What a load generator needs of one reply: a :class:`QueryReply` or an
    :class:`ErrorReply` for one query. One is built for every reply on a load
    generator's reader thread: not frozen, whose construction costs ~1.3 µs against
    ~0.3 µs; nothing changes it once read."""

    index: int
    """The query's index (-1 when an error reply does not name one)."""
    ok: bool
    """The agent answered it."""
    error: str
    """Why it failed (never empty then); empty when the agent answered."""
    refused: bool
    """The agent refused it (an :class:`~mlscope.errors.OverloadedError`): never run."""
    agent_ns: tuple[int, int, int, int]
    """The agent's received, predict start, predict end and replied times (its clock;
    zeros when it failed)."""
    outputs: Any
    """The answer's outputs as decoded, for the caller to check (None when it failed)."""

    def within(self, round_trip_ns: int) -> ReplyView:
        """This reply, or a failed one (:data:`AGENT_SPAN_TOO_LONG`) when it is an
        answer whose agent span does not fit in ``round_trip_ns``, the load generator's
        own measure of the query (completed - issued, its clock): what every load
        generator on the server asks of an answer before it keeps its times."""
        received, _, _, replied = self.agent_ns
        if not self.ok or agent_span_fits(received, replied, round_trip_ns):
            return self
        return ReplyView(self.index, False, AGENT_SPAN_TOO_LONG, False, _NO_TIMES, None)


_NO_TIMES = (0, 0, 0, 0)
AGENT_TIME_LIMIT = 2**63
"""An agent's times are its monotonic clock in ns, stored as Int64."""
DISORDERED_TIMES = (
    "the agent's times are out of order or out of range (received <= predict start "
    "<= predict end <= replied, each 0 .. 2**63 - 1)"
)
"""Why an answer whose times no agent can produce counts as a failed query: its
compute, queueing and transport would be negative or past the columns that store them."""


def agent_times_ordered(received: Any, start: Any, end: Any, replied: Any) -> Any:
    """The rule an agent's four times must keep (0 <= received <= predict start <=
    predict end <= replied < 2**63), for one answer's ints or, element by element, for
    columns of many (numpy arrays): the one definition both load generators and a local
    run's rows are judged by. Returns a bool, or an array of them."""
    return (
        (received >= 0)
        & (received <= start)
        & (start <= end)
        & (end <= replied)
        & (replied < AGENT_TIME_LIMIT)
    )


AGENT_SPAN_RATE_SLACK = 1000
"""The agent's clock may run faster than ours by up to 1 / this of a span (1000 ppm):
CLOCK_MONOTONIC follows NTP's frequency corrections, which the kernel bounds at
500 ppm, so two hosts' clocks differ in rate by at most that much each way."""
AGENT_SPAN_SLACK_NS = 20_000
"""And by this much whatever the span: the granularity of a coarse monotonic clock
(a few µs where it is not nanoseconds) on either side, with room to spare."""
AGENT_SPAN_TOO_LONG = (
    "the agent's span (received to replied, its clock) is longer than the round trip "
    "the load generator measured for the query (issued to completed, its clock)"
)
"""Why an answer whose agent span cannot fit in its round trip counts as a failed query:
the agent received the query after it was issued and replied before the answer came
back, so its compute and queueing, and the time the bus adds (round trip - agent
span), would be wrong, even negative."""


def agent_span_fits(received: Any, replied: Any, round_trip_ns: Any) -> Any:
    """Whether an agent's span (``replied - received``, on its clock) fits in the round
    trip the load generator measured for the same query (on its own clock), give or
    take the two clocks' rates (:data:`AGENT_SPAN_RATE_SLACK`,
    :data:`AGENT_SPAN_SLACK_NS`). Both are durations, each on one clock, so the rule
    needs no clock offset. For one answer's ints or, element by element, for numpy
    columns; a bool, or an array of them."""
    slack = round_trip_ns // AGENT_SPAN_RATE_SLACK + AGENT_SPAN_SLACK_NS
    return replied - received <= round_trip_ns + slack


def read_reply(data: bytes) -> ReplyView:
    """A reply read on the trusted side, without pydantic. What cannot be read as a
    reply (not a map, fields of the wrong type) raises here, before the caller
    touches the query it names, so a forged reply never settles a real query."""
    raw = codec.decode(data)
    if raw.get("kind") == "error":
        err = raw["error"]
        return ReplyView(
            int(err.get("fields", {}).get("index", -1)),
            False,
            str(err.get("message") or "error"),
            err.get("code") == OverloadedError.code,
            _NO_TIMES,
            None,
        )
    index = int(raw["index"])
    if raw.get("ok"):
        times = (
            int(raw["t_received"]),
            int(raw["t_predict_start"]),
            int(raw["t_predict_end"]),
            int(raw["t_replied"]),
        )
        if not agent_times_ordered(*times):
            return ReplyView(index, False, DISORDERED_TIMES, False, _NO_TIMES, None)
        return ReplyView(index, True, "", False, times, raw.get("outputs"))
    why = str((raw.get("error") or {}).get("message") or "error")
    return ReplyView(index, False, why, False, _NO_TIMES, None)


def _int(value: Any, field: str) -> int:
    """An int as pydantic's lax mode takes one: an int (not a bool) or an integral float."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise WireError(f"invalid Query: {field} must be an integer")


def _level(value: Any) -> int:
    level = _int(value, "trace_level")
    if not TraceLevel.NONE <= level <= TraceLevel.FULL:
        raise WireError(
            f"invalid Query: trace_level must be {TraceLevel.NONE} .. {TraceLevel.FULL}"
        )
    return level


def _bool(value: Any, field: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise WireError(f"invalid Query: {field} must be a boolean")


def _names(keys: list[Any]) -> str:
    """Some of the unknown keys, cut short: an error never echoes a hostile input."""
    return ", ".join(repr(k)[:40] for k in keys[:5]) + (" ..." if len(keys) > 5 else "")
