"""The evaluation database as the server owns it: its schema and retention.

The connection itself is :class:`mlscope.database.Client` (chDB or a ClickHouse server,
same code and SQL for both). Schema changes are numbered migrations recorded in
``schema_migrations``; :meth:`Database.migrate` applies the missing ones in order.
Tables use ReplacingMergeTree keyed by their natural ids, and every read that must
not see a redelivered row twice uses FINAL, so at-least-once ingest never shows
duplicates.
"""

from __future__ import annotations

from mlscope import schema
from mlscope.database import Client

__all__ = [
    "AGENT_HISTORY_COLUMNS",
    "EVALUATION_COLUMNS",
    "MIGRATIONS",
    "QUERY_COLUMNS",
    "SAMPLE_COLUMNS",
    "SPAN_COLUMNS",
    "Database",
]

# The migrations are history: each is what it was when it was written, because databases
# exist that ran it. Applied in order on a fresh database they build exactly the tables
# of mlscope/schema.py (tests/test_db.py checks); the next change is a new migration,
# written from the schema (schema.QUERIES.add_column("..."), schema.X.create()).
MIGRATIONS: tuple[tuple[int, str, tuple[str, ...]], ...] = (
    (
        1,
        "evaluations, queries, spans",
        (
            """CREATE TABLE IF NOT EXISTS evaluations (
            evaluation_id String, job_id String, rerun_of String,
            created_at DateTime64(3), model String, model_version String,
            framework String, framework_version String, agent_id String, host String,
            device LowCardinality(String), scenario LowCardinality(String),
            trace_level LowCardinality(String), status LowCardinality(String), valid UInt8,
            t0_ns Int64, clock_offset_ns Int64, spec String, summary String
        ) ENGINE = ReplacingMergeTree ORDER BY evaluation_id""",
            """CREATE TABLE IF NOT EXISTS queries (
            evaluation_id String, query_index UInt32, batch_size UInt32,
            scheduled_ns Int64, issued_ns Int64, completed_ns Int64,
            agent_received_ns Int64, predict_start_ns Int64, predict_end_ns Int64,
            agent_replied_ns Int64, ok UInt8, error String, label Int32, prediction Int32
        ) ENGINE = ReplacingMergeTree ORDER BY (evaluation_id, query_index)""",
            """CREATE TABLE IF NOT EXISTS spans (
            evaluation_id String, agent_id String, span_id UInt64, parent_id UInt64,
            query_index Int64, level UInt8, kind LowCardinality(String), name String,
            start_ns Int64, end_ns Int64, host LowCardinality(String), attrs String,
            batch_id String
        ) ENGINE = ReplacingMergeTree ORDER BY (evaluation_id, agent_id, span_id)""",
        ),
    ),
    # Sorting keys are each table's natural key (ReplacingMergeTree dedups on it, so a
    # redelivered batch never shows twice) with the evaluation first: every analysis
    # query filters on one evaluation. No partitions on the ingested tables: a
    # ReplacingMergeTree dedups only within a partition, and a time partition could
    # split a batch from its redelivery. ``ingested_at`` carries the retention TTL
    # (Database.set_retention).
    (
        2,
        "system_samples, agent_history, span indexes, retention column",
        (
            """CREATE TABLE IF NOT EXISTS system_samples (
            evaluation_id String, agent_id String, host LowCardinality(String),
            ts_ns Int64, metric LowCardinality(String), device LowCardinality(String),
            value Float64, batch_id String, ingested_at DateTime DEFAULT now()
        ) ENGINE = ReplacingMergeTree
        ORDER BY (evaluation_id, agent_id, metric, device, ts_ns)""",
            """CREATE TABLE IF NOT EXISTS agent_history (
            agent_id String, revision UInt64, at DateTime64(3),
            event LowCardinality(String), host String, pid UInt32,
            frameworks String, models UInt32, description String
        ) ENGINE = ReplacingMergeTree PARTITION BY toYYYYMM(at)
        ORDER BY (agent_id, revision)""",
            "ALTER TABLE spans ADD COLUMN IF NOT EXISTS ingested_at DateTime DEFAULT now()",
            "ALTER TABLE spans ADD INDEX IF NOT EXISTS kind_idx kind TYPE set(16) GRANULARITY 4",
            "ALTER TABLE spans ADD INDEX IF NOT EXISTS query_idx query_index TYPE minmax "
            "GRANULARITY 4",
        ),
    ),
    (
        3,
        "outputs (per-sample outputs of accuracy passes, for divergence)",
        (
            """CREATE TABLE IF NOT EXISTS outputs (
            evaluation_id String, sample UInt32, label Int64, prediction Int64,
            kind LowCardinality(String), shape String, raw String
        ) ENGINE = ReplacingMergeTree ORDER BY (evaluation_id, sample)""",
        ),
    ),
    # outcome: mlscope.outcomes.Outcome (ok, failed, refused, lost, not issued);
    # warmup: 1 for a warm-up query (left out of statistics); paced_ns: when the pacer
    # thread released the query (issued_ns is when the event loop handed it over).
    (
        4,
        "queries: outcome, warm-up flag, pacer release time",
        (
            "ALTER TABLE queries ADD COLUMN IF NOT EXISTS outcome UInt8 DEFAULT 255",
            "ALTER TABLE queries ADD COLUMN IF NOT EXISTS warmup UInt8 DEFAULT 0",
            "ALTER TABLE queries ADD COLUMN IF NOT EXISTS paced_ns Int64 DEFAULT 0",
        ),
    ),
)

RETAINED = (
    ("spans", "ingested_at"),
    ("system_samples", "ingested_at"),
    ("agent_history", "toDateTime(at)"),
)

# What writers insert, derived from the one definition (mlscope/schema.py).
SPAN_COLUMNS = schema.SPANS.names
QUERY_COLUMNS = schema.QUERIES.names
SAMPLE_COLUMNS = schema.SYSTEM_SAMPLES.names
AGENT_HISTORY_COLUMNS = schema.AGENT_HISTORY.names
EVALUATION_COLUMNS = schema.EVALUATIONS.names


class Database(Client):
    """The server's handle on the evaluation database: a :class:`~mlscope.database.Client`
    that also applies the migrations and the retention (only the owner does that)."""

    def migrate(self) -> int:
        """Apply missing migrations; returns the schema version now in force."""
        self.command("""CREATE TABLE IF NOT EXISTS schema_migrations (
            version UInt32, name String, applied_at DateTime64(3) DEFAULT now64(3)
        ) ENGINE = ReplacingMergeTree ORDER BY version""")
        done = {r[0] for r in self.rows("SELECT version FROM schema_migrations FINAL")}
        for version, name, statements in MIGRATIONS:
            if version in done:
                continue
            for sql in statements:
                self.command(sql)
            self.insert("schema_migrations", [[version], [name]], ("version", "name"))
        return max(v for v, _, _ in MIGRATIONS)

    def set_retention(self, days: int | None) -> None:
        """Keep traces, samples and agent history ``days`` days (None or 0: forever).

        Evaluations and queries are never expired: they are the results.
        """
        for table, column in RETAINED:
            if days:
                self.command(f"ALTER TABLE {table} MODIFY TTL {column} + INTERVAL {int(days)} DAY")
            elif self._has_ttl(table):
                self.command(f"ALTER TABLE {table} REMOVE TTL")

    def _has_ttl(self, table: str) -> bool:
        rows = self.rows(
            "SELECT create_table_query FROM system.tables "
            "WHERE database = currentDatabase() AND name = {t:String}",
            {"t": table},
        )
        return bool(rows) and " TTL " in str(rows[0][0])
