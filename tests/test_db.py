"""broker/db.py on a real chDB: numbered migrations and the retention TTL.

chDB embeds one data path per process; every test opens its own and closes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from broker import db as dbmod
from broker.db import MIGRATIONS, RETAINED, Database
from mlscope import schema
from mlscope.errors import DatabaseError

LATEST = max(v for v, _, _ in MIGRATIONS)
ALL_TABLES = ("evaluations", "queries", "spans", "system_samples", "agent_history", "outputs")


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    d = Database(f"chdb:///{tmp_path / 'chdb'}")
    try:
        yield d
    finally:
        d.close()


def tables(db: Database) -> set[str]:
    return {
        r[0] for r in db.rows("SELECT name FROM system.tables WHERE database = currentDatabase()")
    }


def versions(db: Database) -> list[tuple[int, str]]:
    """Every recorded migration row, duplicates included (no FINAL)."""
    return [
        (int(v), str(n))
        for v, n in db.rows("SELECT version, name FROM schema_migrations ORDER BY version")
    ]


def create_query(db: Database, table: str) -> str:
    return str(
        db.rows(
            "SELECT create_table_query FROM system.tables WHERE database = "
            "currentDatabase() AND name = {t:String}",
            {"t": table},
        )[0][0]
    )


def columns(db: Database, table: str) -> set[str]:
    return {
        r[0]
        for r in db.rows(
            "SELECT name FROM system.columns WHERE database = "
            "currentDatabase() AND table = {t:String}",
            {"t": table},
        )
    }


def test_migrating_twice_is_idempotent_and_recorded(db: Database) -> None:
    assert db.migrate() == LATEST
    want = [(v, name) for v, name, _ in MIGRATIONS]
    assert versions(db) == want
    assert set(ALL_TABLES) <= tables(db)
    before = {t: create_query(db, t) for t in ALL_TABLES}
    assert db.migrate() == LATEST
    assert versions(db) == want  # no migration applied, nor recorded, a second time
    assert {t: create_query(db, t) for t in ALL_TABLES} == before


def test_migrations_are_numbered_in_order() -> None:
    numbers = [v for v, _, _ in MIGRATIONS]
    assert numbers == list(range(1, len(numbers) + 1))


def test_a_database_at_version_1_upgrades_to_the_latest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = f"chdb:///{tmp_path / 'chdb'}"
    old = Database(path)
    try:
        with monkeypatch.context() as m:  # the code as it was at migration 1
            m.setattr(dbmod, "MIGRATIONS", MIGRATIONS[:1])
            old.migrate()
        assert versions(old) == [(1, MIGRATIONS[0][1])]
        assert tables(old) >= {"evaluations", "queries", "spans"}
        assert not tables(old) & {"system_samples", "agent_history", "outputs"}
        assert "ingested_at" not in columns(old, "spans")
        old.insert(
            "spans",
            [["ev-old"], ["a1"], [7], ["predict"]],
            ("evaluation_id", "agent_id", "span_id", "name"),
        )
    finally:
        old.close()
    new = Database(path)  # the server restarts on the new code
    try:
        assert new.migrate() == LATEST
        assert versions(new) == [(v, name) for v, name, _ in MIGRATIONS]
        assert set(ALL_TABLES) <= tables(new)
        assert "ingested_at" in columns(new, "spans")
        spans = create_query(new, "spans")
        assert "INDEX kind_idx" in spans and "INDEX query_idx" in spans
        # Rows written before the upgrade are still there, the new column filled in.
        rows = new.rows(
            "SELECT span_id, name, ingested_at > toDateTime(0) FROM spans FINAL "
            "WHERE evaluation_id = 'ev-old'"
        )
        assert rows == [(7, "predict", 1)]
    finally:
        new.close()


def ttl_of(db: Database, table: str) -> str | None:
    """The table's TTL clause as ClickHouse shows it, or None."""
    query = create_query(db, table)
    if " TTL " not in query:
        return None
    return query.split(" TTL ", 1)[1].split(" SETTINGS ", 1)[0].strip()


def test_retention_sets_and_removes_a_ttl_on_traces_only(db: Database) -> None:
    db.migrate()
    retained = {t for t, _ in RETAINED}
    assert retained == {"spans", "system_samples", "agent_history"}
    db.set_retention(None)  # nothing to remove yet: no error
    assert all(ttl_of(db, t) is None for t in ALL_TABLES)

    db.set_retention(7)
    for table, column in RETAINED:
        ttl = ttl_of(db, table)
        assert ttl is not None and column in ttl and "toIntervalDay(7)" in ttl, (table, ttl)
    for table in set(ALL_TABLES) - retained:  # results are never expired
        assert ttl_of(db, table) is None, table

    db.set_retention(30)  # changed, not added twice
    for table, _ in RETAINED:
        ttl = ttl_of(db, table)
        assert ttl is not None and "toIntervalDay(30)" in ttl and "(7)" not in ttl

    db.set_retention(0)  # 0 means forever, as None does
    assert all(ttl_of(db, t) is None for t in ALL_TABLES)
    db.set_retention(3)
    db.set_retention(None)
    assert all(ttl_of(db, t) is None for t in ALL_TABLES)


def test_retention_expires_old_traces_and_keeps_old_results(db: Database) -> None:
    db.migrate()
    old, now = "2001-01-01 00:00:00", "now()"
    for when in (old, now):
        at = f"toDateTime('{when}')" if when == old else now
        key = "old" if when == old else "new"
        db.command(
            f"INSERT INTO spans (evaluation_id, agent_id, span_id, ingested_at) "
            f"VALUES ('ev-{key}', 'a1', 1, {at})"
        )
        db.command(
            f"INSERT INTO system_samples (evaluation_id, agent_id, metric, ts_ns, "
            f"ingested_at) VALUES ('ev-{key}', 'a1', 'cpu.util', 1, {at})"
        )
        db.command(
            f"INSERT INTO agent_history (agent_id, revision, at, event) "
            f"VALUES ('agent-{key}', 1, {at}, 'registered')"
        )
        db.command(f"INSERT INTO evaluations (evaluation_id, created_at) VALUES ('ev-{key}', {at})")
        db.command(f"INSERT INTO queries (evaluation_id, query_index) VALUES ('ev-{key}', 0)")
    db.set_retention(30)
    for table in ("spans", "system_samples", "agent_history", "evaluations", "queries"):
        db.command(f"OPTIMIZE TABLE {table} FINAL")  # apply the TTL now
    assert db.rows("SELECT evaluation_id FROM spans FINAL") == [("ev-new",)]
    assert db.rows("SELECT evaluation_id FROM system_samples FINAL") == [("ev-new",)]
    assert db.rows("SELECT agent_id FROM agent_history FINAL") == [("agent-new",)]
    assert sorted(db.rows("SELECT evaluation_id FROM evaluations FINAL")) == [
        ("ev-new",),
        ("ev-old",),
    ]
    assert sorted(db.rows("SELECT evaluation_id FROM queries FINAL")) == [("ev-new",), ("ev-old",)]


def described(db: Database, table: str) -> list[tuple[str, str, str]]:
    """(name, type, default expression) of each column, in table order."""
    return [
        (str(n), str(t), str(d))
        for n, t, d in db.rows(
            "SELECT name, type, default_expression FROM system.columns WHERE database = "
            "currentDatabase() AND table = {t:String} ORDER BY position",
            {"t": table},
        )
    ]


def test_the_migrations_build_the_schema_exactly(db: Database) -> None:
    """mlscope/schema.py is the one definition; the migrations (history) must agree."""
    db.migrate()
    db.command(schema.MLPERF_LOGS.create())  # created on first use, not by a migration
    for table in schema.TABLES:
        want = sorted((c.name, c.type, c.default or "") for c in table.columns)
        assert sorted(described(db, table.name)) == want, table.name
        key = create_query(db, table.name).split("ORDER BY ", 1)[1]
        assert key.split(" SETTINGS")[0].strip("()") == ", ".join(table.order_by), table.name


def test_a_table_created_from_the_schema_matches_it(db: Database) -> None:
    for table in schema.TABLES:
        db.command(table.create().replace(f"EXISTS {table.name} ", f"EXISTS new_{table.name} "))
        want = [(c.name, c.type, c.default or "") for c in table.columns]
        assert described(db, f"new_{table.name}") == want


def test_a_database_closed_by_its_with_block_frees_the_engine_path(tmp_path: Path) -> None:
    """chDB holds one engine path per process until its last handle closes: a block
    that fails must still let the next database, at another path, open."""
    with pytest.raises(RuntimeError, match="mid-test"), Database(f"chdb:///{tmp_path / 'a'}") as a:
        a.migrate()
        raise RuntimeError("mid-test")
    with Database(f"chdb:///{tmp_path / 'b'}") as b:
        assert b.migrate() == LATEST
    # the rule the block guards against: a second path while the first is open
    with Database(f"chdb:///{tmp_path / 'c'}"), pytest.raises(DatabaseError, match="cannot open"):
        Database(f"chdb:///{tmp_path / 'd'}")
