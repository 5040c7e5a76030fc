"""Span batches with dictionary-encoded strings: stored exactly as plain ones, and every
malformed dictionary refused with a typed error before anything is inserted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.tracer import COLUMNS, dictionary_encode
from broker import ingest_batch
from broker.db import Database
from broker.ingest_columns import Columns
from mlscope import codec, names, schema
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


def decode(data: bytes, subject: str | None = None) -> Any:
    """``ingest_batch.decode`` of a batch published on ``subject`` (default: its own)."""
    raw = codec.decode(data)
    return ingest_batch.decode(data, subject or names.traces(raw["evaluation_id"], raw["agent_id"]))


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
        plain.add(*decode(batch(cols, {}, "ev-plain")))
        wire, dicts = dictionary_encode(cols, ("kind", "name", "attrs"))
        assert sorted(dicts["attrs"]) == ["", ATTRS] and max(wire["attrs"]) == 1
        encoded.add(*decode(batch(wire, dicts, "ev-dict")))
    mixed = Columns(schema.SPANS)  # one fetch of both forms
    mixed.add(*decode(batch(spans(1, 50), {}, "ev-mixed")))
    wire, dicts = dictionary_encode(spans(51, 250), ("kind", "name", "attrs"))
    mixed.add(*decode(batch(wire, dicts, "ev-mixed")))
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
    c.add(*decode(codec.encode_model(b)))
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
        decode(data)


@pytest.mark.parametrize(
    "subject",
    [
        names.traces("ev-other", "ag"),  # another evaluation's subject
        names.traces("ev-a", "other-agent"),  # another agent's: its own user's only
        "mlscope.traces.ev-a",  # no agent
        "mlscope.traces.ev-a.ag.more",
    ],
)
def test_a_batch_is_stored_only_from_its_own_subject(subject: str) -> None:
    """Published elsewhere, a batch could write rows in another agent's name, or into
    another evaluation, through that evaluation's or agent's subject."""
    data = batch(spans(1, 10), {})
    decode(data)  # from its own subject: stored
    with pytest.raises(WireError, match="trace subject"):
        decode(data, subject)


@pytest.mark.parametrize(
    ("change", "row"),
    [
        ({"start_ns": [-1, *range(2, 11)]}, 0),  # before the clock starts
        ({"end_ns": [1, 2, 1, *range(9, 16)]}, 2),  # ends before it starts
        ({"start_ns": [0] * 10, "end_ns": [2**63 - 1] * 10}, 0),  # a duration that wraps sums
        ({"start_ns": [-(2**63)] * 10, "end_ns": [2**63 - 1] * 10}, 0),
    ],
)
def test_span_times_no_clock_makes_are_refused(change: dict[str, Any], row: int) -> None:
    cols = {**spans(1, 10), **change}
    with pytest.raises(WireError, match=f"start_ns <= end_ns < 2\\*\\*62 at row {row}"):
        decode(batch(cols, {}))


def test_sample_times_no_clock_makes_are_refused() -> None:
    cols: dict[str, list[Any]] = {
        "ts_ns": [1, -5],
        "metric": ["cpu.util"] * 2,
        "device": ["all"] * 2,
        "value": [0.5, 0.25],
    }
    b = SampleBatch(evaluation_id="ev-s", agent_id="ag", host="h", batch_id="ss-1", columns=cols)
    with pytest.raises(WireError, match=r"ts_ns .* at row 1"):
        decode(codec.encode_model(b))
