"""The per-query wire path without pydantic agrees with the contracts it stands for."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from mlscope import codec, wire
from mlscope.contracts import ErrorReply, Query, QueryReply, SamplesQuery
from mlscope.errors import EvaluationError, OverloadedError, WireError

X = np.arange(12, dtype=np.float32).reshape(3, 4)
EMPTY_BATCH = np.empty((1 << 40, 0), np.float32)


def test_a_query_encodes_to_the_contracts_bytes() -> None:
    options: list[dict[str, Any]] = [
        {},
        {"raw": True, "labels": True, "more_inputs": (np.zeros(2, np.int64),)},
    ]
    for kw in options:
        fast = wire.encode_query("ev-1", 7, X, 2, **kw)
        slow = codec.encode_model(
            Query(evaluation_id="ev-1", index=7, inputs=X, trace_level=2, **kw)
        )
        assert fast == slow
    with pytest.raises(WireError, match="no field"):
        wire.encode_query("ev-1", 7, X, 2, colour="red")


def test_a_samples_query_encodes_to_the_contracts_bytes() -> None:
    for samples in (np.array([3, 1, 4], np.int64), np.zeros(0, np.int64)):
        fast = wire.encode_samples_query("ev-1", 9, samples)
        slow = codec.encode_model(SamplesQuery(evaluation_id="ev-1", index=9, samples=samples))
        assert fast == slow


def test_a_reply_encodes_to_the_contracts_bytes() -> None:
    replies = [
        QueryReply(index=3, ok=True, outputs=np.array([[4, 1]]), t_received=1, t_replied=9),
        QueryReply(index=4, ok=False, error={"code": "inference", "message": "boom"}),
        QueryReply(index=5, ok=True, outputs=X, raw_outputs=X, labels=np.array(["a", "b"])),
    ]
    for r in replies:
        assert wire.encode_reply(r) == codec.encode_model(r)


def test_a_decoded_query_has_the_contracts_values() -> None:
    data = codec.encode_model(Query(evaluation_id="ev-2", index=11, inputs=X, raw=True))
    got = wire.decode_query(data)
    want = codec.decode_model(Query, data)
    for name in ("evaluation_id", "index", "trace_level", "raw", "labels"):
        assert getattr(got, name) == getattr(want, name)
    assert np.array_equal(got.inputs, want.inputs) and got.more_inputs == ()
    # Defaults, as the contract's, for fields a sender left out.
    short = codec.encode({"evaluation_id": "e", "index": 1.0, "inputs": X})
    q = wire.decode_query(short)
    default_level = Query.model_fields["trace_level"].default
    assert (q.index, q.trace_level, q.raw, q.labels) == (1, default_level, False, False)


BAD: list[tuple[Any, str]] = [
    ([1, 2], "map"),
    ("text", "map"),
    ({"evaluation_id": "e", "index": 0, "inputs": X, "extra": 1}, "unexpected"),
    ({"evaluation_id": "e", "index": 0, "inputs": X, "x" * 500: 1}, "unexpected"),
    ({"evaluation_id": 3, "index": 0, "inputs": X}, "evaluation_id"),
    ({"index": 0, "inputs": X}, "evaluation_id"),
    ({"evaluation_id": "e", "index": "zero", "inputs": 1}, "index"),
    ({"evaluation_id": "e", "index": 1.5, "inputs": X}, "index"),
    ({"evaluation_id": "e", "index": -1, "inputs": X}, "index"),
    ({"evaluation_id": "e", "index": 2**64 - 1, "inputs": X}, "index"),
    ({"evaluation_id": "e", "index": 2**63, "inputs": X}, "index"),
    ({"evaluation_id": "e", "index": 1e30, "inputs": X}, "index"),
    ({"evaluation_id": "e" * 5000, "index": 0, "inputs": X}, "evaluation_id"),
    ({"evaluation_id": "e", "index": 0, "inputs": [1, 2]}, "inputs"),
    # More samples than a batch holds, in a few bytes: an empty array's axes cost none,
    # and the agent would fill the model's other inputs for every sample it declares.
    ({"evaluation_id": "e", "index": 0, "inputs": EMPTY_BATCH}, "inputs"),
    ({"evaluation_id": "e", "index": 0}, "inputs"),
    ({"evaluation_id": "e", "index": 0, "inputs": X, "raw": [True]}, "raw"),
    ({"evaluation_id": "e", "index": 0, "inputs": X, "trace_level": [1]}, "trace_level"),
    ({"evaluation_id": "e", "index": 0, "inputs": X, "trace_level": -1}, "trace_level"),
    ({"evaluation_id": "e", "index": 0, "inputs": X, "trace_level": 2**64 - 1}, "trace_level"),
    ({"evaluation_id": "e", "index": 0, "inputs": X, "more_inputs": 5}, "more_inputs"),
    ({"evaluation_id": "e", "index": 0, "inputs": X, "more_inputs": [1]}, "more_inputs"),
    ({"evaluation_id": "e", "index": 0, "inputs": X, "kind": "reply"}, "kind"),
    ({"evaluation_id": "e", "index": 0, "inputs": X, "schema": "one"}, "schema"),
]


@pytest.mark.parametrize(("msg", "field"), BAD)
def test_what_the_contract_refuses_is_refused_with_a_wire_error(msg: Any, field: str) -> None:
    data = codec.encode(msg)
    with pytest.raises(WireError):
        codec.decode_model(Query, data)  # the contract refuses it too
    with pytest.raises(WireError, match=field) as info:
        wire.decode_query(data)
    assert len(str(info.value)) < 400  # never the hostile input echoed back


def test_bytes_that_are_not_a_message_are_a_wire_error() -> None:
    for data in (b"", b"\xc1", msgpack.packb([[[[1]]]]) + b"\x00", b"\x81" * 10_000):
        with pytest.raises(WireError):
            wire.decode_query(data)


@pytest.mark.parametrize(
    "extra",
    [
        {"index": True},
        {"index": "7"},
        {"raw": "yes"},
        {"labels": 2},
        {"trace_level": "1"},
        {"more_inputs": [X] * 100},  # more inputs than any model takes
    ],
)
def test_the_check_is_stricter_than_the_contracts_lax_mode(extra: dict[str, Any]) -> None:
    """No numbers or booleans made from strings or other types on the hot path, and no
    list of further inputs longer than any model's."""
    data = codec.encode({"evaluation_id": "e", "index": 0, "inputs": X, **extra})
    with pytest.raises(WireError, match=next(iter(extra))):
        wire.decode_query(data)


def test_a_read_reply_has_the_contracts_values() -> None:
    out = np.array([[3, 1, 2]], np.int64)
    answered = QueryReply(
        index=7,
        ok=True,
        outputs=out,
        t_received=10,
        t_predict_start=20,
        t_predict_end=30,
        t_replied=40,
    )
    view = wire.read_reply(wire.encode_reply(answered))
    assert (view.index, view.ok, view.error, view.refused) == (7, True, "", False)
    assert view.agent_ns == (10, 20, 30, 40)
    np.testing.assert_array_equal(view.outputs, out)

    failed = QueryReply(index=8, ok=False, error={"code": "predict_failed", "message": "boom"})
    view = wire.read_reply(codec.encode_model(failed))
    assert (view.index, view.ok, view.error, view.agent_ns) == (8, False, "boom", (0, 0, 0, 0))

    for exc, refused in (
        (OverloadedError("queue full", index=9), True),
        (EvaluationError("no", index=9), False),
    ):
        view = wire.read_reply(codec.encode_model(ErrorReply(error=exc.to_wire())))
        assert (view.index, view.ok, view.error, view.refused) == (9, False, exc.message, refused)


@pytest.mark.parametrize(
    "times",
    [
        (10, 20, 5, 40),  # predict ends before it starts: negative compute
        (30, 20, 25, 40),  # predicted before it arrived: negative queueing
        (10, 20, 30, 25),  # replied before the predict ended
        (-5, 20, 30, 40),  # before the clock's zero
        (10, 20, 30, 2**63),  # past the Int64 columns that store them
        (10**15, 0, -(10**15), -(10**15)),
    ],
)
def test_an_answer_with_impossible_times_is_a_failed_query(times: tuple[int, ...]) -> None:
    """Times no agent's clock can produce (out of order, negative, past Int64) would
    become negative compute or transport in a VALID summary, or overflow the columns:
    the query counts as failed, with the reason, and its outputs are not read."""
    t_received, t_start, t_end, t_replied = times
    msg = {
        "kind": "reply",
        "index": 3,
        "ok": True,
        "outputs": np.zeros((1, 1), np.int64),
        "t_received": t_received,
        "t_predict_start": t_start,
        "t_predict_end": t_end,
        "t_replied": t_replied,
    }
    view = wire.read_reply(codec.encode(msg))
    assert (view.index, view.ok, view.error, view.refused) == (
        3,
        False,
        wire.DISORDERED_TIMES,
        False,
    )
    assert (view.agent_ns, view.outputs) == ((0, 0, 0, 0), None)
    equal = {**msg, "t_received": 7, "t_predict_start": 7, "t_predict_end": 7, "t_replied": 7}
    assert wire.read_reply(codec.encode(equal)).ok  # equal times are possible (a fast model)


def test_an_agent_span_past_the_round_trip_fails_the_answer() -> None:
    """The agent's span (received to replied) must fit in the round trip the load
    generator measured for the query, give or take two clocks' rates; an answer past it
    is a failed query without times, an error reply stays as it was."""
    msg = {
        "kind": "reply",
        "index": 3,
        "ok": True,
        "outputs": np.zeros((1, 1), np.int64),
        "t_received": 1_000,
        "t_predict_start": 2_000,
        "t_predict_end": 3_000,
        "t_replied": 1_000 + 2_000_000,  # a 2 ms span
    }
    view = wire.read_reply(codec.encode(msg))
    assert view.within(2_000_000) is view  # as long as the round trip
    assert view.within(1_980_000).ok  # within the clocks' slack (2 µs + 20 µs)
    failed = view.within(1_900_000)
    assert (failed.index, failed.ok, failed.error, failed.refused) == (
        3,
        False,
        wire.AGENT_SPAN_TOO_LONG,
        False,
    )
    assert (failed.agent_ns, failed.outputs) == ((0, 0, 0, 0), None)
    huge = {**msg, "t_received": 0, "t_replied": 2**63 - 1}  # ordered, yet no round trip
    assert not wire.read_reply(codec.encode(huge)).within(10**9).ok
    refused = wire.read_reply(
        codec.encode_model(ErrorReply(error=OverloadedError("full", index=3).to_wire()))
    )
    assert refused.within(0) is refused
    columns = wire.agent_span_fits(
        np.array([0, 0, 0]), np.array([10, 10**6, 10**9]), np.array([10, 10**6, 10**6])
    )
    assert columns.tolist() == [True, True, False]


def test_a_failure_without_words_is_still_a_failure() -> None:
    """An empty message never reads as an answer."""
    for msg in (
        {"kind": "reply", "index": 1, "ok": False, "error": {"message": ""}},
        {"kind": "reply", "index": 1, "ok": False},
        {"kind": "error", "error": {"message": "", "fields": {"index": 1}}},
    ):
        view = wire.read_reply(codec.encode(msg))
        assert (view.index, view.ok, view.error) == (1, False, "error")


@pytest.mark.parametrize(
    "msg",
    [
        [1, 2, 3],
        "reply",
        {"kind": "reply", "ok": True},
        {"kind": "reply", "index": "x", "ok": True},
        {"kind": "reply", "index": 1, "ok": True, "t_received": [1]},
        {"kind": "reply", "index": 1, "ok": True},
        {"kind": "reply", "index": 1, "ok": False, "error": "a string"},
        {"kind": "error", "error": "a string"},
        {"kind": "error", "error": {"fields": {"index": {"deep": 1}}}},
        {"kind": "error"},
    ],
)
def test_what_cannot_be_read_as_a_reply_raises(msg: Any) -> None:
    """The caller's link counts it as unreadable; nothing is settled from it."""
    with pytest.raises((KeyError, TypeError, ValueError, AttributeError)):
        wire.read_reply(codec.encode(msg))
