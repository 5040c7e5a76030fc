"""Stored spans and samples are written by agents, which are not trusted, and a ClickHouse
server given by URL may hold any rows: whatever their attributes, values and times,
`mlscope report` still reports every evaluation, `mlscope trace` still writes valid JSON,
and the layer tables never show a wrapped number.

Attributes and samples reach the database the way an agent's do (span and sample batches
on the evaluation's trace subject, stored by the server's ingester); times the ingester
refuses go straight into a chDB through the ingester's own insert (its Arrow columns),
as a database filled by other means may hold them."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pytest

from analysis import report, report_render
from analysis.layers import layer_types, shape_text, top_layers
from analysis.source import DirectSource
from analysis.trace import timeline
from cli.main import main as mlscope_main
from mlscope import bus as busmod
from mlscope import codec, names, remote, schema
from mlscope.contracts import JobRequest, SampleBatch, ScenarioSpec, SpanBatch
from mlscope.jobs import submit
from mlscope.settings import Settings

pytestmark = pytest.mark.timeout(300)

AGENT = "agent-h"
"""The agent the spans of a database filled by other means name (those published on the
stack name the agent that ran their evaluation, beside its own spans)."""
T0 = 10**9
MS = 1_000_000

HONEST = {
    # layer: (op_type, shape, ns per call)
    "h_conv": ("Conv", [1, 8, 26, 26], (2_000_000, 2_100_000, 1_900_000)),
    "h_relu": ("Relu", [1, 8, 26, 26], (300_000, 310_000, 290_000)),
}
HOSTILE_ATTRS = {
    # layer: its attrs text
    "inf_bytes": '{"op_type":"Conv","output_bytes":Infinity}',
    "nan_bytes": '{"op_type":"Conv","output_bytes":NaN}',
    "float_overflow": '{"op_type":"Gemm","output_bytes":1e999}',
    "deep_list": "[" * 5000 + "]" * 5000,
    "deep_shape": '{"op_type":"Add","shape":' + "[" * 600 + "]" * 600 + "}",
    "not_json": "not json",
}
HUGE_INT = '{"op_type":"MatMul","output_bytes":1' + "0" * 400 + "}"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(text: str) -> Any:
    """JSON as Chrome, Perfetto and other strict readers take it: no NaN or Infinity."""
    return json.loads(text, parse_constant=_no_constant)


def honest_total_ms(layer: str) -> float:
    return sum(HONEST[layer][2]) / MS


# ------------------------------------------------------------------ a stack's evaluations


@dataclass(frozen=True)
class Hostile:
    settings: Settings
    attrs: str
    """Honest layers and layers whose attrs are hostile."""
    samples: str
    """Honest layers, a huge integer in attrs, and samples that are not finite."""
    large: str
    """1,000 layer spans of over 1 KB of attrs each and a few of about 900 KB."""


def _span_batch(
    eval_id: str,
    batch: str,
    rows: list[tuple[int, str, str, int, int, str]],
    agent: str = AGENT,
) -> Any:
    """A batch of layer spans: (span_id, kind, name, start_ns, end_ns, attrs) each."""
    return SpanBatch(
        evaluation_id=eval_id,
        agent_id=agent,
        host="h",
        batch_id=batch,
        columns={
            "span_id": [r[0] for r in rows],
            "parent_id": [0] * len(rows),
            "query_index": [0] * len(rows),
            "level": [2] * len(rows),
            "kind": [r[1] for r in rows],
            "name": [r[2] for r in rows],
            "start_ns": [r[3] for r in rows],
            "end_ns": [r[4] for r in rows],
            "attrs": [r[5] for r in rows],
        },
    )


def _honest_rows(first_id: int) -> list[tuple[int, str, str, int, int, str]]:
    rows, sid, at = [], first_id, T0
    for layer, (op, shape, durations) in HONEST.items():
        for d in durations:
            rows.append(
                (sid, "layer", layer, at, at + d, json.dumps({"op_type": op, "shape": shape}))
            )
            sid, at = sid + 1, at + d
    return rows


def _batches(ids: tuple[str, str, str], agent: str) -> list[Any]:
    """The batches ``agent``, which ran evaluations ``ids``, publishes under them."""
    a, b, c = ids
    hostile = [
        (100 + i, "layer", name, T0 + i * 10 * MS, T0 + i * 10 * MS + 5 * MS, text)
        for i, (name, text) in enumerate(HOSTILE_ATTRS.items())
    ]
    out: list[Any] = [
        _span_batch(a, "hs-a", _honest_rows(1) + hostile, agent),
        _span_batch(
            b,
            "hs-b",
            [*_honest_rows(1), (100, "layer", "huge_int", T0, T0 + 5 * MS, HUGE_INT)],
            agent,
        ),
        SampleBatch(
            evaluation_id=b,
            agent_id=agent,
            host="h",
            batch_id="hs-b-samples",
            columns={
                "ts_ns": [T0, T0 + MS, T0 + 2 * MS, T0 + 3 * MS],
                "metric": ["cpu.util"] * 4,
                "device": ["all"] * 4,
                "value": [12.5, math.nan, math.inf, -math.inf],
            },
        ),
    ]
    return [*out, *_large(c, agent)]


def _large(eval_id: str, agent: str) -> list[Any]:
    """1,000 honest layer spans of ~1.2 KB of attrs each (random: they do not compress),
    200 a batch, 1.2 MB in all (over the max payload), and three with attrs of ~60 KB,
    near their bound (``mlscope.schema.STRING_BOUNDS``), one a batch."""
    rows = [
        (
            1 + i,
            "layer",
            f"layer{i:04d}",
            T0 + i * MS,
            T0 + i * MS + 1000,
            json.dumps({"op_type": "Conv", "note": os.urandom(600).hex()}),
        )
        for i in range(1000)
    ]
    out = [_span_batch(eval_id, f"hs-c-{i}", rows[i : i + 200], agent) for i in range(0, 1000, 200)]
    for j in range(3):
        big = json.dumps({"op_type": "Conv", "blob": os.urandom(30_000).hex()})
        row = (5000 + j, "layer", f"big{j}", T0, T0 + MS, big)
        out.append(_span_batch(eval_id, f"hs-c-big-{j}", [row], agent))
    return out


async def _publish(settings: Settings, batches: list[Any]) -> None:
    async with busmod.connect(settings, name="test") as bus:
        for batch in batches:
            await bus.js.publish(
                names.traces(batch.evaluation_id, batch.agent_id),
                codec.encode_model(batch),
                headers={"Nats-Msg-Id": batch.batch_id},
            )


def _count(settings: Settings, table: str, eval_id: str) -> int:
    async def go() -> int:
        async with busmod.connect(settings, name="test") as bus:
            _, rows = await remote.sql(
                bus,
                f"SELECT count() FROM {table} FINAL WHERE evaluation_id = {{e:String}} "
                "AND startsWith(batch_id, 'hs-')",  # the published ones, not the agent's own
                {"e": eval_id},
            )
            return int(rows[0][0])

    return anyio.run(go, backend="asyncio")


def _wait(settings: Settings, table: str, eval_id: str, want: int) -> None:
    deadline = time.monotonic() + 60
    while (n := _count(settings, table, eval_id)) < want:
        assert time.monotonic() < deadline, f"{n} of {want} rows of {eval_id} in {table}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def hostile(stack: Settings) -> Hostile:
    async def run() -> tuple[tuple[str, str, str], str]:
        spec = ScenarioSpec(name="online", qps=50, duration_s=10, max_queries=3)
        got = []
        for _ in range(3):
            job = JobRequest(model="digits_cnn", framework="onnxruntime", scenario=spec)
            s = await submit(stack, job, timeout=120)
            assert s.status == "completed", s
            got.append(s)
        (agent,) = {s.agent_id for s in got}
        return (got[0].evaluation_id, got[1].evaluation_id, got[2].evaluation_id), agent

    ids, agent = anyio.run(run, backend="asyncio")
    anyio.run(_publish, stack, _batches(ids, agent), backend="asyncio")
    a, b, c = ids
    _wait(stack, "spans", a, sum(len(v[2]) for v in HONEST.values()) + len(HOSTILE_ATTRS))
    _wait(stack, "spans", b, sum(len(v[2]) for v in HONEST.values()) + 1)
    _wait(stack, "system_samples", b, 4)
    _wait(stack, "spans", c, 1003)
    return Hostile(stack, a, b, c)


@pytest.fixture
def env(hostile: Hostile, monkeypatch: pytest.MonkeyPatch) -> Hostile:
    """The CLI run in this process, on the stack's settings."""
    for key, value in hostile.settings.as_env().items():
        monkeypatch.setenv(key, value)
    return hostile


def _section(doc: dict[str, Any], title: str) -> dict[str, Any]:
    [section] = [s for s in doc["sections"] if s["title"] == title]
    return dict(section)


def _table(section: dict[str, Any], starts: str) -> list[dict[str, Any]]:
    [table] = [t for t in section["tables"] if t["caption"].startswith(starts)]
    rows: list[dict[str, Any]] = table["rows"]
    return rows


def test_report_shows_every_evaluation_whatever_the_span_attributes(
    env: Hostile, tmp_path: Path
) -> None:
    out = tmp_path / "report.json"
    assert mlscope_main(["report", env.attrs, env.samples, "-o", str(out)]) == 0
    doc = strict_json(out.read_text())
    summary = _table(_section(doc, "Summary"), "Per-evaluation summary")
    assert {r["evaluation_id"] for r in summary} == {env.attrs, env.samples}
    for e, odd in ((env.attrs, set(HOSTILE_ATTRS)), (env.samples, {"huge_int"})):
        layers = _section(doc, f"Layers of {e}")
        top = {r["layer"]: r for r in _table(layers, "Top")}
        assert set(top) == set(HONEST) | odd, top
        for layer in HONEST:
            assert top[layer]["total_ms"] == pytest.approx(honest_total_ms(layer), rel=1e-12)
            assert top[layer]["calls"] == 3 and top[layer]["op_type"] == HONEST[layer][0]
            assert top[layer]["shape"] == "1×8×26×26"
        for layer in odd:
            row = top[layer]
            assert row["total_ms"] == pytest.approx(5.0) and row["alloc_mb"] is None, row
            assert len(row["shape"]) <= 200 and isinstance(row["op_type"], str)
        by_type = _table(layers, "By layer type")
        assert all(r["total_ms"] >= 0 for r in by_type)
        assert sum(r["calls"] for r in by_type) == 6 + len(odd)
    # What can be read of a hostile text is still shown.
    assert top_row(doc, env.attrs, "inf_bytes")["op_type"] == "Conv"


def top_row(doc: dict[str, Any], eval_id: str, layer: str) -> dict[str, Any]:
    rows = _table(_section(doc, f"Layers of {eval_id}"), "Top")
    [row] = [r for r in rows if r["layer"] == layer]
    return dict(row)


def _trace(tmp_path: Path, eval_id: str) -> dict[str, Any]:
    out = tmp_path / f"{eval_id}.json"
    assert mlscope_main(["trace", eval_id, "-o", str(out)]) == 0
    doc: dict[str, Any] = strict_json(out.read_text())
    return doc


def _layer_events(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        e["name"]: e
        for e in doc["traceEvents"]
        if e.get("ph") == "X" and e["cat"] == "layer" and e["args"]["span_id"] >= 100
    }


def test_trace_of_unreadable_span_attributes_is_valid_json(env: Hostile, tmp_path: Path) -> None:
    doc = _trace(tmp_path, env.attrs)
    events = _layer_events(doc)
    assert set(HOSTILE_ATTRS) <= set(events)
    for name in ("deep_list", "deep_shape", "not_json"):
        assert not events[name]["args"].get("attrs"), name
    # Numbers that are not finite are left out; the rest of the attributes stay.
    assert events["inf_bytes"]["args"]["attrs"]["op_type"] == "Conv"
    assert events["inf_bytes"]["args"]["attrs"].get("output_bytes") is None


def test_trace_leaves_out_samples_that_are_not_numbers(env: Hostile, tmp_path: Path) -> None:
    doc = _trace(tmp_path, env.samples)
    counters = [e for e in doc["traceEvents"] if e.get("ph") == "C"]
    # One finite value; NaN, +inf and -inf are none of them shown.
    assert [(e["name"], e["args"]) for e in counters] == [("cpu.util", {"all": 12.5})]


def test_trace_of_spans_with_large_attributes_is_read_within_the_max_payload(
    env: Hostile, tmp_path: Path
) -> None:
    doc = _trace(tmp_path, env.large)
    layers = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e["cat"] == "layer"]
    mine = [e for e in layers if e["args"]["span_id"] < 5000 and e["name"].startswith("layer")]
    assert len(mine) == 1000
    assert all(len(e["args"]["attrs"]["note"]) == 1200 for e in mine)
    big = [e for e in layers if e["name"].startswith("big")]
    assert len(big) == 3 and all(len(e["args"]["attrs"]["blob"]) == 60_000 for e in big)


# ------------------------------------------------------------- times no ingester takes

TIMES_EVAL = "ev-hostile-times"
WIDE = (-(2**63), 2**63 - 1)
"""The widest span an Int64 pair can hold: its duration does not fit an Int64."""
LONG = 2**62 + 12_345
"""Two such durations sum past an Int64."""


def _time_rows() -> list[tuple[int, str, str, int, int, str]]:
    conv = json.dumps({"op_type": "Conv", "shape": [1, 8, 26, 26]})
    rows = _honest_rows(1)
    rows += [
        (100, "step", "predict", T0, T0 + 10 * MS, ""),
        (101, "layer", "wide", *WIDE, conv),
        (102, "layer", "long", 0, LONG, conv),
        (103, "layer", "long", 0, LONG, conv),
        (104, "layer", "backwards", T0 + 5 * MS, T0 + 5 * MS - 7, conv),
        (105, "kernel", "zero", T0, T0, ""),  # a kernel of no time under h_conv
    ]
    return rows


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DirectSource]:
    """A chDB holding spans whose times no ingester stores, inserted as the ingester
    inserts (its Arrow columns)."""
    from broker.db import Database
    from broker.ingest_columns import Columns

    db = Database(f"chdb:///{tmp_path_factory.mktemp('hostile-times')}")
    db.migrate()
    rows = _time_rows()
    batch = _span_batch(TIMES_EVAL, "times", rows)
    # the zero-time kernel hangs under h_conv's first call (span 1)
    batch.columns["parent_id"][-1] = 1
    batch.columns["level"][-1] = 3
    columns = Columns(schema.SPANS)
    columns.add(batch, {})
    db.insert_arrow("spans", columns.arrow())
    try:
        yield DirectSource(db)
    finally:
        db.close()


def test_layer_tables_never_wrap_whatever_the_stored_times(db: DirectSource) -> None:
    top = top_layers(db, TIMES_EVAL, n=10).set_index("layer")
    assert (top["total_ms"] >= 0).all() and (top["mean_ms"] >= 0).all(), top
    for layer in HONEST:
        assert top.loc[layer, "total_ms"] == pytest.approx(honest_total_ms(layer), rel=1e-12)
    assert top.loc["wide", "total_ms"] == pytest.approx((2**64 - 1) / MS, rel=1e-12)
    assert top.loc["long", "total_ms"] == pytest.approx(2 * LONG / MS, rel=1e-12)
    assert "backwards" not in top.index  # its end is before its start: left out, and said
    assert (top["share"].between(0, 1)).all() and (top["predict_share"] >= 0).all()
    assert top.loc["h_conv", "dominant"] == "zero" and top.loc["h_conv", "dominant_ms"] == 0
    types = layer_types(db, TIMES_EVAL).set_index("op_type")
    assert (types["total_ms"] >= 0).all(), types
    want = honest_total_ms("h_conv") + (2 * LONG + 2**64 - 1) / MS
    assert types.loc["Conv", "total_ms"] == pytest.approx(want, rel=1e-12)
    assert types.loc["Relu", "total_ms"] == pytest.approx(honest_total_ms("h_relu"), rel=1e-12)
    from analysis.layers import layer_spans_left_out

    assert layer_spans_left_out(db, TIMES_EVAL) == 1


def test_a_report_says_which_layer_spans_it_leaves_out(hostile: Hostile, db: DirectSource) -> None:
    """The stored rows of a real run (its evaluation and queries), copied beside the spans
    of hostile times (as run on their agent)."""

    async def rows(table: str) -> Any:
        async with busmod.connect(hostile.settings, name="test") as bus:
            return await remote.arrow(
                bus,
                f"SELECT * FROM {table} FINAL WHERE evaluation_id = {{e:String}}",
                {"e": hostile.attrs},
            )

    for table in ("evaluations", "queries"):
        got = anyio.run(rows, table, backend="asyncio")
        column = got.schema.get_field_index("evaluation_id")
        ids = pa.array([TIMES_EVAL] * got.num_rows)
        got = got.set_column(column, "evaluation_id", ids)
        if table == "evaluations":
            agent = got.schema.get_field_index("agent_id")
            got = got.set_column(agent, "agent_id", pa.array([AGENT] * got.num_rows))
        db.db.insert_arrow(table, got)
    doc = report_render.to_json(report.build(db, [TIMES_EVAL]))
    layers = _section(doc, f"Layers of {TIMES_EVAL}")
    assert layers["notes"] == [
        f"1 layer span(s) of {TIMES_EVAL} end before they start: left out of these tables"
    ]
    assert all(r["total_ms"] >= 0 for r in _table(layers, "Top"))
    strict_json(json.dumps(doc, allow_nan=False))


def test_timeline_never_wraps_whatever_the_stored_times(db: DirectSource) -> None:
    tl = timeline(db, TIMES_EVAL, depth="kernel").set_index("span_id")
    assert (tl["start_ms"] >= 0).all(), tl["start_ms"]
    wide = tl.loc[101]
    assert wide["dur_ms"] == pytest.approx((2**64 - 1) / MS, rel=1e-12)
    assert wide["end_ms"] == pytest.approx(wide["dur_ms"], rel=1e-12)
    at = T0 - WIDE[0]  # every honest span: exactly where it is after the widest start
    for sid, (_, _, _, start, end, _) in enumerate(_honest_rows(1), start=1):
        assert tl.loc[sid, "start_ms"] == pytest.approx((start - T0 + at) / MS, rel=1e-15)
        assert tl.loc[sid, "dur_ms"] == (end - start) / MS


def test_shapes_read_within_bounds() -> None:
    deep: Any = [1, 8]
    for _ in range(5000):
        deep = [deep]
    assert len(shape_text(deep)) <= 200
    assert len(shape_text({"shape": list(range(100_000))})) <= 200
    assert len(shape_text({"inputs": [{"shape": ["x" * 10**6]}], "outputs": deep})) <= 200
    assert shape_text([[1, 10], [10]]) == "1×10, 10"
