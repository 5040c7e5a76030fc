"""Replay files: recorded inter-arrival times, read into a :class:`~mlscope.schedule.Schedule`.

A replay file is a user's file, so what reading it costs is bounded by what a run may
hold, never by the file: it is read line by line and refused at its first bad value,
past :data:`~mlscope.contracts.MAX_SCHEDULED_QUERIES` arrivals or the longest run, and
past :data:`MAX_REPLAY_BYTES`.
"""

from __future__ import annotations

import csv
import itertools
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

import numpy as np

from mlscope.contracts import MAX_DURATION_S, MAX_SCHEDULED_QUERIES
from mlscope.errors import ConfigError
from mlscope.regular_files import open_regular
from mlscope.schedule import NS_PER_S, Schedule

__all__ = ["MAX_REPLAY_BYTES", "replay", "write_replay"]

_GROWN = 65_536
"""Gaps held at first (the array doubles as it fills)."""
MAX_REPLAY_BYTES = 16 << 20
"""Largest replay file read: some million arrivals at :func:`write_replay`'s ~16 bytes
a line, ten times what one job carries (:data:`mlscope.provision.JOB_MAX_BYTES`, ~100,000
arrivals). A larger file is refused by its size before a line is parsed."""


def replay(path: str | Path, *, column: str | int | None = None) -> Schedule:
    """A schedule from recorded inter-arrival times in seconds.

    Plain format: one float per line; blank lines and ``#`` comments are skipped. With
    ``column`` the file is CSV and that column (a header name, or a 0-based index with no
    header) holds the gaps. Every gap is rounded to whole ns before summing, so
    :func:`write_replay` followed by :func:`replay` reproduces a schedule exactly.

    The file is read line by line, and refused (:class:`ConfigError` naming the file
    and line) at its first bad value, at the first arrival past
    :data:`~mlscope.contracts.MAX_SCHEDULED_QUERIES` or the longest run, and past
    :data:`MAX_REPLAY_BYTES`: what it costs is bounded by what a run may hold, not by
    the file. A FIFO or a directory is refused, not waited on, and so is a file of no
    arrival.
    """
    p = Path(path)
    try:
        with open_regular(p) as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > MAX_REPLAY_BYTES:
                raise _too_large(p, None, size)
            lines = _lines(p, fh)
            cells = _csv_cells(p, lines, column) if column is not None else _plain_cells(lines)
            gaps = _gaps(p, cells)
    except OSError as exc:
        raise ConfigError(
            f"{p}: cannot read replay file: {exc.strerror or exc}", file=str(p)
        ) from exc
    if not len(gaps):  # a replay of nothing would run nothing
        raise ConfigError(f"{p}: a replay file needs at least one arrival (none)", file=str(p))
    return Schedule(np.cumsum(gaps))


def _too_large(p: Path, line: int | None, size: int) -> ConfigError:
    where = f"{p}:{line}" if line is not None else str(p)
    return ConfigError(
        f"{where}: a replay file may have at most {MAX_REPLAY_BYTES} bytes (got {size})",
        file=str(p),
        line=line,
        limit=MAX_REPLAY_BYTES,
    )


def _lines(p: Path, fh: IO[bytes]) -> Iterator[tuple[int, str]]:
    """Each line of ``fh`` and its number, decoded; refused where the bytes read pass
    :data:`MAX_REPLAY_BYTES` (a file that grew after its size was checked)."""
    read = 0
    for number in itertools.count(1):
        raw = fh.readline(MAX_REPLAY_BYTES + 1 - read)
        if not raw:
            return
        read += len(raw)
        if read > MAX_REPLAY_BYTES:
            raise _too_large(p, number, read)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{p}:{number}: byte 0x{raw[exc.start]:02x} is not UTF-8",
                file=str(p),
                line=number,
            ) from None
        yield number, text


def _gaps(p: Path, cells: Iterable[tuple[int, str]]) -> np.ndarray:
    """The gaps of ``cells`` in ns, in an array grown by doubling (8 bytes a gap where
    a list of Python ints takes ~40), refused at the first one a run cannot hold."""
    gaps = np.empty(_GROWN, dtype=np.int64)
    n = total = 0
    limit = int(MAX_DURATION_S * NS_PER_S)
    for line, cell in cells:
        if n >= MAX_SCHEDULED_QUERIES:
            raise ConfigError(
                f"{p}:{line}: more than the {MAX_SCHEDULED_QUERIES:,} arrivals one run may have",
                file=str(p),
                line=line,
                limit=MAX_SCHEDULED_QUERIES,
            )
        if n == gaps.size:
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:n] = gaps
            gaps = grown
        gaps[n] = gap = _parse_gap(p, line, cell)
        n += 1
        total += gap
        if total > limit:
            raise ConfigError(
                f"{p}:{line}: the arrivals reach past {MAX_DURATION_S:.0f} s, the longest run",
                file=str(p),
                line=line,
            )
    return gaps[:n]


def _plain_cells(lines: Iterable[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    for line, raw in lines:
        cell = raw.split("#", 1)[0].strip()
        if cell:
            yield line, cell


def _csv_cells(
    p: Path, lines: Iterable[tuple[int, str]], column: str | int
) -> Iterator[tuple[int, str]]:
    reader = csv.reader(text for _, text in lines)
    rows = ((reader.line_num, row) for row in reader if row)
    if isinstance(column, str):
        header = [h.strip() for h in next(rows, (1, []))[1]]
        if column not in header:
            raise ConfigError(
                f"{p}:1: no column named {column!r} in the header", file=str(p), line=1
            )
        col = header.index(column)
    else:
        col = column
    for line, row in rows:
        if col >= len(row):
            raise ConfigError(f"{p}:{line}: row has no column {column!r}", file=str(p), line=line)
        yield line, row[col].strip()


def _parse_gap(p: Path, line: int, cell: str) -> int:
    try:
        value = float(cell)
    except ValueError:
        raise ConfigError(
            f"{p}:{line}: not a number of seconds: {cell!r}", file=str(p), line=line
        ) from None
    if not math.isfinite(value) or not 0 <= value <= MAX_DURATION_S:
        raise ConfigError(
            f"{p}:{line}: inter-arrival time must be finite, >= 0 and at most "
            f"{MAX_DURATION_S:.0f} s, got {cell[:40]!r}",
            file=str(p),
            line=line,
        )
    return round(value * NS_PER_S)


def write_replay(path: str | Path, schedule: Schedule) -> None:
    """Write a schedule's inter-arrival times, one float seconds per line (for :func:`replay`)."""
    gaps = np.diff(schedule.offsets_ns, prepend=np.int64(0))
    Path(path).write_text("".join(f"{g / NS_PER_S!r}\n" for g in gaps.tolist()), encoding="utf-8")
