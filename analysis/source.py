"""One small interface to the evaluation database, for every reader of it.

:class:`Source` has one method, ``frame(sql, parameters) -> DataFrame``. Two
implementations:

* :class:`DirectSource` wraps a :class:`mlscope.database.Client` (clickhouse-connect on
  a ClickHouse server, or chDB when this process owns the data directory);
* :class:`BusSource` asks the process that owns chDB over the bus
  (:func:`mlscope.remote.arrow`): Arrow IPC pages, none over the NATS payload limit.

:func:`open_source` picks one from :class:`~mlscope.settings.Settings`: a ClickHouse
server DSN means direct access, chDB means through its owner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import anyio
import pandas as pd
from anyio.from_thread import BlockingPortal, start_blocking_portal

from mlscope import remote
from mlscope.bus import Bus, connect
from mlscope.errors import DatabaseError, QueryRefused
from mlscope.settings import Settings

__all__ = [
    "FRAME_ROWS",
    "BusSource",
    "DirectSource",
    "Source",
    "joined",
    "open_source",
    "pages",
    "table_exists",
]

PAGE_ROWS = remote.ARROW_PAGE_ROWS
"""Rows asked for per bus reply (the server sends fewer where they would not fit)."""
FRAME_ROWS = remote.KEYSET_ROWS
"""Rows per statement of :func:`pages`."""


class Source(Protocol):
    """Read-only SQL over the evaluation database. ``frame`` may be called from several
    threads at once (a report sends its independent reads together)."""

    def frame(self, sql: str, parameters: dict[str, Any] | None = None) -> pd.DataFrame:
        """Run one SELECT; the result as a data frame (columns in SELECT order)."""
        ...


class DirectSource:
    """Straight through clickhouse-connect (a :class:`mlscope.database.Client`). Reads
    from several threads take turns: the client runs one call at a time (a session
    refuses a second query while one runs)."""

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

    def __enter__(self) -> DirectSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BusSource:
    """Through the server that owns chDB: ``mlscope.db.sql`` requests, the result in
    Arrow IPC pages (:func:`mlscope.remote.arrow`), each under the max payload.

    Used as a context manager, it holds one bus connection (on an event loop thread
    of its own) for every read inside the block, as a report's many reads want, and
    reads from several threads are in flight together; outside one, each read
    connects and disconnects."""

    def __init__(
        self, settings: Settings, *, page_rows: int = PAGE_ROWS, timeout: float = 30.0
    ) -> None:
        self.settings, self.page_rows, self.timeout = settings, page_rows, timeout
        self._held: tuple[contextlib.ExitStack, BlockingPortal, Bus] | None = None

    def __enter__(self) -> BusSource:
        stack = contextlib.ExitStack()
        try:
            portal = stack.enter_context(start_blocking_portal(backend="asyncio"))
            bus = stack.enter_context(
                portal.wrap_async_context_manager(connect(self.settings, name="mlscope analysis"))
            )
        except BaseException:
            stack.close()
            raise
        self._held = (stack, portal, bus)
        return self

    def __exit__(self, *exc: object) -> None:
        held, self._held = self._held, None
        if held is not None:
            held[0].close()

    def frame(self, sql: str, parameters: dict[str, Any] | None = None) -> pd.DataFrame:
        if self._held is not None:
            _, portal, bus = self._held
            return remote.to_frame(portal.call(self._read, bus, sql, parameters or {}))
        return anyio.run(self._frame, sql, parameters or {}, backend="asyncio")

    async def _frame(self, sql: str, parameters: dict[str, Any]) -> pd.DataFrame:
        async with connect(self.settings, name="mlscope analysis") as bus:
            return remote.to_frame(await self._read(bus, sql, parameters))

    async def _read(self, bus: Bus, sql: str, parameters: dict[str, Any]) -> Any:
        return await remote.arrow(
            bus, sql, parameters, page_rows=self.page_rows, timeout=self.timeout
        )


def open_source(settings: Settings) -> DirectSource | BusSource:
    """Direct for a ClickHouse server DSN; through the chDB owner otherwise."""
    dsn = settings.clickhouse_dsn
    if dsn and not dsn.startswith("chdb"):
        return DirectSource.open(dsn)
    return BusSource(settings)


def pages(
    source: Source,
    select: str,
    parameters: dict[str, Any],
    key: Sequence[tuple[str, str]],
    *,
    rows: int = FRAME_ROWS,
) -> Iterator[pd.DataFrame]:
    """Every row of ``select`` in frames of at most ``rows``, each a statement of its
    own (:func:`mlscope.remote.keyset_sql`): a table of any length is read without this
    process or the server holding more than a frame of it. A frame over what the server
    holds for one result is asked for again in half as many rows. At least one frame,
    which may be empty."""
    last: Any = None
    while True:
        sql, bound = remote.keyset_sql(select, key, rows=rows, last=last)
        try:
            frame = source.frame(sql, {**parameters, **bound})
        except QueryRefused as exc:
            rows = remote.fewer_rows(exc, rows)
            continue
        yield frame
        if len(frame) < rows:
            return
        last = frame.iloc[-1]


def joined(frames: Iterable[pd.DataFrame]) -> pd.DataFrame:
    """The frames of one read (:func:`pages`) as one frame: an empty one adds nothing
    (a direct read of no rows names no columns), and a read of no rows is its one
    empty frame."""
    every = list(frames)
    kept = [f for f in every if len(f)] or every[:1]
    if len(kept) == 1:
        return kept[0].reset_index(drop=True)
    return pd.concat(kept, ignore_index=True)


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
