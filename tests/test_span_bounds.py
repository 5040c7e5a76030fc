"""Every string an agent writes into the trace tables is bounded
(:data:`mlscope.schema.STRING_BOUNDS`): the ingester dead-letters a batch with a longer
one, dictionary words included, with a reason naming the column and its bound, and
goes on storing the next batches; an honest agent fits its strings first, so a real
profiler's long name is stored (cut, marked, still distinct) rather than lost.

Batches reach a real nats-server (its max payload raised to the 8 MiB that
``mlscope auth init`` configures, so a 2 MB name fits in a message, which the traces
stream then refuses: it takes batches of at most 1 MiB) and are stored in a real chDB
by the server's ingester."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent import tracer
from agent.profiling.base import LayerEvent, emit_events
from broker import ingest_batch
from broker.db import Database
from broker.ingest import Ingester
from broker.ingest_columns import Columns
from mlscope import codec, names, schema
from mlscope.bus import publish_persistent
from mlscope.contracts import TraceLevel, new_id
from mlscope.errors import BusRefused, WireError
from mlscope.natsserver import NatsServer
from mlscope.provision import TRACE_BATCH_MAX_BYTES, provisioned
from mlscope.serving import dead_letters
from mlscope.settings import Settings

pytestmark = pytest.mark.timeout(120)

MB = 1 << 20
AGENT = "a1"
ROWS = 50


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server with the max payload mlscope's own configuration sets (8 MiB)."""
    conf = tmp_path / "nats.conf"
    conf.write_text("max_payload: 8388608\n")
    with NatsServer(store_dir=tmp_path / "nats", config_file=conf) as server:
        yield server


@pytest.fixture
def settings(tmp_path: Path, nats_server: NatsServer) -> Settings:
    return Settings(nats_url=nats_server.url, data_dir=tmp_path / "data")


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    with Database(f"chdb:///{tmp_path / 'db'}") as d:
        d.migrate()
        yield d


# ------------------------------------------------------------ batches as any sender makes them


def spans(first: int, n: int = ROWS, **change: list[Any]) -> dict[str, list[Any]]:
    ids = list(range(first, first + n))
    columns: dict[str, list[Any]] = {
        "span_id": ids,
        "parent_id": [0] * n,
        "query_index": ids,
        "level": [2] * n,
        "kind": ["layer"] * n,
        "name": ["/conv1/Conv"] * n,
        "start_ns": ids,
        "end_ns": [i + 5 for i in ids],
        "attrs": ['{"op_type": "Conv"}'] * n,
    }
    return {**columns, **change}


def raw(
    columns: dict[str, list[Any]],
    dicts: dict[str, Any] | None = None,
    *,
    kind: str = "spans",
    eval_id: str = "ev-bounds",
    host: str = "h",
) -> dict[str, Any]:
    """A batch as a hostile agent may send it: nothing validated."""
    return {
        "schema": 1,
        "kind": kind,
        "evaluation_id": eval_id,
        "agent_id": AGENT,
        "host": host,
        "batch_id": new_id("sb"),
        "columns": columns,
        "dicts": dicts or {},
    }


def samples(n: int = ROWS, **change: list[Any]) -> dict[str, list[Any]]:
    columns: dict[str, list[Any]] = {
        "ts_ns": list(range(1, n + 1)),
        "metric": ["cpu.util"] * n,
        "device": ["all"] * n,
        "value": [1.0] * n,
    }
    return {**columns, **change}


def dict_spans(first: int, word: str, n: int = ROWS, column: str = "name") -> dict[str, Any]:
    """Spans whose ``column`` is dictionary-encoded, every row referencing ``word``."""
    return raw(spans(first, n, **{column: [1] * n}), {column: ["short", word]})


NAME_2MB = "n" * (2 * MB)
WORD_1MB = "/encoder/" + "w" * MB
HUGE_ATTRS = json.dumps({"op_type": "Concat", "shape": [[1, 3, 224, 224]] * 10_000})

OVER_BOUND = {
    # case: (batch, column, bound's key)
    "2 MB plain name": (raw(spans(1, name=[NAME_2MB] + ["x"] * (ROWS - 1))), "name"),
    "1 MB dictionary word on every row": (dict_spans(1, WORD_1MB, n=5000), "name"),
    "huge plain attrs": (raw(spans(1, attrs=["", HUGE_ATTRS] + [""] * (ROWS - 2))), "attrs"),
    "huge dictionary attrs": (dict_spans(1, HUGE_ATTRS, column="attrs"), "attrs"),
    "long dictionary kind": (dict_spans(1, "k" * 300, column="kind"), "kind"),
    "long metric": (raw(samples(metric=["m" * 5000] * ROWS), kind="samples"), "metric"),
    "long dictionary device": (
        raw(samples(device=[0] * ROWS), {"device": ["d" * 257]}, kind="samples"),
        "device",
    ),
}
WRONG_TYPE = {
    # case: (batch, what the reason names)
    "int name": (raw(spans(1, name=[7] * ROWS)), "column name"),
    "list name": (raw(spans(1, name=[["a", "b"]] * ROWS)), "column name"),
    "nested dict name": (raw(spans(1, name=[{"a": {"b": [1]}}] * ROWS)), "column name"),
    "dict word not a string": (
        raw(spans(1, name=[0] * ROWS), {"name": [{"nested": {"x": 1}}]}),
        "dicts.name",
    ),
}


def _size(batch: dict[str, Any]) -> int:
    return len(codec.encode(batch))


def decode(batch: dict[str, Any]) -> Any:
    return ingest_batch.decode(codec.encode(batch), names.traces(batch["evaluation_id"], AGENT))


# ------------------------------------------------------------------ the ingester's check


@pytest.mark.parametrize("case", list(OVER_BOUND))
def test_a_string_over_its_bound_is_a_wire_error_naming_column_and_bound(case: str) -> None:
    batch, column = OVER_BOUND[case]
    with pytest.raises(WireError) as err:
        decode(batch)
    bound = schema.STRING_BOUNDS[column]
    assert f"column {column}" in err.value.message
    assert f"over the bound of {bound}" in err.value.message
    assert err.value.fields["bound"] == bound and err.value.fields["column"] == column
    assert len(err.value.message) < 300  # the hostile value is not echoed


def test_a_host_over_its_bound_is_a_wire_error() -> None:
    with pytest.raises(WireError, match=r"host\s+String should have at most") as err:
        decode(raw(spans(1), host="h" * 300))
    assert f"at most {schema.STRING_BOUNDS['host']} characters" in err.value.message


@pytest.mark.parametrize("case", list(WRONG_TYPE))
def test_a_name_of_another_type_is_a_wire_error(case: str) -> None:
    batch, what = WRONG_TYPE[case]
    with pytest.raises(WireError, match=what):
        decode(batch)


def test_strings_at_their_bounds_are_stored(db: Database) -> None:
    name = "x" * schema.STRING_BOUNDS["name"]
    attrs = '"' + "a" * (schema.STRING_BOUNDS["attrs"] - 2) + '"'
    batch = raw(spans(1, 2, kind=[0, 0]), {"kind": ["k" * schema.STRING_BOUNDS["kind"]]})
    batch["columns"]["name"] = [name, name]
    batch["columns"]["attrs"] = [attrs, ""]
    checked, codes = decode(batch)
    rows = Columns(schema.SPANS)
    rows.add(checked, codes)
    db.insert_arrow("spans", rows.arrow())
    got = db.rows("SELECT length(name), length(attrs) FROM spans FINAL ORDER BY span_id")
    assert got == [(len(name), len(attrs)), (len(name), 0)]


# ------------------------------------------------------------------ over the bus, into chDB


def test_hostile_batches_are_dead_lettered_and_the_next_good_batch_stored(
    settings: Settings, db: Database
) -> None:
    """A batch over the stream's largest (:data:`TRACE_BATCH_MAX_BYTES`) is refused at
    its publish; every other hostile one reaches the ingester and is dead-lettered."""
    eval_id = "ev-bounds"
    over = {k: v for k, v in OVER_BOUND.items() if _size(v[0]) <= TRACE_BATCH_MAX_BYTES}
    hostile = [b for b, _ in over.values()] + [b for b, _ in WRONG_TYPE.values()]
    too_large = [b for b, _ in OVER_BOUND.values() if _size(b) > TRACE_BATCH_MAX_BYTES]
    assert too_large and over  # both paths are exercised
    good = [raw(spans(1000)), raw(spans(2000)), raw(samples(), kind="samples")]

    async def main() -> tuple[Ingester, list[str]]:
        async with provisioned(settings, name="test") as bus:
            for batch in too_large:
                with pytest.raises(BusRefused, match="message size exceeds maximum"):
                    await publish_persistent(
                        bus, names.traces(eval_id, AGENT), codec.encode(batch), msg_id=new_id("m")
                    )
            for batch in [good[0], *hostile, good[1], good[2]]:
                await bus.js.publish(names.traces(eval_id, AGENT), codec.encode(batch))
            ingester = Ingester(bus, db)
            async with anyio.create_task_group() as tg:
                tg.start_soon(ingester.run)
                with anyio.fail_after(30):  # the first batch stored: the consumer exists
                    while not ingester.ingested:
                        await anyio.sleep(0.05)
                assert await ingester.drained(60)  # every batch stored or dead-lettered
                tg.cancel_scope.cancel()
            _, dead = await dead_letters(bus)
            return ingester, [d.error for d in dead]

    ingester, reasons = anyio.run(main, backend="asyncio")
    stored = db.rows(
        "SELECT min(span_id), max(span_id), count(), max(length(name)), max(length(attrs)) "
        "FROM spans FINAL WHERE evaluation_id = {e:String}",
        {"e": eval_id},
    )
    assert stored == [(1000, 2000 + ROWS - 1, 2 * ROWS, len("/conv1/Conv"), 19)]
    assert db.rows("SELECT count(), max(length(metric)) FROM system_samples FINAL") == [(ROWS, 8)]
    assert ingester.rejected == len(hostile) == len(reasons)
    for reason, (_, column) in zip(reasons, over.values(), strict=False):
        assert f"column {column}" in reason
        assert f"over the bound of {schema.STRING_BOUNDS[column]}" in reason
    for reason, (_, what) in zip(reasons[len(over) :], WRONG_TYPE.values(), strict=True):
        assert what in reason


# ------------------------------------------------------------------ the agent fits its strings

EIGEN_KERNEL = (
    "void Eigen::internal::EigenMetaKernel<Eigen::TensorEvaluator<Eigen::TensorAssignOp<"
    "Eigen::TensorMap<Eigen::Tensor<float, 4, 1, long>, 16, Eigen::MakePointer>, "
    + "Eigen::TensorCwiseBinaryOp<Eigen::internal::scalar_sum_op<float, float>, " * 14
    + "Eigen::TensorMap<Eigen::Tensor<float const, 4, 1, long>, 16, Eigen::MakePointer> const"
    + " const>" * 14
    + " const, Eigen::GpuDevice>, long>(Eigen::TensorEvaluator<Eigen::TensorAssignOp<"
    "Eigen::TensorMap<Eigen::Tensor<float, 4, 1, long>, 16, Eigen::MakePointer>>, long)"
)
"""A TensorFlow GPU kernel as the profiler names it (demangled C++): past 1024 chars."""


def scoped(block: int) -> str:
    """A deep exported graph's node path (ONNX Runtime, TensorFlow): past 1024 chars,
    distinct only in its middle (``block``)."""
    scopes = "/".join(f"encoder/layer_stack.{i}/residual_block" for i in range(16))
    return f"/model/{scopes}/block.{block}/{scopes}/attention/self/query/MatMul"


def test_fit_keeps_a_name_recognisable_and_distinct() -> None:
    bound = schema.STRING_BOUNDS["name"]
    assert len(EIGEN_KERNEL) > bound and len(scoped(1)) > bound
    assert tracer.fit("/conv1/Conv", bound) == "/conv1/Conv"
    for name in (EIGEN_KERNEL, scoped(1)):
        fitted = tracer.fit(name, bound)
        assert len(fitted) == bound and "…" in fitted
        head, _, tail = fitted.partition("…")
        assert name.startswith(head) and name.endswith(tail.rpartition("…")[2])
    assert tracer.fit(scoped(1), bound) != tracer.fit(scoped(2), bound)
    assert tracer.fit(scoped(1), bound) == tracer.fit(scoped(1), bound)  # stable
    assert len(tracer.fit("x" * 50, 5)) == 5


def test_attrs_over_their_bound_lose_their_largest_values() -> None:
    attrs = {"op_type": "Concat", "shape": json.loads(HUGE_ATTRS)["shape"], "device": "cpu"}
    text = tracer.attrs_text(attrs)
    assert len(text) <= schema.STRING_BOUNDS["attrs"]
    assert json.loads(text) == {"op_type": "Concat", "device": "cpu", "attrs_cut": ["shape"]}
    assert tracer.attrs_text({"op_type": "Conv"}) == '{"op_type": "Conv"}'
    assert tracer.attrs_text(None) == ""


def test_a_long_profiler_name_is_fitted_and_stored(settings: Settings, db: Database) -> None:
    eval_id = "ev-fitted"
    shape = json.loads(HUGE_ATTRS)["shape"]
    events = [
        LayerEvent(name=scoped(1), op_type="MatMul", start_ns=10, end_ns=20, shape=shape),
        LayerEvent(name=scoped(2), op_type="MatMul", start_ns=20, end_ns=30),
        LayerEvent(EIGEN_KERNEL, "", 11, 19, kind="kernel", device="gpu0", layer=0),
    ]
    metric = "perf." + "cpu/event=0x3c,umask=0x00/" * 20

    async def main() -> Ingester:
        async with provisioned(settings, name="test") as bus:
            t = tracer.Tracer(bus, agent_id=AGENT, host="h" * 300)
            emit_events(t.buffer(eval_id), events, parent=0, query_index=0, window=(0, 100))
            t.samples(eval_id).add(5, metric, "cpu0", 1.0)
            await t.flush()
            ingester = Ingester(bus, db)
            async with anyio.create_task_group() as tg:
                tg.start_soon(ingester.run)
                with anyio.fail_after(30):
                    while ingester.ingested + ingester.samples + ingester.rejected < 4:
                        await anyio.sleep(0.05)
                tg.cancel_scope.cancel()
            return ingester

    ingester = anyio.run(main, backend="asyncio")
    assert ingester.rejected == 0
    rows = db.rows(
        "SELECT kind, name, attrs, host FROM spans FINAL WHERE evaluation_id = {e:String} "
        "ORDER BY span_id",
        {"e": eval_id},
    )
    fitted = [len(r[1]) < len(e.name) and "…" in r[1] for r, e in zip(rows, events, strict=False)]
    assert fitted == [True] * 3
    bound = schema.STRING_BOUNDS["name"]
    assert [(k, n) for k, n, _, _ in rows] == [
        ("layer", tracer.fit(scoped(1), bound)),
        ("layer", tracer.fit(scoped(2), bound)),
        ("kernel", tracer.fit(EIGEN_KERNEL, bound)),
    ]
    first = json.loads(rows[0][2])
    assert first["op_type"] == "MatMul" and first["attrs_cut"] == ["shape"]
    assert {len(r[3]) for r in rows} == {schema.STRING_BOUNDS["host"]}
    assert db.rows("SELECT metric FROM system_samples FINAL") == [
        (tracer.fit(metric, schema.STRING_BOUNDS["metric"]),)
    ]
    assert db.rows("SELECT DISTINCT level FROM spans FINAL") == [(int(TraceLevel.FRAMEWORK),)]
