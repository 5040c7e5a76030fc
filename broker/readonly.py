"""Client-supplied SQL, run so that it cannot write, reach the host or hold the database.

Other processes send SQL to the server (``mlscope.db.sql``); it runs here, never on the
writer's connection. Three layers, each of which holds on its own for what it covers:

1. **ClickHouse's own enforcement.** Client SQL runs only on dedicated read
   connections whose *session* settings are the read limits followed by
   ``readonly = 1``. The engine then refuses every write and DDL statement, the table
   functions that reach the host (``file``, ``url``, ``s3``, ``remote``, ...) and any
   change of a setting (a ``SETTINGS`` clause in the query), and cuts a query off at
   ``max_execution_time``, ``max_result_rows`` / ``max_result_bytes`` (overflow mode
   ``throw``) and ``max_memory_usage``. The settings ride on the connection, so the
   same rules hold on chDB and on a ClickHouse server reached by DSN (there a
   read-only user or profile is better still: it cannot be lifted by any client).
2. **ClickHouse's parser decides what the statement is.** The client's text is passed
   to ``formatQuery`` as a *parameter* (never spliced into SQL) and the canonical text
   it returns is what runs: exactly one statement (multi-statements are a syntax
   error), comments gone, ``SELECT`` or ``WITH`` only, and no call of a function that
   reaches outside the database. This matters because ``readonly`` does not cover
   everything: the ``file()`` *function* still reads any host file, and chDB writes
   ``INTO OUTFILE`` itself, outside the engine's checks.
3. **The canonical statement runs as a subquery** (``SELECT * FROM (...)``): a
   top-level ``INTO OUTFILE`` or ``FORMAT`` clause can only be a syntax error there.
   Parameters bind only to ``{name:Type}`` placeholders, by the engine: the text that
   runs is the text that was checked (the driver's own ``%(name)s`` formatting, which
   would splice values into it after the checks, is refused).

The read connections are separate from the writer's (chDB allows any number of
handles to its one engine per process), so a client query never waits for, or makes
wait, an insert or the server's own reads; a pool of ``readers`` connections lets one
hostile query occupy one of them for at most ``max_execution_time``.

Results read in pages (Arrow) run once, on a pool of their own (``paged_readers``)
whose connections carry the same settings but for the result caps: no cap on rows,
and ``max_paged_bytes`` on bytes, since the whole result of one execution is then
held by the server for its pages (:mod:`broker.cursors`). The result is streamed from
the engine in record batches (``query_arrow_stream``; chDB's ``send_query``) and the
stream read to its end at once: an engine stream left open between a client's page
requests would hold its connection (and the engine's pipeline) for as long as that
client waits.
"""

from __future__ import annotations

import queue
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import clickhouse_connect
import pandas as pd
from clickhouse_connect.driver.binding import bind_query
from clickhouse_connect.driver.exceptions import ClickHouseError

from mlscope.database import fresh_client
from mlscope.errors import DatabaseError, QueryRefused

__all__ = [
    "DENIED_FUNCTIONS",
    "ArrowPage",
    "ReadLimits",
    "ReadOnlyDatabase",
    "arrow_page",
    "ipc_bytes",
]

_T = TypeVar("_T")

DENIED_FUNCTIONS = frozenset(
    {
        "file",
        "url",
        "urlcluster",
        "s3",
        "s3cluster",
        "gcs",
        "oss",
        "cosn",
        "hdfs",
        "hdfscluster",
        "azureblobstorage",
        "azureblobstoragecluster",
        "remote",
        "remotesecure",
        "cluster",
        "clusterallreplicas",
        "executable",
        "executablepool",
        "input",
        "jdbc",
        "odbc",
        "mysql",
        "postgresql",
        "sqlite",
        "mongodb",
        "redis",
        "iceberg",
        "icebergs3",
        "iceberglocal",
        "deltalake",
        "deltalakelocal",
        "hudi",
        "filecluster",
        "dictionary",
        "loop",
        "merge",
        "view",
        "viewifpermitted",
        "prometheusquery",
        "ytsaurus",
        "arrowflight",
        "python",
        "arrowstream",
    }
)
"""Functions and table functions that read or write outside the evaluation tables
(host files, the network, other servers, programs, chDB's host process). ``readonly``
already refuses the table functions among them; the ``file()`` scalar function it does
not, and chDB's ``python()`` and ``arrowstream()`` look their argument up in the
server's own process (its Python variables, its registered Arrow streams) before
``readonly`` refuses them: what they answer tells whether a name exists there."""

_LIMIT_CODES = (
    "TIMEOUT_EXCEEDED",
    "TOO_MANY_ROWS_OR_BYTES",
    "MEMORY_LIMIT_EXCEEDED",
    "TOO_MANY_ROWS",
    "TOO_MANY_BYTES",
    "READONLY",
    "ACCESS_DENIED",
    "QUERY_WAS_CANCELLED",
    "TOO_SLOW",
    "TOO_MANY_ROWS_OR_BYTES",
)
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'", re.S)
_CALL = re.compile(r'(?:`((?:[^`\\]|\\.)*)`|"((?:[^"\\]|\\.)*)"|([A-Za-z_][A-Za-z0-9_]*))\s*\(')
_TOP_CLAUSE = re.compile(r"^(INTO OUTFILE|FORMAT|SETTINGS)\b", re.M)


@dataclass(frozen=True, kw_only=True)
class ReadLimits:
    """What one client query may use; enforced by ClickHouse on the read connections."""

    max_execution_time_s: float = 10.0
    """Wall time after which the engine cancels the query (``max_execution_time``)."""
    max_result_rows: int = 100_000
    """Rows a result may have (``max_result_rows``, overflow ``throw``)."""
    max_result_bytes: int = 64 << 20
    """Uncompressed bytes a result may have (``max_result_bytes``)."""
    max_memory_usage: int = 1 << 30
    """Memory one query may allocate (``max_memory_usage``)."""
    max_threads: int = 1
    """Threads one query may use (``max_threads``): hostile queries on every read
    connection still leave cores for ingest and the load generator."""
    readers: int = 4
    """Read connections: concurrent client queries. One more waits for a free one, at
    most ``max_execution_time``: a client sending more hostile queries at once than
    there are readers delays other clients' SQL (never the writer, nor evaluation
    lookups, which use the server's own connection)."""
    max_sql_chars: int = 100_000
    """Longest statement accepted (checked before anything parses it)."""
    max_paged_bytes: int = 64 << 20
    """Bytes the result of a statement read in pages may have: the engine's count
    (``max_result_bytes`` on the paged connections, rows uncapped there) and the
    Arrow batches the server holds for its pages, both. A longer result is refused
    (QueryRefused naming this limit): read it in several statements (a key range
    each)."""
    paged_readers: int = 4
    """Read connections for statements read in pages (Arrow): what ``readers`` is for
    results answered whole. Each holds its result whole while it runs."""

    def settings(self, *, paged: bool = False) -> dict[str, Any]:
        """Session settings of a read connection (``paged``: one whose results are
        read in pages), ``readonly`` last: once it is set, nothing else may change, a
        query's own ``SETTINGS`` clause included."""
        return {
            "max_execution_time": self.max_execution_time_s,
            "timeout_overflow_mode": "throw",
            "max_result_rows": 0 if paged else self.max_result_rows,
            "max_result_bytes": self.max_paged_bytes if paged else self.max_result_bytes,
            "result_overflow_mode": "throw",
            "max_memory_usage": self.max_memory_usage,
            "max_threads": self.max_threads,
            "readonly": 1,
        }


class ReadOnlyDatabase:
    """Pools of read-only, limited connections for client-supplied SQL: one for
    results answered whole, one for results read in pages."""

    def __init__(self, dsn: str, limits: ReadLimits | None = None) -> None:
        self.dsn = dsn
        self.limits = limits or ReadLimits()
        self._pool: queue.Queue[Any] = queue.Queue()
        self._paged: queue.Queue[Any] = queue.Queue()
        try:
            for _ in range(max(1, self.limits.readers)):
                self._pool.put(self._connect(self.limits.settings()))
            for _ in range(max(1, self.limits.paged_readers)):
                self._paged.put(self._connect(self.limits.settings(paged=True)))
        except (ClickHouseError, OSError, RuntimeError) as exc:
            self.close()
            raise DatabaseError(f"cannot open read connection to {dsn}: {exc}", dsn=dsn) from exc

    def frame(self, sql: Any, parameters: Any = None) -> pd.DataFrame:
        """Run one client SELECT under the read rules; QueryRefused when it breaks one
        (``sql`` and ``parameters`` come off the wire: any type is refused cleanly)."""
        frame: pd.DataFrame = self._run(
            self._pool,
            sql,
            parameters,
            lambda client, inner: client.query_df(inner, parameters=parameters),
        )
        return frame

    def arrow(self, sql: Any, parameters: Any = None) -> Any:
        """The whole result of one client SELECT, run once, as a ``pyarrow.Table`` to
        be read in pages; under the same read rules as :meth:`frame`, with the result
        capped at ``max_paged_bytes`` rather than ``max_result_rows``. The engine's
        record batches are counted as they come, and a result over the cap is refused
        (QueryRefused, ``limit="max_paged_bytes"``) without being held whole."""
        import pyarrow as pa

        cap = self.limits.max_paged_bytes

        def query(client: Any, inner: str) -> Any:
            batches, held = [], 0
            with client.query_arrow_stream(inner, parameters=parameters) as stream:
                schema = stream.gen.schema  # the IPC reader's: an empty result has one too
                for batch in stream:
                    held += batch.nbytes
                    if held > cap:  # the handle is replaced: its stream is cut off
                        raise _over_paged_bytes(cap)
                    batches.append(batch)
            return pa.Table.from_batches(batches, schema=schema)

        return self._run(self._paged, sql, parameters, query)

    def _run(
        self, pool: queue.Queue[Any], sql: Any, parameters: Any, query: Callable[[Any, str], _T]
    ) -> _T:
        """``query(client, statement)`` on a free connection of ``pool``, the statement
        being the client's SQL after every check; errors translated (:func:`_translate`)."""
        if not isinstance(sql, str) or len(sql) > self.limits.max_sql_chars:
            raise QueryRefused(
                f"SQL must be a string of at most {self.limits.max_sql_chars} characters"
            )
        if parameters is not None and not isinstance(parameters, dict):
            raise QueryRefused("parameters must be a mapping")
        client = self._take(pool)
        healthy = False
        try:
            text = f"SELECT * FROM (\n{self._canonical(client, sql)}\n)"
            _server_side_only(text, parameters)
            result = query(client, text)
            healthy = True
            return result
        except ClickHouseError as exc:
            paged_cap = self.limits.max_paged_bytes if pool is self._paged else None
            raise _translate(exc, sql, paged_cap=paged_cap) from exc
        except (TypeError, ValueError, KeyError) as exc:  # parameters it cannot bind
            raise QueryRefused(f"cannot bind the query's parameters: {exc}", sql=sql[:200]) from exc
        finally:
            settings = self.limits.settings(paged=pool is self._paged)
            pool.put(client if healthy else self._replace(client, settings))

    def _connect(self, settings: dict[str, Any]) -> Any:
        return clickhouse_connect.get_client(dsn=self.dsn, settings=settings)

    def _replace(self, client: Any, settings: dict[str, Any]) -> Any:
        """A failed handle is never reused (see :class:`mlscope.database.Client`)."""
        return fresh_client(client, self.dsn, settings)

    def _take(self, pool: queue.Queue[Any]) -> Any:
        try:
            return pool.get(timeout=self.limits.max_execution_time_s + 1.0)
        except queue.Empty:
            readers = self.limits.paged_readers if pool is self._paged else self.limits.readers
            raise QueryRefused(
                "every read connection is busy; try again", readers=readers
            ) from None

    def _canonical(self, client: Any, sql: str) -> str:
        """ClickHouse's own rendering of ``sql`` after the statement checks."""
        result = client.query("SELECT formatQuery({q:String})", parameters={"q": sql})
        canonical = str(result.result_rows[0][0]).strip()
        check_statement(canonical)
        return canonical

    def close(self) -> None:
        for pool in (self._pool, self._paged):
            while True:
                try:
                    pool.get_nowait().close()
                except queue.Empty:
                    break

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class ArrowPage:
    """One page of a result as an Arrow IPC stream."""

    data: bytes
    rows: int
    more: bool
    """Rows may follow this page."""


def arrow_page(table: Any, *, more: bool, max_bytes: int) -> ArrowPage:
    """``table`` (a ``pyarrow.Table``) as one IPC stream of at most ``max_bytes``: its
    first rows that fit (``more`` then set), zstd-compressed buffers. QueryRefused when
    not even one row fits."""
    rows = table.num_rows
    while True:
        data = ipc_bytes(table.slice(0, rows))
        if len(data) <= max_bytes:
            return ArrowPage(data, rows, more or rows < table.num_rows)
        if rows <= 1:
            raise QueryRefused(
                f"one row of the result is over {max_bytes} bytes", max_bytes=max_bytes
            )
        # Shrink in proportion, with a margin: the schema and framing do not shrink.
        rows = max(1, min(rows - 1, int(rows * max_bytes / len(data) * 0.9)))


def ipc_bytes(table: Any) -> bytes:
    """``table`` as an Arrow IPC stream (what :func:`read_ipc` reads back)."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def check_statement(canonical: str) -> None:
    """Refuse a canonical (``formatQuery``) statement that is not a plain read."""
    if not canonical.startswith(("SELECT", "WITH")):
        head = canonical.split(None, 1)[0] if canonical.split() else ""
        raise QueryRefused(
            f"only SELECT (or WITH ... SELECT) is allowed, not {head!r}", statement=head
        )
    clause = _TOP_CLAUSE.search(canonical)
    if clause:
        raise QueryRefused(
            f"{clause.group(1)} is not allowed in a client query", clause=clause.group(1)
        )
    for match in _CALL.finditer(_STRING.sub("''", canonical)):
        name = next(g for g in match.groups() if g is not None).lower()
        if name in DENIED_FUNCTIONS:
            raise QueryRefused(
                f"function {name}() reaches outside the database and is not allowed", function=name
            )


def _server_side_only(text: str, parameters: dict[str, Any] | None) -> None:
    """Refuse parameters the driver would splice into ``text`` itself.

    A ``{name:Type}`` placeholder is bound by the engine, as a typed value. Without
    one, clickhouse-connect formats ``%(name)s`` into the text on the client, after
    the checks above read it: a value could close a string literal and call ``file()``.
    So the text that runs must be the text that was checked: binding it (as the
    driver will) must not change it."""
    if not parameters:
        return
    bound, _ = bind_query(text, parameters)
    if bound != text:
        raise QueryRefused(
            "parameters bind only to {name:Type} placeholders (ClickHouse's own binding), "
            "not %(name)s"
        )


def _over_paged_bytes(cap: int) -> QueryRefused:
    return QueryRefused(
        f"the result is over {cap:,} bytes, the most the server holds for a result read "
        "in pages (max_paged_bytes): read it in several statements, a key range each",
        limit="max_paged_bytes",
        max_bytes=cap,
    )


def _translate(exc: ClickHouseError, sql: str, *, paged_cap: int | None = None) -> DatabaseError:
    """A ClickHouse error as a typed one; ``paged_cap``: the result cap of the paged
    connection it came from, named when the result went past it."""
    text = str(exc)
    code = next((c for c in _LIMIT_CODES if f"({c})" in text), None)
    first = text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
    if paged_cap is not None and code in ("TOO_MANY_ROWS_OR_BYTES", "TOO_MANY_BYTES"):
        return _over_paged_bytes(paged_cap)
    if code:
        return QueryRefused(first, limit=code, sql=sql[:200])
    return DatabaseError(first, sql=sql[:200])
