"""Reading the files users name: regular files only, at most a reader's limit of bytes,
text only as UTF-8.

Every file an mlscope process reads because someone named it (a manifest, credentials,
a seed, a labels file, a conf or replay file, a build lock) is opened by
:func:`open_regular` or read by :func:`read_regular` (text by :func:`read_text`): a
FIFO, device or directory named as an input is refused at once, where a plain ``open``
would wait forever for a writer or read without end, and a file over the reader's
limit is refused by its size before it is read. Each refusal is an ``OSError``
(:class:`NotRegularFile`, :class:`FileTooLarge`, :class:`NotUtf8`), so a reader's own
``except OSError`` turns any of them into that reader's typed error.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import IO

__all__ = [
    "FileTooLarge",
    "NotRegularFile",
    "NotUtf8",
    "byte_position",
    "open_regular",
    "read_regular",
    "read_text",
]


class NotRegularFile(OSError):
    """A path names a FIFO, socket, device or directory, not a file: reading it could
    block until a writer comes, or never end. An OSError, so that each reader's own
    ``except OSError`` turns it into that reader's typed error."""

    def __init__(self, path: Path, mode: int) -> None:
        super().__init__(errno.EINVAL, f"not a regular file ({_file_kind(mode)})", str(path))


class FileTooLarge(OSError):
    """A regular file holds more bytes than its reader accepts (``size`` is at least
    ``limit + 1``: the reader stops there)."""

    def __init__(self, path: Path, size: int, limit: int) -> None:
        super().__init__(errno.EFBIG, f"is {size} bytes, over the {limit}-byte limit", str(path))
        self.size, self.limit = size, limit


class NotUtf8(OSError):
    """A file's bytes are not UTF-8 text; ``line`` and ``column`` (from 1) locate the
    first bad byte."""

    def __init__(self, path: Path, raw: bytes, exc: UnicodeDecodeError) -> None:
        self.line, self.column = byte_position(raw, exc.start)
        super().__init__(
            errno.EILSEQ,
            f"byte 0x{raw[exc.start]:02x} on line {self.line}, column {self.column} is not UTF-8",
            str(path),
        )


def byte_position(raw: bytes, offset: int) -> tuple[int, int]:
    """The line and column (from 1) of byte ``offset`` of ``raw``."""
    before = raw[:offset]
    return before.count(b"\n") + 1, offset - (before.rfind(b"\n") + 1) + 1


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((name for test, name in kinds if test(mode)), "a file of another kind")


def open_regular(path: Path) -> IO[bytes]:
    """``path`` opened for binary reading, refused (:class:`NotRegularFile`) unless it is
    a regular file: opened non-blocking and checked by ``fstat`` on the open descriptor,
    since checking the path first and then opening it would still block on a FIFO (and
    races a rename)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(path, mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path, limit: int) -> bytes:
    """Every byte of the regular file ``path``, at most ``limit`` of them: refused by its
    size before anything is read, and again if it grew past ``limit`` since."""
    with open_regular(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise FileTooLarge(path, size, limit)
        raw = fh.read(limit + 1)
    if len(raw) > limit:
        raise FileTooLarge(path, len(raw), limit)
    return raw


def read_text(path: Path, limit: int) -> str:
    """The regular file ``path`` as UTF-8 text, at most ``limit`` bytes of it: refused as
    :func:`read_regular` refuses, and with :class:`NotUtf8` naming the first bad byte."""
    raw = read_regular(path, limit)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotUtf8(path, raw, exc) from None
