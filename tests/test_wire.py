"""The per-query wire path without pydantic agrees with the contracts it stands for."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from mlscope import codec, wire
from mlscope.contracts import Query, QueryReply, SamplesQuery
from mlscope.errors import WireError

X = np.arange(12, dtype=np.float32).reshape(3, 4)


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
    ({"evaluation_id": "e", "index": 0, "inputs": [1, 2]}, "inputs"),
    ({"evaluation_id": "e", "index": 0}, "inputs"),
    ({"evaluation_id": "e", "index": 0, "inputs": X, "raw": [True]}, "raw"),
    ({"evaluation_id": "e", "index": 0, "inputs": X, "trace_level": [1]}, "trace_level"),
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
