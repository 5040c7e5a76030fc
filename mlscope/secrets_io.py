"""Write a file whole, in one step, with its permissions set from the moment it exists.

Seed files, and configs that hold a seed, must never be readable by others, not even
for the instant between a ``write_text`` and a ``chmod``; and a file planted at the
destination (a symlink to somewhere the writer may write) must not redirect the write.
So the data goes to a fresh file beside the destination, created exclusively
(``O_CREAT | O_EXCL`` fails on any existing name, a symlink included) with its final
mode, is flushed to disk, and is then renamed over the destination: ``os.replace``
replaces a symlink there rather than following it, and a reader sees the old file or
the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

__all__ = ["write_atomic", "write_secret"]

SECRET_MODE = 0o600


def write_secret(path: Path, data: bytes | str) -> None:
    """Write ``data`` to ``path``, readable and writable by its owner only (0600)."""
    write_atomic(path, data, mode=SECRET_MODE)


def write_atomic(path: Path, data: bytes | str, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` in one rename; the file is created with ``mode``
    (less the umask). A failure leaves ``path`` as it was and no temporary file."""
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = _create_beside(path, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _create_beside(path: Path, mode: int) -> tuple[int, Path]:
    """A new file with a random name in ``path``'s directory (the rename must not cross
    file systems), opened for writing; never an existing file or link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, mode), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a temporary file beside {path}")


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable; best effort (not every system can open a
    directory for this)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
