"""Span batches with dictionary-encoded strings: stored exactly as plain ones, and every
malformed dictionary refused with a typed error before anything is inserted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.tracer import COLUMNS, dictionary_encode
from broker import ingest
from broker.db import Database
from broker.ingest_columns import Columns
from mlscope import codec, schema
from mlscope.contracts import SampleBatch
from mlscope.errors import WireError

ATTRS = '{"op_type": "Conv", "shape": [1, 32, 112, 112]}'


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    with Database(f"chdb:///{tmp_path / 'db'}") as d:
        d.migrate()
        yield d


def spans(first: int, n: int) -> dict[str, list[Any]]:
    ids = list(range(first, first + n))
    return {
        "span_id": ids,
        "parent_id": [0] * n,
        "query_index": [i // 3 for i in ids],
        "level": [2] * n,
        "kind": ["layer" if i % 3 else "step" for i in ids],
        "name": [f"/conv{i % 3}" for i in ids],
        "start_ns": ids,
        "end_ns": [i + 5 for i in ids],
        "attrs": [ATTRS if i % 3 else "" for i in ids],
    }


def batch(columns: dict[str, list[Any]], dicts: dict[str, Any], eid: str = "ev-a") -> bytes:
    """A span batch's bytes, as any sender could make them (not validated here)."""
    return codec.encode(
        {
            "schema": 1,
            "kind": "spans",
            "evaluation_id": eid,
            "agent_id": "ag",
            "host": "h",
            "batch_id": f"sb-{columns['span_id'][0]}",
            "columns": columns,
            "dicts": dicts,
        }
    )


def stored(db: Database, eid: str) -> list[tuple[Any, ...]]:
    cols = ", ".join(c for c in schema.SPANS.names if c != "batch_id")
    return db.rows(
        f"SELECT {cols} FROM spans FINAL WHERE evaluation_id = {{e:String}} ORDER BY span_id",
        {"e": eid},
    )


def test_dictionary_and_plain_batches_store_the_same_rows(db: Database) -> None:
    plain, encoded = Columns(schema.SPANS), Columns(schema.SPANS)
    for first in (1, 101, 201):  # several messages, each with its own dictionary
        cols = spans(first, 100)
        plain.add(*ingest._decode(batch(cols, {}, "ev-plain")))
        wire, dicts = dictionary_encode(cols, ("kind", "name", "attrs"))
        assert sorted(dicts["attrs"]) == ["", ATTRS] and max(wire["attrs"]) == 1
        encoded.add(*ingest._decode(batch(wire, dicts, "ev-dict")))
    mixed = Columns(schema.SPANS)  # one fetch of both forms
    mixed.add(*ingest._decode(batch(spans(1, 50), {}, "ev-mixed")))
    wire, dicts = dictionary_encode(spans(51, 250), ("kind", "name", "attrs"))
    mixed.add(*ingest._decode(batch(wire, dicts, "ev-mixed")))
    for c in (plain, encoded, mixed):
        assert c.rows == 300
        db.insert_arrow("spans", c.arrow())
    want = stored(db, "ev-plain")
    assert len(want) == 300 and want[1][COLUMNS.index("attrs") + 2] == ATTRS
    strip = [r[1:] for r in want]  # all but the evaluation id
    assert [r[1:] for r in stored(db, "ev-dict")] == strip
    assert [r[1:] for r in stored(db, "ev-mixed")] == strip


def test_samples_go_in_as_arrow_too(db: Database) -> None:
    cols: dict[str, list[Any]] = {
        "ts_ns": [1, 2, 3],
        "metric": ["cpu.util", "cpu.util", "proc.rss_bytes"],
        "device": ["all", "all", "proc"],
        "value": [0.5, 0.25, 1e9],
    }
    wire, dicts = dictionary_encode(cols, ("metric", "device"))
    b = SampleBatch(evaluation_id="ev-s", agent_id="ag", host="h", batch_id="ss-1", columns=wire)
    b = b.model_copy(update={"dicts": dicts})
    c = Columns(schema.SYSTEM_SAMPLES)
    c.add(*ingest._decode(codec.encode_model(b)))
    db.insert_arrow("system_samples", c.arrow())
    got = db.rows(
        "SELECT ts_ns, metric, device, value FROM system_samples FINAL "
        "WHERE evaluation_id = 'ev-s' ORDER BY ts_ns"
    )
    assert got == list(zip(*cols.values(), strict=True))


def _bad(**change: Any) -> bytes:
    wire, dicts = dictionary_encode(spans(1, 10), ("kind", "name", "attrs"))
    cols, dd = dict(wire), dict(dicts)
    for key, value in change.items():
        if key.startswith("dict_"):
            dd[key[5:]] = value
        else:
            cols[key] = value
    return batch(cols, dd)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (_bad(attrs=[5] * 10), "indices"),  # beyond the dictionary
        (_bad(attrs=[-1] * 10), "indices"),
        (_bad(attrs=["x"] * 10), "indices"),
        (_bad(attrs=[[0]] * 10), "indices"),
        (_bad(attrs=[True] * 10), "indices"),
        (_bad(attrs=[2**64 - 1] * 10), "indices"),
        (_bad(attrs=[-(2**63)] + [2**64 - 1] * 9), "indices"),
        (_bad(attrs=[0.5] * 10), "indices"),
        (_bad(attrs=[0] * 9), "ragged"),
        (_bad(dict_attrs=[1, 2]), "SpanBatch"),  # values that are not strings
        (_bad(dict_attrs="ab"), "SpanBatch"),
        (_bad(dict_span_id=["a"]), "not a string column"),
        (_bad(kind=["layer"] * 10, dict_kind=["layer"]), "indices"),
    ],
)
def test_a_malformed_dictionary_is_a_wire_error(data: bytes, why: str) -> None:
    with pytest.raises(WireError, match=why):
        ingest._decode(data)
