"""The catalog: every model manifest the process knows, found by name and framework.

Manifests come from the repository's ``manifests/`` directory and any extra trusted
directory in the settings. Resolution picks the highest version meeting a constraint.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from mlscope.artifacts import asset_root, safe_join, verify
from mlscope.errors import UnknownModelError
from mlscope.manifest import ModelManifest, iter_manifest_files, load_manifest
from mlscope.versions import satisfies

__all__ = ["Catalog", "Entry", "default_manifest_dirs"]


def default_manifest_dirs(extra: Path | None = None) -> list[Path]:
    """The repository's manifests/ (found from this file) plus an optional extra dir."""
    repo = Path(__file__).resolve().parent.parent / "manifests"
    dirs = [repo] if repo.is_dir() else []
    if extra is not None:
        dirs.append(extra)
    return dirs


@dataclass(frozen=True)
class Entry:
    manifest: ModelManifest
    path: Path
    """The manifest file (its directory anchors relative asset paths)."""
    trusted: bool = True
    """Loaded from a local directory (custom Python steps may run)."""

    def root(self, zoo_dir: Path) -> Path:
        return asset_root(self.manifest.assets.base_url, manifest_dir=self.path.parent,
                          zoo_dir=zoo_dir)

    def graph(self, zoo_dir: Path) -> Path:
        """The verified graph file (or directory) of this model."""
        target = safe_join(self.root(zoo_dir), self.manifest.assets.graph_path)
        return verify(target, self.manifest.assets.sha256)

    def dataset(self, zoo_dir: Path) -> Path | None:
        ds = self.manifest.dataset
        if ds is None:
            return None
        return verify(safe_join(self.root(zoo_dir), ds.path), ds.sha256)


class Catalog:
    def __init__(self, entries: Iterable[Entry]) -> None:
        self.entries = list(entries)

    @classmethod
    def load(cls, dirs: Iterable[Path]) -> Catalog:
        entries = []
        for f in iter_manifest_files(dirs):
            m = load_manifest(f)
            if isinstance(m, ModelManifest):
                entries.append(Entry(m, f))
        return cls(entries)

    def models(self) -> list[str]:
        return sorted({e.manifest.name for e in self.entries})

    def find(self, name: str, *, version: str | None = None,
             framework: str | None = None) -> Entry:
        """The highest matching version; UnknownModelError says what exists."""
        named = [e for e in self.entries if e.manifest.name == name]
        if not named:
            raise UnknownModelError(
                f"unknown model {name!r}; known models: {', '.join(self.models()) or 'none'}",
                model=name)
        hits = [e for e in named
                if (framework is None or e.manifest.framework.name == framework)
                and (version is None or satisfies(e.manifest.version, version))]
        if not hits:
            have = ", ".join(sorted(f"{e.manifest.version}/{e.manifest.framework.name}"
                                    for e in named))
            raise UnknownModelError(
                f"model {name!r} has no manifest for version {version or 'any'} on "
                f"framework {framework or 'any'}; it has: {have}", model=name)
        return max(hits, key=lambda e: Version(e.manifest.version))
