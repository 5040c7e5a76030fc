"""One small interface to the evaluation database, for every reader of it.

:class:`Source` has one method, ``frame(sql, parameters) -> DataFrame``. Two
implementations:

* :class:`DirectSource` wraps a :class:`mlscope.database.Client` (clickhouse-connect on
  a ClickHouse server, or chDB when this process owns the data directory);
* :class:`BusSource` asks the process that owns chDB over the bus
  (:func:`mlscope.remote.sql`), one page of rows at a time so that no reply exceeds
  the NATS payload limit.

:func:`open_source` picks one from :class:`~mlscope.settings.Settings`: a ClickHouse
server DSN means direct access, chDB means through its owner.
"""

from __future__ import annotations

from typing import Any, Protocol

import anyio
import pandas as pd

from mlscope import remote
from mlscope.bus import connect
from mlscope.errors import DatabaseError
from mlscope.settings import Settings

__all__ = ["BusSource", "DirectSource", "Source", "open_source", "table_exists"]

# Rows per bus reply: a spans row is ~300 bytes of msgpack, NATS' default limit is 1 MiB.
PAGE_ROWS = 2000


class Source(Protocol):
    """Read-only SQL over the evaluation database."""

    def frame(self, sql: str, parameters: dict[str, Any] | None = None) -> pd.DataFrame:
        """Run one SELECT; the result as a data frame (columns in SELECT order)."""
        ...


class DirectSource:
    """Straight through clickhouse-connect (a :class:`mlscope.database.Client`)."""

    def __init__(self, db: Any) -> None:
        self.db = db

    @classmethod
    def open(cls, dsn: str) -> DirectSource:
        from mlscope.database import Client

        return cls(Client(dsn))

    def frame(self, sql: str, parameters: dict[str, Any] | None = None) -> pd.DataFrame:
        return pd.DataFrame(self.db.frame(sql, parameters))

    def close(self) -> None:
        self.db.close()


class BusSource:
    """Through the server that owns chDB: ``mlscope.db.sql`` requests, paged."""

    def __init__(
        self, settings: Settings, *, page_rows: int = PAGE_ROWS, timeout: float = 30.0
    ) -> None:
        self.settings, self.page_rows, self.timeout = settings, page_rows, timeout

    def frame(self, sql: str, parameters: dict[str, Any] | None = None) -> pd.DataFrame:
        return anyio.run(self._frame, sql, parameters or {}, backend="asyncio")

    async def _frame(self, sql: str, parameters: dict[str, Any]) -> pd.DataFrame:
        inner = sql.strip().rstrip(";")
        columns: list[str] = []
        rows: list[list[Any]] = []
        async with connect(self.settings, name="mlscope analysis") as bus:
            offset = 0
            while True:
                page = f"SELECT * FROM ({inner}) LIMIT {self.page_rows} OFFSET {offset}"
                names, got = await remote.sql(bus, page, parameters, timeout=self.timeout)
                # An empty last page (rows a multiple of the page size) may name no
                # columns: the first page's names stand.
                columns = names or columns
                rows.extend(got)
                if len(got) < self.page_rows:
                    break
                offset += self.page_rows
        return pd.DataFrame(rows, columns=columns)


def open_source(settings: Settings) -> DirectSource | BusSource:
    """Direct for a ClickHouse server DSN; through the chDB owner otherwise."""
    dsn = settings.clickhouse_dsn
    if dsn and not dsn.startswith("chdb"):
        return DirectSource.open(dsn)
    return BusSource(settings)


def table_exists(source: Source, table: str) -> bool:
    """Whether ``table`` exists (optional tables such as ``system_samples``)."""
    try:
        got = source.frame(
            "SELECT count() AS n FROM system.tables "
            "WHERE database = currentDatabase() AND name = {t:String}",
            {"t": table},
        )
    except DatabaseError:
        return False
    return bool(len(got)) and int(got["n"].iloc[0]) > 0
