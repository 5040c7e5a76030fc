"""Resolving a manifest's assets to verified local files (the data manager).

Asset locations (``assets.base_url``):
    (none)            relative to the manifest's own directory
    zoo://NAME/VER    the built zoo under ``<data_dir>/zoo/NAME/VER``
    file:///dir       a local directory

Every path is checked to stay inside its root, and every file's sha256 is verified
before use (a directory's checksum covers its sorted relative paths and contents).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from mlscope.errors import ArtifactError, ChecksumMismatch

__all__ = ["asset_root", "safe_join", "sha256_path", "verify"]

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


def safe_join(root: Path, relative: str) -> Path:
    """``root / relative``, refusing absolute paths and anything that escapes root."""
    if Path(relative).is_absolute():
        raise ArtifactError(f"path {relative!r} must be relative to {root}", path=relative)
    target = (root / relative).resolve()
    if not target.is_relative_to(root.resolve()):
        raise ArtifactError(f"path {relative!r} escapes {root}", path=relative)
    return target


def asset_root(base_url: str | None, *, manifest_dir: Path, zoo_dir: Path) -> Path:
    if not base_url:
        return manifest_dir
    if base_url.startswith("zoo://"):
        return safe_join(zoo_dir, base_url.removeprefix("zoo://").strip("/"))
    if base_url.startswith("file://"):
        return Path(base_url.removeprefix("file://"))
    raise ArtifactError(f"unsupported asset location {base_url!r}", url=base_url)


def verify(path: Path, expected: str) -> Path:
    """Return ``path`` when it exists and matches ``expected``; else a typed error."""
    if not path.exists():
        raise ArtifactError(f"missing artifact {path} (run `mlscope zoo build`?)",
                            path=str(path))
    actual = sha256_path(path)
    if actual != expected:
        raise ChecksumMismatch(f"{path}: sha256 {actual} does not match manifest {expected}",
                               path=str(path), expected=expected, actual=actual)
    return path
