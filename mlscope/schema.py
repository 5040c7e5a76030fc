"""The run record's tables, defined once: each table's columns with their ClickHouse types.

Everything else derives from here: the column tuples the server inserts with
(``broker/db.py``, ``broker/evalstore.py``), the span and sample fields an agent sends
(``agent/tracer.py``, :class:`~mlscope.contracts.SpanBatch`) and the ingester checks
against their stored types (``broker/ingest.py``), the data frame types analysis reads
into (``analysis/data.py``), and the DDL of tables created on first use.

The numbered migrations in ``broker/db.py`` are history: they created and altered these
tables on databases that exist, so they stay as they were written. A test applies them
all to a fresh database and checks that the result is exactly what is defined here;
a new column is a new migration (:meth:`Table.add_column`) plus its entry here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AGENT_HISTORY",
    "EVALUATIONS",
    "MAX_ATTRS_CHARS",
    "MAX_LABEL_CHARS",
    "MAX_NAME_CHARS",
    "MLPERF_LOGS",
    "OUTPUTS",
    "QUERIES",
    "SAMPLE_FIELDS",
    "SPANS",
    "SPAN_FIELDS",
    "STRING_BOUNDS",
    "SYSTEM_SAMPLES",
    "TABLES",
    "Column",
    "Table",
]


@dataclass(frozen=True)
class Column:
    """One column as ClickHouse stores it."""

    name: str
    type: str
    """ClickHouse type, e.g. ``Int64`` or ``LowCardinality(String)``."""
    default: str | None = None
    """``DEFAULT`` expression; a column with one that writers leave out is ``stored``."""
    written: bool = True
    """False for a column that only the database fills (``ingested_at``)."""

    def ddl(self) -> str:
        return f"{self.name} {self.type}" + (f" DEFAULT {self.default}" if self.default else "")

    @property
    def base_type(self) -> str:
        """The type without ``LowCardinality(...)``: what a value must be."""
        t = self.type
        return t[len("LowCardinality(") : -1] if t.startswith("LowCardinality(") else t


@dataclass(frozen=True)
class Table:
    """A ReplacingMergeTree table keyed by its natural key (reads use FINAL)."""

    name: str
    columns: tuple[Column, ...]
    order_by: tuple[str, ...]
    partition_by: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The columns a writer inserts, in order (every column but database-filled ones)."""
        return tuple(c.name for c in self.columns if c.written)

    def column(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(f"{self.name} has no column {name!r}")

    def create(self) -> str:
        """``CREATE TABLE IF NOT EXISTS`` for this table as defined now."""
        cols = ", ".join(c.ddl() for c in self.columns)
        part = f" PARTITION BY {self.partition_by}" if self.partition_by else ""
        order = ", ".join(self.order_by)
        return (
            f"CREATE TABLE IF NOT EXISTS {self.name} ({cols}) ENGINE = ReplacingMergeTree"
            f"{part} ORDER BY ({order})"
        )

    def add_column(self, name: str) -> str:
        """The migration statement that adds column ``name`` as defined here."""
        return f"ALTER TABLE {self.name} ADD COLUMN IF NOT EXISTS {self.column(name).ddl()}"


def _cols(spec: str) -> tuple[Column, ...]:
    """``"a Int64, b String"`` -> columns (the compact form of the tables below)."""
    out = []
    for item in spec.split(","):
        name, _, typ = item.strip().partition(" ")
        out.append(Column(name, typ))
    return tuple(out)


_INGESTED_AT = Column("ingested_at", "DateTime", default="now()", written=False)
"""When the ingester stored a row; carries the retention TTL (Database.set_retention)."""

EVALUATIONS = Table(
    "evaluations",
    _cols(
        "evaluation_id String, job_id String, rerun_of String, created_at DateTime64(3), "
        "model String, model_version String, framework String, framework_version String, "
        "agent_id String, host String, device LowCardinality(String), "
        "scenario LowCardinality(String), trace_level LowCardinality(String), "
        "status LowCardinality(String), valid UInt8, t0_ns Int64, clock_offset_ns Int64, "
        "spec String, summary String"
    ),
    order_by=("evaluation_id",),
)

QUERIES = Table(
    "queries",
    (
        *_cols(
            # scheduled .. completed: the load generator's clock, ns from t0; agent_*
            # and predict_*: the agent's stamps converted to that clock
            "evaluation_id String, query_index UInt32, batch_size UInt32, "
            "scheduled_ns Int64, issued_ns Int64, completed_ns Int64, "
            "agent_received_ns Int64, predict_start_ns Int64, predict_end_ns Int64, "
            "agent_replied_ns Int64, ok UInt8, error String, label Int32, prediction Int32"
        ),
        # mlscope.outcomes.Outcome; 255 (UNKNOWN_OUTCOME) for rows stored before outcomes
        Column("outcome", "UInt8", default="255"),
        # 1: a warm-up query, left out of statistics
        Column("warmup", "UInt8", default="0"),
        # when the pacer thread released the query (issued_ns: the loop handed it over)
        Column("paced_ns", "Int64", default="0"),
    ),
    order_by=("evaluation_id", "query_index"),
)
"""One row per query of a run: the raw per-request timestamps every figure derives from.
``label`` holds the number of correct samples of the query."""

SPAN_FIELDS = _cols(
    "span_id UInt64, parent_id UInt64, query_index Int64, level UInt8, "
    "kind LowCardinality(String), name String, start_ns Int64, end_ns Int64, attrs String"
)
"""The columns of a :class:`~mlscope.contracts.SpanBatch`: what an agent records per span."""

MAX_NAME_CHARS = 1024
"""Longest span name (a layer's, an op's, a kernel's) an agent sends, in characters.

Real names are far shorter: the zoo's ONNX graphs name nodes in at most 58 characters
(``/_blocks.10/_depthwise_conv/static_padding/ConstantOfShape``), exported transformers'
ONNX Runtime and TensorFlow node paths and PyTorch's ``aten::`` ops a few hundred at
most. Only demangled C++ template kernels (Eigen, CUTLASS) run past it, and the agent
fits those (:func:`agent.tracer.fit`: start and end kept, a hash between) rather than
lose the span. Every row repeats its name, so without a bound one hostile agent's
megabyte names would land on every row it stores and in every table that lists layers."""

MAX_LABEL_CHARS = 256
"""Longest span ``kind``, sample ``metric`` and ``device``, and batch ``host``, in
characters: short words (``layer``, ``perf.cycles``, ``gpu0``) and a host name (253 at
most in DNS); the same bound as an id (:data:`mlscope.contracts.MAX_ID_CHARS`)."""

MAX_ATTRS_CHARS = 64 * 1024
"""Longest span attributes (JSON text), in characters. A layer's are ~300 (op type,
input and output shapes, provider, memory figures); 64 Ki leaves room for a node with
hundreds of inputs (a large ``Concat``) while bounding what one row can store. An agent
whose attributes would not fit drops the largest values, named in ``attrs_cut``
(:func:`agent.tracer.attrs_text`)."""

STRING_BOUNDS: dict[str, int] = {
    "kind": MAX_LABEL_CHARS,
    "name": MAX_NAME_CHARS,
    "attrs": MAX_ATTRS_CHARS,
    "metric": MAX_LABEL_CHARS,
    "device": MAX_LABEL_CHARS,
    "host": MAX_LABEL_CHARS,
}
"""The bound of every string column an agent writes (:data:`SPAN_FIELDS`,
:data:`SAMPLE_FIELDS` and the batch's ``host``), in characters (at most 4 bytes each in
UTF-8): the agent fits what it sends to them (``agent/tracer.py``), and the ingester
dead-letters a batch with a longer string, dictionary words included
(``broker/ingest.py``). Each one is far above any real value, so no honest agent meets
it; together they cap what one batch can make the database store per row."""

SPANS = Table(
    "spans",
    (
        Column("evaluation_id", "String"),
        Column("agent_id", "String"),
        *SPAN_FIELDS,
        Column("host", "LowCardinality(String)"),
        Column("batch_id", "String"),
        _INGESTED_AT,
    ),
    order_by=("evaluation_id", "agent_id", "span_id"),
)

SAMPLE_FIELDS = _cols(
    "ts_ns Int64, metric LowCardinality(String), device LowCardinality(String), value Float64"
)
"""The columns of a :class:`~mlscope.contracts.SampleBatch`: one system sample each."""

SYSTEM_SAMPLES = Table(
    "system_samples",
    (
        Column("evaluation_id", "String"),
        Column("agent_id", "String"),
        Column("host", "LowCardinality(String)"),
        *SAMPLE_FIELDS,
        Column("batch_id", "String"),
        _INGESTED_AT,
    ),
    order_by=("evaluation_id", "agent_id", "metric", "device", "ts_ns"),
)

AGENT_HISTORY = Table(
    "agent_history",
    _cols(
        "agent_id String, revision UInt64, at DateTime64(3), event LowCardinality(String), "
        "host String, pid UInt32, frameworks String, models UInt32, description String"
    ),
    order_by=("agent_id", "revision"),
    partition_by="toYYYYMM(at)",
)

OUTPUTS = Table(
    "outputs",
    _cols(
        "evaluation_id String, sample UInt32, label Int64, prediction Int64, "
        "kind LowCardinality(String), shape String, raw String"
    ),
    order_by=("evaluation_id", "sample"),
)
"""Per-sample outputs of a data-set pass (``--accuracy``), compared across runs."""

MLPERF_LOGS = Table(
    "mlperf_logs",
    _cols("evaluation_id String, name String, part UInt32, text String"),
    order_by=("evaluation_id", "name", "part"),
)
"""MLPerf LoadGen's log files, verbatim, in parts (created on first use)."""

TABLES = (EVALUATIONS, QUERIES, SPANS, SYSTEM_SAMPLES, AGENT_HISTORY, OUTPUTS, MLPERF_LOGS)
