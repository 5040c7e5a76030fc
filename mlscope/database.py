"""A client of the evaluation database, through clickhouse-connect: chDB or a ClickHouse
server, same code and SQL for both. clickhouse-connect errors are translated into
:class:`~mlscope.errors.DatabaseError` here, and only here.

The server owns the schema (``broker/db.py``: migrations, retention); readers with a
ClickHouse server DSN (``analysis``) use this client directly.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any, Self, TypeVar

import clickhouse_connect
import pandas as pd
from clickhouse_connect.driver.exceptions import ClickHouseError

from mlscope.errors import DatabaseError

__all__ = ["Client", "fresh_client"]

_T = TypeVar("_T")


class Client:
    """One client; calls are serialized (chDB and the HTTP client are not re-entrant).

    A call that fails replaces the client: a query cut off mid-stream can leave the
    rest of its stream on a chDB handle, where the next query would read it as its own
    answer, so a failed handle is never reused (:func:`fresh_client`)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        try:
            self.client = clickhouse_connect.get_client(dsn=dsn)
        except (ClickHouseError, OSError, RuntimeError) as exc:
            raise DatabaseError(f"cannot open evaluation database {dsn}: {exc}", dsn=dsn) from exc
        self._lock = threading.Lock()

    def _call(self, op: Callable[[Any], _T], message: str, **context: Any) -> _T:
        with self._lock:
            try:
                return op(self.client)
            except ClickHouseError as exc:
                self.client = fresh_client(self.client, self.dsn)
                raise DatabaseError(f"{message}{exc}", **context) from exc

    def command(self, sql: str, parameters: dict[str, Any] | None = None) -> Any:
        return self._call(lambda c: c.command(sql, parameters=parameters), "", sql=sql[:200])

    def insert(self, table: str, columns: Sequence[Sequence[Any]], names: Sequence[str]) -> None:
        """Insert column-oriented data (one sequence per column)."""
        self._call(
            lambda c: c.insert(
                table,
                [list(col) for col in columns],
                column_names=list(names),
                column_oriented=True,
            ),
            f"insert into {table} failed: ",
            table=table,
        )

    def insert_arrow(self, table: str, data: Any) -> None:
        """Insert a ``pyarrow.Table`` whose column names and types match ``table``'s
        (dictionary-encoded strings go in as they are, without a Python string each)."""
        self._call(
            lambda c: c.insert_arrow(table, data),
            f"insert into {table} failed: ",
            table=table,
        )

    def rows(self, sql: str, parameters: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        return self._call(
            lambda c: [tuple(r) for r in c.query(sql, parameters=parameters).result_rows],
            "",
            sql=sql[:200],
        )

    def frame(self, sql: str, parameters: dict[str, Any] | None = None) -> pd.DataFrame:
        return self._call(lambda c: c.query_df(sql, parameters=parameters), "", sql=sql[:200])

    def close(self) -> None:
        with self._lock:
            self.client.close()

    def __enter__(self) -> Self:
        """``with Database(dsn) as db``: closed however the block ends. chDB holds one
        engine path per process until its last handle closes, so a client left open
        by a failure would refuse every later database at another path."""
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fresh_client(client: Any, dsn: str, settings: dict[str, Any] | None = None) -> Any:
    """Close ``client`` (one whose call failed) and open a new one like it; the old one
    when no new one can be opened now (its next call then fails, typed, and retries)."""
    with contextlib.suppress(Exception):  # a broken handle may fail to close; dropped
        client.close()
    try:
        return clickhouse_connect.get_client(dsn=dsn, settings=settings)
    except (ClickHouseError, OSError, RuntimeError):
        return client
