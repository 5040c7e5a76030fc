"""The build lock: what was built on this machine (or fetched from the bus), by sha256.

Built zoo artifacts differ in bytes from one CPU to another (training and constant
folding round differently), so committed manifests cannot pin them. Instead the
build records what it made, in ``<zoo_dir>/<name>/<version>/mlscope.lock``::

    {"format": 1, "model": "digits_cnn", "version": "1.0.0",
     "artifacts": {"digits_cnn.onnx": "<sha256>", "digits_cnn.savedmodel": "<tree sha256>"},
     "files": {"digits_cnn.onnx": "<sha256>", "digits_cnn.savedmodel/saved_model.pb": ...},
     "origin": {"by": "build" | "bus", "host": ..., "cpu": ..., "at": ...},
     "behaviour": {...what the build measured...}}

``artifacts`` holds every top-level file or directory (a directory's hash is
:func:`mlscope.hashing.sha256_path`'s tree hash); ``files`` every regular file below,
which is what the artifact bucket stores object by object. Agents verify every
artifact they open against the lock, so a file changed or half-written after the build
is refused; the lock is written last, atomically, so a build that stopped midway has
none.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlscope.errors import ArtifactError
from mlscope.hashing import sha256_path, tree_files, tree_sha256
from mlscope.regular_files import read_regular

__all__ = ["LOCK_NAME", "BuildLock"]

LOCK_NAME = "mlscope.lock"
MAX_LOCK_BYTES = 16 << 20
"""Largest build lock read: a line of about 100 bytes per built file, so some 160,000
files; a lock past it was not written by a build."""
FORMAT = 1
"""History: 1 — artifacts, files, origin, behaviour."""


@dataclass(frozen=True)
class BuildLock:
    """The sha256 of every artifact of one built model version."""

    model: str
    version: str
    artifacts: dict[str, str]
    """Top-level file or directory name -> sha256 (tree hash for a directory)."""
    files: dict[str, str]
    """Every regular file, by path relative to the model directory -> sha256."""
    origin: dict[str, Any] = field(default_factory=dict)
    behaviour: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        root: Path,
        *,
        model: str,
        version: str,
        artifacts: Iterable[str],
        origin: Mapping[str, Any],
        behaviour: Mapping[str, Any] | None = None,
    ) -> BuildLock:
        """Hash what is in ``root`` now."""
        files: dict[str, str] = {}
        tops: dict[str, str] = {}
        for name in sorted(artifacts):  # each file read once
            path = root / name
            key = path.relative_to(root).as_posix()
            if not path.is_dir():
                files[key] = tops[name] = sha256_path(path)
                continue
            tree = [(f.relative_to(path).as_posix(), sha256_path(f)) for f in tree_files(path)]
            files.update((f"{key}/{relative}", sha) for relative, sha in tree)
            tops[name] = tree_sha256(tree)
        return cls(
            model=model,
            version=version,
            artifacts=tops,
            files=files,
            origin={"at": time.time(), **origin},
            behaviour=dict(behaviour or {}),
        )

    @classmethod
    def read(cls, root: Path) -> BuildLock | None:
        """The lock of the model directory ``root``; None when there is none."""
        path = root / LOCK_NAME
        try:
            doc = json.loads(read_regular(path, MAX_LOCK_BYTES))
        except FileNotFoundError:
            return None
        except OSError as exc:  # a FIFO or a directory too: refused, never waited on
            why = exc.strerror or str(exc)
            raise ArtifactError(f"unreadable build lock {path}: {why}", path=str(path)) from exc
        except ValueError as exc:
            raise ArtifactError(f"unreadable build lock {path}: {exc}", path=str(path)) from exc
        return cls.from_json(doc, where=str(path))

    @classmethod
    def from_json(cls, doc: Any, *, where: str) -> BuildLock:
        try:
            if doc.get("format") != FORMAT:
                raise ValueError(f"format {doc.get('format')!r}, expected {FORMAT}")
            return cls(
                model=str(doc["model"]),
                version=str(doc["version"]),
                artifacts={str(k): str(v) for k, v in doc["artifacts"].items()},
                files={str(k): str(v) for k, v in doc["files"].items()},
                origin=dict(doc.get("origin") or {}),
                behaviour=dict(doc.get("behaviour") or {}),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"invalid build lock {where}: {exc}", path=where) from exc

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": self.model,
            "version": self.version,
            "artifacts": self.artifacts,
            "files": self.files,
            "origin": self.origin,
            "behaviour": self.behaviour,
        }

    def write(self, root: Path) -> Path:
        """Write atomically (temporary file, fsync, rename)."""
        path = root / LOCK_NAME
        tmp = root / f".{LOCK_NAME}.{os.getpid()}.tmp"
        with tmp.open("w") as fh:
            json.dump(self.to_json(), fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        return path

    def same_bytes(self, other: BuildLock) -> bool:
        return self.files == other.files
