"""The SQL responder under attack, on a real stack with ``--auth``: what the reader and
submitter roles may send to ``mlscope.db.sql`` is refused or cut off with a typed
error, no file outside the database is read or written, no row is written, and the
server keeps answering other requests within a second while a hostile query runs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from broker.db import Database
from broker.readonly import ReadLimits, ReadOnlyDatabase
from mlscope import bus as busmod
from mlscope import codec, names, remote
from mlscope.errors import DatabaseError, QueryRefused
from mlscope.settings import Settings
from tests.security_fixtures import Recorder, auth_stack, role

pytestmark = pytest.mark.timeout(240)

SQL_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def secured(
    tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path
) -> Iterator[tuple[Settings, Settings, Path, Path]]:
    base = tmp_path_factory.mktemp("sqlsec")
    with auth_stack(base, zoo_dir, [], sql_timeout_s=SQL_TIMEOUT_S) as (stack, auth):
        yield role(stack, auth, "reader"), role(stack, auth, "submitter"), auth, base


def _attacks(out: Path, auth: Path, url: str) -> dict[str, str]:
    return {
        "insert behind WITH": "WITH 1 AS x INSERT INTO evaluations (evaluation_id) "
        "VALUES ('forged')",
        "insert into file()": f"WITH 1 AS x INSERT INTO FUNCTION file('{out}/w.csv', 'CSV') "
        "SELECT 1",
        "into outfile append": f"SELECT 1 INTO OUTFILE '{out}/o.txt' APPEND",
        "into outfile truncate": f"WITH 1 AS x SELECT 2 INTO OUTFILE '{out}/t.txt' TRUNCATE",
        "outfile after a paren": f"SELECT 1) INTO OUTFILE '{out}/p.txt' --",
        "read a host file": "SELECT * FROM file('/etc/passwd', 'LineAsString')",
        "read the server's seed": f"SELECT file('{auth}/server.creds')",
        "quoted file function": f"SELECT `file`('{auth}/server.creds')",
        "fetch a url": f"SELECT * FROM url('{url}/x', 'LineAsString')",
        "look up the server's variables": "SELECT * FROM python('sys')",
        "second statement": "SELECT 1; DROP TABLE evaluations",
        "lift readonly": "SELECT 1 SETTINGS readonly = 0",
        "drop": "DROP TABLE evaluations",
        "huge result": "SELECT number FROM numbers(10000000)",
        "sleep in one-row blocks": "SELECT sleepEachRow(1) FROM numbers(50) "
        "SETTINGS max_block_size = 1",
    }


def test_writes_files_and_urls_are_refused(secured: tuple[Settings, Settings, Path, Path]) -> None:
    reader, submitter, auth, base = secured
    out = base / "outside"
    out.mkdir()

    async def main(settings: Settings, url: str) -> dict[str, BaseException]:
        errors: dict[str, BaseException] = {}
        async with busmod.connect(settings, name="attacker") as bus:
            _, before = await remote.sql(bus, "SELECT count() FROM evaluations")
            for name, sql in _attacks(out, auth, url).items():
                with pytest.raises(DatabaseError) as err:
                    await remote.sql(bus, sql, timeout=10)
                errors[name] = err.value
            _, after = await remote.sql(bus, "SELECT count() FROM evaluations")
            assert before == after == [[0]]
        return errors

    with Recorder() as listener:
        for settings in (reader, submitter):
            errors = anyio.run(main, settings, listener.url, backend="asyncio")
            refused = {n for n, e in errors.items() if isinstance(e, QueryRefused)}
            # every one refused by a rule; the two that do not parse are syntax errors
            assert refused == set(errors) - {"second statement", "outfile after a paren"}, {
                n: repr(e) for n, e in errors.items()
            }
            assert "readonly" in str(errors["lift readonly"]).lower() or "SETTINGS" in str(
                errors["lift readonly"]
            )
        assert listener.requests == []
    assert list(out.iterdir()) == []


def test_integers_past_64_bits_are_answered_as_text(
    secured: tuple[Settings, Settings, Path, Path],
) -> None:
    """A reply carries 64-bit integers; wider ones (Int128, UInt256) come as their text
    (a Decimal's way), where the reply once could not be encoded and never came."""
    reader = secured[0]
    sql = "SELECT toUInt128('1000000000000000000000') AS u, toInt256('-5') AS s, 7 AS n"

    async def main() -> Any:
        async with busmod.connect(reader, name="reader") as bus:
            return await remote.sql(bus, sql, timeout=10)

    columns, rows = anyio.run(main, backend="asyncio")
    assert columns == ["u", "s", "n"] and rows == [["1000000000000000000000", -5, 7]]


def test_arrays_maps_and_tuples_are_answered_as_lists_and_maps(
    secured: tuple[Settings, Settings, Path, Path],
) -> None:
    """A cell of an array, tuple or map comes as the list or map it is, its values
    plain numbers and text (they once came as the text of numpy's repr of each)."""
    reader = secured[0]
    sql = (
        "SELECT [toUInt8(1), 2] AS a, [[1.5], [2.5, nan]] AS nested, "
        "map('k', toInt64(3)) AS m, tuple(1, 'x') AS t, "
        "[toUInt128('10000000000000000000000')] AS w"
    )

    async def main() -> Any:
        async with busmod.connect(reader, name="reader") as bus:
            return await remote.sql(bus, sql, timeout=10)

    columns, rows = anyio.run(main, backend="asyncio")
    assert columns == ["a", "nested", "m", "t", "w"]
    assert rows == [[[1, 2], [[1.5], [2.5, None]], {"k": 3}, [1, "x"], ["10000000000000000000000"]]]


def test_arrow_pages_keep_every_rule(secured: tuple[Settings, Settings, Path, Path]) -> None:
    """Bulk reads as Arrow pages go through the same checks and limits: every attack
    refused alike (a result too large to hold by its bytes), no page over the max
    payload, and a result too wide for one message comes whole, in order, over
    several."""
    reader, _, auth, base = secured
    out = base / "outside-arrow"
    out.mkdir()
    # 960 incompressible bytes a row (raw SHA-256 digests): rows for ~3 messages
    wide = (
        "SELECT number, arrayStringConcat(arrayMap(i -> SHA256(toString(number * 100 + i)), "
        "range(30))) AS s FROM numbers({n:UInt32}) ORDER BY number"
    )

    async def page(bus: busmod.Bus, subject: str, request: dict[str, Any]) -> tuple[int, Any]:
        msg = await bus.nc.request(subject, codec.encode(request), timeout=10)
        return len(msg.data), codec.decode(msg.data)

    async def main(url: str) -> dict[str, BaseException]:
        errors: dict[str, BaseException] = {}
        async with busmod.connect(reader, name="attacker") as bus:
            for name, sql in _attacks(out, auth, url).items():
                with pytest.raises(DatabaseError) as err:
                    await remote.arrow(bus, sql, timeout=10)
                errors[name] = err.value
            # held whole for its pages: a result over the paged bytes is refused
            huge = errors["huge result"]
            assert isinstance(huge, QueryRefused) and huge.fields["limit"] == "max_paged_bytes"
            n = 3 * bus.nc.max_payload // 960
            wide_n = wide.replace("{n:UInt32}", str(n))
            first = {"sql": wide_n, "format": "arrow", "page_rows": 100_000}
            size, got = await page(bus, names.SQL_SUBJECT, first)
            sizes, rows = [size], got["rows"]
            while got["more"]:
                subject = names.sql_pages(got["server_id"])
                size, got = await page(bus, subject, {"cursor": got["cursor"]})
                sizes.append(size)
                rows += got["rows"]
            assert len(sizes) > 2 and max(sizes) <= bus.nc.max_payload, sizes
            assert rows == n
            table = await remote.arrow(bus, wide, {"n": n})
            assert table.column("number").to_pylist() == list(range(n))
        return errors

    with Recorder() as listener:
        errors = anyio.run(main, listener.url, backend="asyncio")
        refused = {n for n, e in errors.items() if isinstance(e, QueryRefused)}
        assert refused == set(errors) - {"second statement", "outfile after a paren"}, {
            n: repr(e) for n, e in errors.items()
        }
        assert listener.requests == []
    assert list(out.iterdir()) == []


def test_parameters_cannot_splice_sql_past_the_checks(
    secured: tuple[Settings, Settings, Path, Path],
) -> None:
    """A parameter the driver would format into the text itself (``%(x)s``) could close
    a string literal the checks saw and call ``file()``: refused, on both read paths;
    the engine's own ``{name:Type}`` binding goes on working, ``%`` in a literal too."""
    reader, _, auth, _ = secured
    seed = ",".join(str(ord(c)) for c in str(auth / "server.creds"))
    splice: dict[str, Any] = {"x": ["", f" || file(char({seed})) || "]}
    attacks: list[tuple[str, dict[str, Any]]] = [
        ("SELECT '%(x)s' AS v", splice),
        ("SELECT 1 AS v /* {y:String} */ WHERE '%(x)s' != ''", {**splice, "y": "a"}),
    ]

    async def main() -> None:
        async with busmod.connect(reader, name="attacker") as bus:
            for sql, params in attacks:
                for read in (remote.sql, remote.arrow):
                    with pytest.raises(QueryRefused, match="placeholders") as err:
                        await read(bus, sql, params, timeout=10)
                    assert "NKEY" not in str(err.value) and "SEED" not in str(err.value)
            _, rows = await remote.sql(
                bus, "SELECT {s:String} AS v, '100%(x)s' AS w", {"s": "a'b", "x": "no"}
            )
            assert rows == [["a'b", "100%(x)s"]]

    anyio.run(main, backend="asyncio")


def test_hostile_query_is_cut_off_while_others_are_answered(
    secured: tuple[Settings, Settings, Path, Path],
) -> None:
    reader, submitter, _, _ = secured
    hostile = [
        "SELECT count() FROM numbers(1e12)",
        "SELECT sleepEachRow(0.1) FROM numbers(29)",  # one 2.9 s block
        "SELECT count() FROM numbers(1e12) AS a, numbers(1e12) AS b",
    ]

    async def attack(
        settings: Settings, sql: str, out: dict[str, tuple[DatabaseError, float]]
    ) -> None:
        async with busmod.connect(settings, name="attacker") as bus:
            t0 = time.monotonic()
            try:
                await remote.sql(bus, sql, timeout=30)
            except DatabaseError as exc:
                out[sql] = (exc, time.monotonic() - t0)

    async def main() -> tuple[dict[str, tuple[DatabaseError, float]], list[float]]:
        results: dict[str, tuple[DatabaseError, float]] = {}
        latencies: list[float] = []
        async with anyio.create_task_group() as tg:
            for sql in hostile:
                tg.start_soon(attack, reader, sql, results)
            await anyio.sleep(0.3)
            async with busmod.connect(submitter, name="bystander") as bus:
                for _ in range(5):
                    t0 = time.monotonic()
                    await remote.sql(bus, "SELECT count() FROM evaluations", timeout=5)
                    latencies.append(time.monotonic() - t0)
                    await anyio.sleep(0.2)
        return results, latencies

    results, latencies = anyio.run(main, backend="asyncio")
    assert max(latencies) < 1.0, latencies
    assert set(results) == set(hostile)
    for sql, (exc, elapsed) in results.items():
        assert isinstance(exc, QueryRefused), (sql, exc)
        assert elapsed < SQL_TIMEOUT_S * 2 + 2, (sql, elapsed)


@pytest.fixture
def fresh_db(tmp_path: Path) -> Iterator[Database]:
    """The writer of a chDB directory of its own, migrated; closed however the test
    ends (a process may hold one engine path at a time)."""
    with Database(f"chdb:///{tmp_path / 'db'}") as db:
        db.migrate()
        yield db


def test_a_client_query_never_waits_for_the_writer(fresh_db: Database) -> None:
    """Read connections are separate from the writer's: an insert goes through while a
    hostile query runs, and the query is cancelled by the engine at its limit."""
    db = fresh_db
    with ReadOnlyDatabase(db.dsn, ReadLimits(max_execution_time_s=1.0, readers=1)) as ro:
        writer_and_hostile_reader(db, ro)


def writer_and_hostile_reader(db: Database, ro: ReadOnlyDatabase) -> None:
    done: list[float] = []

    def hostile() -> None:
        t0 = time.monotonic()
        with pytest.raises(QueryRefused, match=r"TIMEOUT|Timeout"):
            ro.frame("SELECT count() FROM numbers(1e12)")
        done.append(time.monotonic() - t0)

    async def main() -> float:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, hostile)
            await anyio.sleep(0.2)
            t0 = time.monotonic()
            db.insert("schema_migrations", [[99], ["probe"]], ("version", "name"))
            took = time.monotonic() - t0
        return took

    took = anyio.run(main, backend="asyncio")
    assert took < 0.5 and done and done[0] < 2.5
    assert ro.frame("SELECT count() AS n FROM schema_migrations WHERE version = 99")["n"][0] == 1


def test_a_query_cut_off_mid_stream_never_answers_the_next_one(fresh_db: Database) -> None:
    """A query stopped by a limit while its result streams leaves the rest of that stream
    on its chDB handle; the next query must get its own answer, not those bytes. One read
    connection, so every query reuses the handle the failed one ran on."""
    db = fresh_db
    # the result limit is larger than one block, so the cut comes after blocks streamed
    limits = ReadLimits(max_execution_time_s=1.0, readers=1, max_result_rows=100_000)
    with ReadOnlyDatabase(db.dsn, limits) as ro:
        cut_off_queries(db, ro)


def cut_off_queries(db: Database, ro: ReadOnlyDatabase) -> None:
    cut_off = [
        "SELECT number FROM numbers(10000000)",  # result limit, mid-stream
        "SELECT sleepEachRow(0.1) FROM numbers(29)",  # time limit
        "SELECT count() FROM numbers(1e12)",
    ]
    for _ in range(3):
        for sql in cut_off:
            with pytest.raises(QueryRefused):
                ro.frame(sql)
            assert ro.frame("SELECT 41 + 1 AS n")["n"].tolist() == [42]
    # the server's own connection follows the same rule
    with pytest.raises(DatabaseError):
        db.rows(
            "SELECT number FROM numbers(10000000) SETTINGS max_result_rows = 100000, "
            "result_overflow_mode = 'throw'"
        )
    assert db.rows("SELECT 41 + 1") == [(42,)]
