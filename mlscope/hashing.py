"""Content hashes of files and directory trees (what every checksum in mlscope means)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

__all__ = ["sha256_path", "tree_files", "tree_sha256"]

_CHUNK = 1 << 20


def sha256_path(path: Path) -> str:
    """sha256 of a file, or of a directory tree (relative paths + contents, sorted)."""
    if path.is_dir():
        return tree_sha256(
            (f.relative_to(path).as_posix(), sha256_path(f)) for f in tree_files(path)
        )
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def tree_files(path: Path) -> list[Path]:
    """The regular files below directory ``path``, in the order its hash takes them."""
    return sorted(p for p in path.rglob("*") if p.is_file())


def tree_sha256(files: Iterable[tuple[str, str]]) -> str:
    """sha256 of a directory tree from its files, each (path relative to the tree, its
    sha256), in :func:`tree_files` order: a tree already hashed file by file is not
    read again."""
    digest = hashlib.sha256()
    for relative, sha in files:
        digest.update(relative.encode() + b"\0")
        digest.update(sha.encode())
    return digest.hexdigest()
