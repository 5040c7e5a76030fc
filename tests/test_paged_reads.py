"""Results read in pages (``mlscope.remote.arrow``) on a real nats-server, real server
replicas and real chDB: the statement runs once and its pages come from that one
result, so every row comes exactly once whatever the statement's order (none, or one
with ties), and rows stored between pages do not shift them; held results are bounded
(open results, bytes), expire when left unread and are released when read to their
end; hostile page requests get typed errors and the server goes on."""

from __future__ import annotations

import contextlib
import secrets
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.abc
import pandas as pd
import pytest

from broker.readonly import ReadLimits
from broker.server import Server
from cli.export_cmd import EXTENSIONS
from mlscope import bus as busmod
from mlscope import codec, errors, names, remote
from mlscope.database import Client
from mlscope.errors import BusError, ConfigError, MLScopeError, QueryRefused, WireError
from mlscope.settings import Settings

pytestmark = pytest.mark.timeout(180)

ROWS = 2_000
PAGE = 64
"""Rows a page: ~30 pages of the table."""
TABLE = "paged_spans"
STATEMENTS = {
    # ties of 100 rows each, in parts stored apart: ClickHouse orders ties as it goes
    "non-unique ORDER BY": f"SELECT span_id, start_ns FROM {TABLE} ORDER BY start_ns",
    "no ORDER BY": f"SELECT span_id, start_ns FROM {TABLE}",
    # each run draws its ties afresh: a statement run once per page mixes draws
    "ties drawn per run": f"SELECT span_id, rand() % 3 AS r FROM {TABLE} ORDER BY r",
}


def fill(settings: Settings, first: int = 0, n: int = ROWS, parts: int = 4) -> None:
    """``n`` rows from span id ``first``, in ``parts`` inserts (parts of the table)."""
    with Client(settings.dsn) as db:
        db.command(
            f"CREATE TABLE IF NOT EXISTS {TABLE} (span_id UInt64, start_ns Int64) "
            "ENGINE = MergeTree ORDER BY span_id"
        )
        step = n // parts
        for lo in range(first, first + n, step):
            # start_ns: 100 rows per value, spread over the parts
            db.command(
                f"INSERT INTO {TABLE} SELECT number, intDiv(number * 7919 % {ROWS}, 100) "
                f"FROM numbers({lo}, {min(step, first + n - lo)})"
            )


def direct(settings: Settings, sql: str) -> list[int]:
    """The span ids of ``sql`` run once, straight on the database."""
    with Client(settings.dsn) as db:
        return [int(r[0]) for r in db.rows(sql)]


@asynccontextmanager
async def replicas(
    settings: Settings, n: int = 1, **limits: Any
) -> AsyncIterator[tuple[list[Server], busmod.Bus]]:
    """``n`` server replicas on the bus (in this process: chDB lets one process hold
    many handles to one path) and a client's bus connection."""
    options: dict[str, Any] = {}
    if limits:  # imported here: the consistency checks run on any version of the server
        from broker.cursors import CursorLimits

        read = {k: v for k, v in limits.items() if k == "max_paged_bytes"}
        options["read_limits"] = ReadLimits(**read)
        cursors = {k: v for k, v in limits.items() if k != "max_paged_bytes"}
        options["cursor_limits"] = CursorLimits(**cursors)
    servers = [Server(settings, **options) for _ in range(n)]
    async with anyio.create_task_group() as tg:
        for server in servers:
            await tg.start(server.run)
        async with busmod.connect(settings, name="test client") as bus:
            yield servers, bus
        tg.cancel_scope.cancel()


def test_every_row_comes_exactly_once_whatever_the_order(settings: Settings) -> None:
    fill(settings)
    once = {name: direct(settings, sql) for name, sql in STATEMENTS.items()}
    assert all(len(ids) == ROWS for ids in once.values())

    async def main() -> None:
        async with replicas(settings, 2) as (servers, bus):
            for name, sql in STATEMENTS.items():
                table = await remote.arrow(bus, sql, page_rows=PAGE)
                got = table.column("span_id").to_pylist()
                assert Counter(got) == Counter(once[name]), name  # none repeated or missed
                if name == "non-unique ORDER BY":
                    starts = table.column("start_ns").to_pylist()
                    assert starts == sorted(starts)
            for _ in range(6):  # either replica runs it; its pages come from that one
                table = await remote.arrow(bus, STATEMENTS["no ORDER BY"], page_rows=PAGE)
                assert sorted(table.column("span_id").to_pylist()) == list(range(ROWS))
            assert [len(s.cursors) for s in servers] == [0, 0]  # released at the end

    anyio.run(main, backend="asyncio")


def test_rows_stored_between_pages_do_not_shift_them(settings: Settings) -> None:
    fill(settings)
    sql = STATEMENTS["non-unique ORDER BY"]
    before = direct(settings, sql)

    async def main() -> list[int]:
        ids: list[int] = []
        async with replicas(settings) as (_, bus):
            pages = remote.arrow_pages(bus, sql, page_rows=PAGE)
            async for page in pages:
                if not ids:  # a run still storing, mid-read: rows among the ties
                    fill(settings, first=ROWS, n=400, parts=2)
                ids.extend(page.column("span_id").to_pylist())
        return ids

    ids = anyio.run(main, backend="asyncio")
    assert len(ids) == ROWS and Counter(ids) == Counter(before)  # none of the new rows


def test_an_idle_result_expires_and_its_next_page_is_refused(settings: Settings) -> None:
    fill(settings)

    async def main() -> None:
        async with replicas(settings, idle_s=0.5) as ([server], bus):
            pages = remote.arrow_pages(bus, STATEMENTS["no ORDER BY"], page_rows=PAGE)
            first = await anext(pages)
            assert first.num_rows == PAGE and len(server.cursors) == 1
            await anyio.sleep(1.5)  # the client stops reading
            assert len(server.cursors) == 0  # dropped with no request to prompt it
            with pytest.raises(errors.CursorNotFound, match="idle"):
                await anext(pages)
            table = await remote.arrow(bus, STATEMENTS["no ORDER BY"], page_rows=PAGE)
            assert table.num_rows == ROWS  # the server goes on

    anyio.run(main, backend="asyncio")


def test_held_results_are_capped(settings: Settings) -> None:
    fill(settings)
    sql = STATEMENTS["no ORDER BY"]

    async def main() -> None:
        async with replicas(settings, max_open=2, max_paged_bytes=1 << 20) as ([server], bus):
            open_ = [remote.arrow_pages(bus, sql, page_rows=PAGE) for _ in range(2)]
            for pages in open_:
                await anext(pages)
            with pytest.raises(QueryRefused, match="max_open_cursors") as err:
                await remote.arrow(bus, sql, page_rows=PAGE)
            assert err.value.fields["limit"] == "max_open_cursors"
            one_page = await remote.arrow(bus, f"{sql} LIMIT 10", page_rows=PAGE)
            assert one_page.num_rows == 10  # a result of one page holds nothing
            rest = [p.num_rows async for p in open_[0]]  # read to its end: released
            assert sum(rest) == ROWS - PAGE and len(server.cursors) == 1
            assert (await remote.arrow(bus, sql, page_rows=PAGE)).num_rows == ROWS
            with pytest.raises(QueryRefused, match="max_paged_bytes") as err:
                await remote.arrow(bus, "SELECT number FROM numbers(10000000)")
            assert err.value.fields["limit"] == "max_paged_bytes"
            assert (await remote.arrow(bus, sql)).num_rows == ROWS

    anyio.run(main, backend="asyncio")


def test_a_reader_that_stops_early_releases_its_result_at_once(settings: Settings) -> None:
    """Closed, failed or cancelled before its last page, a read releases the rest on
    the server at once (not after ``idle_s``): more abandoned reads in a row than the
    server holds results all succeed, and nothing stays held."""
    fill(settings)
    sql = STATEMENTS["no ORDER BY"]

    async def stop_after_one_page(bus: busmod.Bus, how: str) -> None:
        with anyio.CancelScope() as scope:
            async with contextlib.aclosing(remote.arrow_pages(bus, sql, page_rows=PAGE)) as pages:
                async for page in pages:
                    assert page.num_rows == PAGE
                    if how == "fail":
                        raise LookupError("the reader fails")
                    if how == "cancel":
                        scope.cancel()
                        await anyio.sleep(3600)
                    break
        assert how != "cancel" or scope.cancelled_caught

    async def main() -> None:
        # idle_s: no expiry while the test runs, however slow the machine.
        async with replicas(settings, max_open=2, idle_s=3600) as ([server], bus):
            pages = remote.arrow_pages(bus, sql, page_rows=PAGE)
            assert (await anext(pages)).num_rows == PAGE and len(server.cursors) == 1
            await pages.aclose()
            assert len(server.cursors) == 0
            for how in ("break", "fail", "cancel") * 2:  # 6 reads: over max_open
                if how == "fail":
                    with pytest.raises(LookupError):
                        await stop_after_one_page(bus, how)
                else:
                    await stop_after_one_page(bus, how)
                assert len(server.cursors) == 0, how
            assert (await remote.arrow(bus, sql, page_rows=PAGE)).num_rows == ROWS

    anyio.run(main, backend="asyncio")


def test_a_cursor_closed_while_a_page_is_made_is_released_with_that_page() -> None:
    import pyarrow as pa

    from broker.cursors import Cursors

    cursors = Cursors()
    table = pa.table({"n": list(range(100))})
    _, cursor = cursors.first_page(table, rows=10, max_bytes=1 << 20)
    assert cursor is not None and len(cursors) == 1
    closed: list[bool] = []

    def slice_and_close(*args: Any, **kw: Any) -> Any:  # the page is being made
        closed.append(cursors.close(cursor))  # held (busy): released once its page is made
        return pa.Table.slice(table, *args, **kw)

    held = cursors._held[cursor]
    held.table = SimpleNamespace(num_rows=100, slice=slice_and_close)
    page = cursors.next_page(cursor, rows=10, max_bytes=1 << 20)
    assert closed == [True] and page.rows == 10 and len(cursors) == 0
    assert not cursors.close(cursor)  # not held any more: no error
    with pytest.raises(errors.CursorNotFound):
        cursors.next_page(cursor, rows=10, max_bytes=1 << 20)


def test_only_the_holder_releases_a_cursor_and_an_unknown_one_is_no_error(
    settings: Settings,
) -> None:
    fill(settings)
    sql = STATEMENTS["no ORDER BY"]

    async def close(bus: busmod.Bus, server_id: str, payload: bytes) -> Any:
        return await busmod.request(bus, names.sql_close(server_id), payload, timeout=10)

    async def main() -> None:
        async with replicas(settings, 2) as (servers, bus):
            ask = codec.encode({"sql": sql, "format": "arrow", "page_rows": PAGE})
            reply = codec.decode((await bus.nc.request(names.SQL_SUBJECT, ask, timeout=10)).data)
            holder = next(s for s in servers if s.server_id == reply["server_id"])
            other = next(s for s in servers if s is not holder)
            cursor = codec.encode({"cursor": reply["cursor"]})
            assert (await close(bus, other.server_id, cursor))["released"] is False
            assert len(holder.cursors) == 1  # another replica's close frees nothing here
            assert (await close(bus, holder.server_id, cursor))["released"] is True
            assert len(holder.cursors) == 0
            assert (await close(bus, holder.server_id, cursor))["released"] is False
            page = codec.encode({"cursor": reply["cursor"], "page_rows": PAGE})
            with pytest.raises(errors.CursorNotFound):
                await busmod.request(bus, names.sql_pages(holder.server_id), page, timeout=10)
            for payload in _hostile_pages()[:13]:  # not a cursor id: refused, typed
                with pytest.raises(WireError):
                    await close(bus, holder.server_id, payload)
            unknown = secrets.token_urlsafe(24)
            assert not await remote.close_cursor(bus, holder.server_id, unknown)
            assert not await remote.close_cursor(bus, "srv-gone", unknown)  # never raises
            assert (await remote.arrow(bus, sql, page_rows=PAGE)).num_rows == ROWS

    anyio.run(main, backend="asyncio")


def _hostile_pages() -> list[bytes]:
    good = secrets.token_urlsafe(24)
    return [
        b"",
        b"\xc1",
        secrets.token_bytes(100),
        codec.encode([1, 2]),
        codec.encode({}),
        codec.encode({"cursor": 7}),
        codec.encode({"cursor": None}),
        codec.encode({"cursor": ["a"] * 32}),
        codec.encode({"cursor": "short"}),
        codec.encode({"cursor": "!" * 32}),
        codec.encode({"cursor": "../" * 11 + "x"}),
        codec.encode({"cursor": "a" * 1_000_000}),
        codec.encode({"cursor": f"srv-{good}"}),  # an id of another format
        codec.encode({"cursor": good, "page_rows": 0}),
        codec.encode({"cursor": good, "page_rows": -1}),
        codec.encode({"cursor": good, "page_rows": 2**64 - 1}),
        codec.encode({"cursor": good, "page_rows": "many"}),
        codec.encode({"cursor": good, "page_rows": 1.5}),
        codec.encode({"cursor": good, "sql": "SELECT 1"}),
        codec.encode({"cursor": good}),  # well-formed, never opened
    ]


def test_hostile_page_requests_get_typed_errors(settings: Settings) -> None:
    fill(settings)
    sql = STATEMENTS["no ORDER BY"]

    async def main() -> None:
        async with replicas(settings, 2) as (servers, bus):
            for payload in _hostile_pages():
                for server in servers:
                    with pytest.raises(MLScopeError) as err:
                        await busmod.request(
                            bus, names.sql_pages(server.server_id), payload, timeout=10
                        )
                    assert isinstance(err.value, WireError | errors.CursorNotFound), repr(err.value)
            # a real cursor asked of the replica that does not hold it
            reply = codec.decode(
                (
                    await bus.nc.request(
                        names.SQL_SUBJECT,
                        codec.encode({"sql": sql, "format": "arrow", "page_rows": PAGE}),
                        timeout=10,
                    )
                ).data
            )
            holder = next(s for s in servers if s.server_id == reply["server_id"])
            other = next(s for s in servers if s is not holder)
            ask = codec.encode({"cursor": reply["cursor"], "page_rows": PAGE})
            with pytest.raises(errors.CursorNotFound, match="on this server"):
                await busmod.request(bus, names.sql_pages(other.server_id), ask, timeout=10)
            got = await busmod.request(bus, names.sql_pages(holder.server_id), ask, timeout=10)
            assert got["rows"] == PAGE and got["more"]  # the holder still serves it
            with pytest.raises(BusError, match="nobody serves"):  # a server that is gone
                await busmod.request(bus, names.sql_pages("srv-gone"), ask, timeout=10)
            unknown = codec.encode({"cursor": secrets.token_urlsafe(24)})
            for server in servers:  # both go on answering
                with pytest.raises(errors.CursorNotFound):
                    await busmod.request(
                        bus, names.sql_pages(server.server_id), unknown, timeout=10
                    )
            got = await busmod.request(bus, names.sql_pages(holder.server_id), ask, timeout=10)
            assert got["rows"] == PAGE
            assert (await remote.arrow(bus, sql, page_rows=PAGE)).num_rows == ROWS

    anyio.run(main, backend="asyncio")


def test_export_reads_and_writes_a_table_a_frame_at_a_time(
    settings: Settings, tmp_path: Path
) -> None:
    """``mlscope export``'s tables come in keyset frames, each a statement of its own
    (smaller where one is over what the server holds for a result), and are written
    frame by frame into the same files that one whole frame makes."""
    from analysis.source import BusSource, pages
    from cli.export_cmd import write_tables

    fill(settings)
    sql = f"SELECT span_id, start_ns, toString(span_id) AS s FROM {TABLE}"
    key = (("start_ns", "Int64"), ("span_id", "UInt64"))
    with Client(settings.dsn) as db:
        whole = db.frame(f"{sql} ORDER BY start_ns, span_id")

    async def main() -> list[pd.DataFrame]:
        async with replicas(settings, max_paged_bytes=8 << 10):  # ~300 rows a result
            return await anyio.to_thread.run_sync(
                lambda: list(pages(BusSource(settings), f"{sql} WHERE 1", {}, key, rows=500))
            )

    frames = anyio.run(main, backend="asyncio")
    assert len(frames) > ROWS // 500 and max(len(f) for f in frames) < 500
    got = pd.concat(frames, ignore_index=True)
    pd.testing.assert_frame_equal(got, whole, check_dtype=False)
    for fmt in EXTENSIONS:
        one, paged = tmp_path / f"one-{fmt}", tmp_path / f"paged-{fmt}"
        write_tables({"spans": whole}, one, fmt)
        assert write_tables({"spans": iter(frames)}, paged, fmt) == {
            paged / f"spans.{EXTENSIONS[fmt]}": ROWS
        }
        name = f"spans.{EXTENSIONS[fmt]}"
        assert (one / name).read_bytes() == (paged / name).read_bytes() or fmt == "parquet"
        if fmt == "parquet":
            pd.testing.assert_frame_equal(
                pd.read_parquet(paged / name), pd.read_parquet(one / name), check_dtype=False
            )


def test_trace_export_refuses_more_spans_than_its_cap(settings: Settings) -> None:
    from cli import trace_cmd

    async def main() -> None:
        async with replicas(settings) as (_, bus):
            with Client(settings.dsn) as db:
                db.command(
                    "INSERT INTO evaluations (evaluation_id, agent_id, model, framework, t0_ns) "
                    "VALUES ('ev-capped', 'a', 'm', 'onnxruntime', 0)"
                )
                db.command(
                    "INSERT INTO spans (evaluation_id, agent_id, span_id, query_index, kind, "
                    "name, start_ns, end_ns) SELECT 'ev-capped', 'a', number, number, 'step', "
                    "'predict', number, number + 1 FROM numbers(50)"
                )
            with pytest.raises(ConfigError, match="50 spans") as err:
                await trace_cmd.fetch(bus, "ev-capped", max_spans=49)
            assert err.value.fields["field"] == "max_spans"
            _, _, spans, _ = await trace_cmd.fetch(bus, "ev-capped", max_spans=50)
            assert len(spans) == 50

    anyio.run(main, backend="asyncio")


def test_trace_export_of_a_sweep_names_its_runs(settings: Settings) -> None:
    """A sweep's own evaluation holds no queries or spans (its runs do): its rows name
    the runs to trace, so that its empty timeline is not all a user gets."""
    from cli import trace_cmd

    points = '{"points": [{"evaluation_id": "ev-sw-0"}, {"evaluation_id": "ev-sw-1"}]}'

    async def main() -> None:
        async with replicas(settings) as (_, bus):
            with Client(settings.dsn) as db:
                db.command(
                    "INSERT INTO evaluations (evaluation_id, agent_id, model, framework, t0_ns, "
                    f"summary) VALUES ('ev-sw', 'a', 'm', 'onnxruntime', 0, '{points}'), "
                    "('ev-sw-1', 'a', 'm', 'onnxruntime', 0, "
                    '\'{"points": [{"evaluation_id": "ev-sw-1"}]}\')'
                )
            ev, queries, _, _ = await trace_cmd.fetch(bus, "ev-sw")
            assert ev["runs"] == ["ev-sw-0", "ev-sw-1"] and not queries
            ev, _, _, _ = await trace_cmd.fetch(bus, "ev-sw-1")  # a run lists itself alone
            assert ev["evaluation_id"] == "ev-sw-1" and ev["runs"] == []

    anyio.run(main, backend="asyncio")


def test_a_page_of_a_replica_that_is_gone_is_cursor_not_found(settings: Settings) -> None:
    fill(settings)

    async def main() -> None:
        server = Server(settings)
        scope = anyio.CancelScope()

        async def serve(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            with scope:
                await server.run(task_status=task_status)

        async with busmod.connect(settings, name="test client") as bus:
            async with anyio.create_task_group() as tg:
                await tg.start(serve)
                pages = remote.arrow_pages(bus, STATEMENTS["no ORDER BY"], page_rows=PAGE)
                assert (await anext(pages)).num_rows == PAGE
                scope.cancel()  # the replica holding the rest stops
            with pytest.raises(errors.CursorNotFound, match=server.server_id):
                await anext(pages)

    anyio.run(main, backend="asyncio")
