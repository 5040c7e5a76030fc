"""Results read in pages: each statement runs once, and its pages come from that one
result, held here under an unguessable cursor id until they are read.

Why held rather than run again per page: a statement run once per page with
``LIMIT``/``OFFSET`` repeats some rows and misses others wherever its order is not
unique (ClickHouse orders ties however each run happens to), or when rows are stored
between pages; and each page would pay for the whole statement again. A held result
is the snapshot of one execution: any statement, ordered or not, pages consistently.

Bounds, so that clients cannot make the server hold memory:

- a result is at most ``ReadLimits.max_paged_bytes`` (refused while it streams in,
  :meth:`broker.readonly.ReadOnlyDatabase.arrow`);
- at most ``CursorLimits.max_open`` results are held at once: one more is refused
  with a :class:`~mlscope.errors.QueryRefused` naming ``max_open_cursors`` (a result
  that fits its first page needs no cursor and is never refused for this);
- a result is released when its last page is read or its reader closes it
  (:meth:`Cursors.close`: a reader that stops early says so), and one that no page
  was asked of for ``CursorLimits.idle_s`` is dropped (:meth:`Cursors.run` sweeps
  them), so even a client that vanishes without closing leaks nothing for long.

So the server holds at most ``max_open × max_paged_bytes`` for paged results, plus
the ones running (one per paged read connection).

A page request names only a cursor id; it can page out only what the statement it
was opened for computed, under the read rules it ran with. An id that is not held
(never opened here, read to its end, expired, or being read by another request)
gets a :class:`~mlscope.errors.CursorNotFound`.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from broker.readonly import ArrowPage, arrow_page
from mlscope.contracts import CURSOR_ID_CHARS
from mlscope.errors import CursorNotFound, QueryRefused

__all__ = ["CursorLimits", "Cursors"]


@dataclass(frozen=True, kw_only=True)
class CursorLimits:
    """How many results a server holds for paging, and for how long unread."""

    max_open: int = 8
    """Results held at once (each at most ``ReadLimits.max_paged_bytes``)."""
    idle_s: float = 60.0
    """A result no page was asked of for this long is dropped."""


@dataclass
class _Cursor:
    table: Any
    """The whole result (a ``pyarrow.Table``)."""
    position: int
    """Rows already paged out."""
    touched: float
    busy: bool = False
    """A request is paging it now (another one for it is refused, not interleaved)."""
    closed: bool = False
    """Closed while a page of it was being made: released when that page is."""


@dataclass
class Cursors:
    """The results this server holds for paging. Safe from several threads."""

    limits: CursorLimits = field(default_factory=CursorLimits)
    clock: Callable[[], float] = time.monotonic
    _held: dict[str, _Cursor] = field(default_factory=dict, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def first_page(self, table: Any, *, rows: int, max_bytes: int) -> tuple[ArrowPage, str | None]:
        """The first page of ``table`` (one execution's result) and, when rows follow,
        the id of the cursor now holding the rest; QueryRefused when rows follow and
        ``max_open`` results are held already."""
        page = arrow_page(table.slice(0, rows), more=False, max_bytes=max_bytes)
        if page.rows >= table.num_rows:
            return page, None
        cursor_id = secrets.token_urlsafe(CURSOR_ID_CHARS * 3 // 4)
        with self._lock:
            self._expire_locked()
            if len(self._held) >= self.limits.max_open:
                raise QueryRefused(
                    f"this server holds {len(self._held)} results read in pages, its "
                    f"limit (max_open_cursors); read those to their end or wait "
                    f"{self.limits.idle_s:g} s for idle ones to expire, then try again",
                    limit="max_open_cursors",
                    max_open=self.limits.max_open,
                )
            self._held[cursor_id] = _Cursor(table, page.rows, self.clock())
        return ArrowPage(page.data, page.rows, more=True), cursor_id

    def next_page(self, cursor_id: str, *, rows: int, max_bytes: int) -> ArrowPage:
        """The next page of a held result; the cursor is released with its last page
        (or when the page cannot be made: one row over ``max_bytes``)."""
        with self._lock:
            self._expire_locked()
            cursor = self._held.get(cursor_id)
            if cursor is None or cursor.busy:
                raise CursorNotFound(
                    "no result of that cursor on this server: never opened here, read to "
                    f"its end, idle for over {self.limits.idle_s:g} s, or being read by "
                    "another request; run the statement again",
                    idle_s=self.limits.idle_s,
                )
            cursor.busy = True
        done = True
        try:
            rest = cursor.table.num_rows - cursor.position
            page = arrow_page(
                cursor.table.slice(cursor.position, min(rows, rest)),
                more=False,
                max_bytes=max_bytes,
            )
            cursor.position += page.rows
            done = cursor.position >= cursor.table.num_rows
            return ArrowPage(page.data, page.rows, more=not done)
        finally:
            with self._lock:
                if done or cursor.closed:
                    self._held.pop(cursor_id, None)
                else:
                    cursor.busy, cursor.touched = False, self.clock()

    def close(self, cursor_id: str) -> bool:
        """Release a held result now (its reader stopped before its last page): whether
        one was held. An id not held (never opened, read to its end, expired, closed
        already) is no error; one being paged is released with that page."""
        with self._lock:
            cursor = self._held.get(cursor_id)
            if cursor is None:
                return False
            if cursor.busy:
                cursor.closed = True
            else:
                del self._held[cursor_id]
            return True

    def expire(self) -> int:
        """Drop the results idle for over ``idle_s``; how many were dropped."""
        with self._lock:
            return self._expire_locked()

    def _expire_locked(self) -> int:
        cutoff = self.clock() - self.limits.idle_s
        stale = [k for k, c in self._held.items() if not c.busy and c.touched < cutoff]
        for k in stale:
            del self._held[k]
        return len(stale)

    async def run(self) -> None:
        """Drop idle results as they expire (they go however few requests come)."""
        while True:
            await anyio.sleep(max(0.05, self.limits.idle_s / 4))
            self.expire()
