"""Content hashes of files and directory trees (what every checksum in mlscope means)."""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["sha256_path"]

_CHUNK = 1 << 20


def sha256_path(path: Path) -> str:
    """sha256 of a file, or of a directory tree (relative paths + contents, sorted)."""
    digest = hashlib.sha256()
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(f.relative_to(path).as_posix().encode() + b"\0")
            digest.update(sha256_path(f).encode())
        return digest.hexdigest()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
