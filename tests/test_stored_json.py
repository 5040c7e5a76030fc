""":func:`analysis.data.stored_json`, the one reader of a stored ``spec`` or ``summary``:
a JSON object comes back as it is; anything else, text nested past
:data:`analysis.data.STORED_MAX_DEPTH` included (refused before json's recursive parser
runs), is one DatabaseError line naming the evaluation and the column."""

from __future__ import annotations

import json

import pytest

from analysis.data import STORED_MAX_DEPTH as MAX_DEPTH
from analysis.data import stored_json
from mlscope import bounded
from mlscope.errors import DatabaseError


def nested(depth: int) -> str:
    """An object whose brackets nest ``depth`` levels."""
    return '{"a":' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def test_an_object_at_the_limit_is_read() -> None:
    assert stored_json("ev-1", "spec", nested(MAX_DEPTH)) == json.loads(nested(MAX_DEPTH))


def test_a_spec_holding_the_deepest_manifest_is_read() -> None:
    """A manifest may nest bounded.MAX_DEPTH levels; the spec that stores it is deeper."""
    spec = json.dumps({"job": {}, "manifest": json.loads(nested(bounded.MAX_DEPTH))})
    assert stored_json("ev-1", "spec", spec)["manifest"] == json.loads(nested(bounded.MAX_DEPTH))


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 100_000])
def test_deeper_than_the_limit_is_one_line(depth: int) -> None:
    with pytest.raises(DatabaseError) as info:
        stored_json("ev-1", "summary", nested(depth))
    assert str(info.value) == (
        f"evaluation ev-1: its stored summary is JSON nested deeper than {MAX_DEPTH} levels"
    )
    assert info.value.fields == {"evaluation_id": "ev-1", "column": "summary"}


def test_brackets_inside_strings_do_not_count() -> None:
    text = json.dumps({"note": "[" * 1000, "list": [1, 2]})
    assert stored_json("ev-1", "spec", text)["note"] == "[" * 1000


def test_bytes_are_read_as_json_reads_them() -> None:
    assert stored_json("ev-1", "spec", b'{"a": 1}') == {"a": 1}
    assert stored_json("ev-1", "spec", '{"a": 1}'.encode("utf-16")) == {"a": 1}
    with pytest.raises(DatabaseError, match=r"its stored spec is not JSON \('utf-8' codec"):
        stored_json("ev-1", "spec", b'{"a": "\xff"}')


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{not json", "is not JSON (Expecting property name"),
        ("[]", "is an array, not a JSON object"),
        ("5", "is a number, not a JSON object"),
        ('"x"', "is a string, not a JSON object"),
    ],
)
def test_what_is_not_an_object_is_named(text: str, says: str) -> None:
    with pytest.raises(DatabaseError) as info:
        stored_json("ev-1", "spec", text)
    assert str(info.value).startswith(f"evaluation ev-1: its stored spec {says}")


def test_empty_is_an_empty_object_and_a_mapping_is_itself() -> None:
    assert stored_json("ev-1", "spec", None) == {}
    assert stored_json("ev-1", "spec", "") == {}
    assert stored_json("ev-1", "spec", b"") == {}
    assert stored_json("ev-1", "spec", {"a": 1}) == {"a": 1}
