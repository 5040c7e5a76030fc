"""The catalog: every model manifest the process knows, found by name and framework.

Manifests come from the repository's ``manifests/`` directory and any extra trusted
directory in the settings (trusted), or from the bus's model registry (untrusted, see
:mod:`mlscope.model_registry`). Resolution picks the highest version meeting a
constraint. Assets resolve through :class:`mlscope.artifacts.ArtifactStore`; when only
a zoo directory is given, downloads are cached beside it in ``<zoo_dir>/../artifacts``
(the layout of :class:`mlscope.settings.Settings`).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from mlscope.artifacts import ArtifactStore, asset_root, is_remote, safe_join
from mlscope.buildlock import BuildLock
from mlscope.errors import ArtifactError, ChecksumMismatch, ConfigError, UnknownModelError
from mlscope.framework_manifest import FrameworkManifest
from mlscope.manifest import ModelManifest, SystemManifest
from mlscope.manifest_files import iter_manifest_files, load_manifest
from mlscope.regular_files import read_text
from mlscope.versions import satisfies

__all__ = ["LABELS_MAX_BYTES", "Catalog", "Entry", "default_manifest_dirs"]

LABELS_MAX_BYTES = 8 << 20
"""Largest labels file read: ImageNet-21k's names take well under a megabyte."""


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
        """The local asset directory (ArtifactError for http(s) assets)."""
        if is_remote(self.manifest.assets.base_url):
            raise ArtifactError(
                f"{self.manifest.key}: assets are remote "
                f"({self.manifest.assets.base_url}); use graph()/dataset()",
                url=self.manifest.assets.base_url,
            )
        return asset_root(
            self.manifest.assets.base_url, manifest_dir=self.path.parent, zoo_dir=zoo_dir
        )

    def _store(self, zoo_dir: Path, store: ArtifactStore | None) -> ArtifactStore:
        return store if store is not None else ArtifactStore(zoo_dir.parent, zoo_dir=zoo_dir)

    def _verified(
        self,
        zoo_dir: Path,
        store: ArtifactStore | None,
        path: str,
        sha256: str | None,
        fields: tuple[str, str],
    ) -> Path:
        """One asset, resolved and checksum-verified; an error names this manifest file
        and its field (``fields``: the path's, the checksum's)."""
        try:
            return self._store(zoo_dir, store).resolve(
                self.manifest.assets.base_url,
                path,
                sha256,
                manifest_dir=self.path.parent,
                trusted=self.trusted,
                max_bytes=self.manifest.assets.max_bytes,
            )
        except ArtifactError as exc:
            pinned = isinstance(exc, ChecksumMismatch) and exc.fields.get("expected") == sha256
            field = fields[1] if pinned else fields[0]
            raise type(exc)(
                f"{self.path}: field '{field}': {exc.message}",
                **{**exc.fields, "file": str(self.path), "field": field},
            ) from exc

    def graph(self, zoo_dir: Path, *, store: ArtifactStore | None = None) -> Path:
        """The verified graph file (or directory) of this model."""
        a = self.manifest.assets
        return self._verified(
            zoo_dir, store, a.graph_path, a.sha256, ("assets.graph_path", "assets.sha256")
        )

    def graph_sha256(self, zoo_dir: Path) -> str | None:
        """The sha256 the graph is verified against: the manifest's pin, else (a built
        zoo artifact) its build lock's; None when it is not built."""
        a = self.manifest.assets
        if a.sha256 is not None:
            return a.sha256
        lock = BuildLock.read(self.root(zoo_dir))
        return lock.artifacts.get(a.graph_path) if lock is not None else None

    def weights(self, zoo_dir: Path, *, store: ArtifactStore | None = None) -> Path | None:
        a = self.manifest.assets
        if a.weights_path is None:
            return None
        return self._verified(
            zoo_dir,
            store,
            a.weights_path,
            a.weights_sha256,
            ("assets.weights_path", "assets.weights_sha256"),
        )

    def dataset(self, zoo_dir: Path, *, store: ArtifactStore | None = None) -> Path | None:
        """The verified labeled data set (None when the manifest has none)."""
        ds = self.manifest.dataset
        if ds is None:
            return None
        return self._verified(
            zoo_dir, store, ds.path, ds.sha256, ("dataset.path", "dataset.sha256")
        )

    def labels(self, zoo_dir: Path, output: int = 0) -> list[str] | None:
        """The output's labels (one per line) from a local asset directory, if any."""
        name = self.manifest.outputs[output].labels
        if name is None:
            return None
        path = safe_join(self.root(zoo_dir), name)
        try:  # a FIFO would hang the model's load, a device fill the agent's memory
            return read_text(path, LABELS_MAX_BYTES).splitlines()
        except OSError as exc:
            raise ArtifactError(
                f"cannot read labels {path}: {exc.strerror or exc}", path=str(path)
            ) from exc


class Catalog:
    def __init__(
        self,
        entries: Iterable[Entry],
        frameworks: Iterable[FrameworkManifest] = (),
        systems: Iterable[SystemManifest] = (),
    ) -> None:
        self.entries = list(entries)
        self.frameworks = list(frameworks)
        self.systems = list(systems)
        """``kind: system`` files: named system requirements (``--system NAME``)."""

    @classmethod
    def load(cls, dirs: Iterable[Path], *, trusted: bool = True) -> Catalog:
        """Every model, framework and system manifest under ``dirs`` (scenarios are
        skipped)."""
        entries, frameworks, systems = [], [], []
        for f in iter_manifest_files(dirs):
            m = load_manifest(f)
            if isinstance(m, ModelManifest):
                entries.append(Entry(m, f, trusted=trusted))
            elif isinstance(m, FrameworkManifest):
                frameworks.append(m)
            elif isinstance(m, SystemManifest):
                systems.append(m)
        return cls(entries, frameworks, systems)

    def merged(self, other: Iterable[Entry]) -> Catalog:
        """This catalog plus ``other``; a local entry wins over a remote one with its key."""
        have = {e.manifest.key for e in self.entries}
        extra = [e for e in other if e.manifest.key not in have]
        return Catalog([*self.entries, *extra], self.frameworks, self.systems)

    def framework(self, name: str, version: str | None = None) -> FrameworkManifest | None:
        """The framework manifest for ``name``: the one of exactly ``version`` (the
        version an agent probed) when there is one, else the highest; None if none."""
        named = [f for f in self.frameworks if f.name == name]
        exact = [f for f in named if version is not None and f.version == version]
        if exact:
            return exact[0]
        return max(named, key=lambda f: Version(f.version), default=None)

    def system(self, name: str) -> SystemManifest:
        """The ``kind: system`` manifest called ``name``; ConfigError lists them."""
        for s in self.systems:
            if s.name == name:
                return s
        known = ", ".join(sorted(s.name for s in self.systems)) or "none"
        raise ConfigError(f"unknown system {name!r}; known systems: {known}", field="system")

    def tasks(self) -> dict[str, list[Entry]]:
        """Entries grouped by task, each group sorted by name, version and framework."""
        out: dict[str, list[Entry]] = {}
        for e in sorted(
            self.entries,
            key=lambda e: (
                e.manifest.task,
                e.manifest.name,
                Version(e.manifest.version),
                e.manifest.framework.name,
            ),
        ):
            out.setdefault(e.manifest.task, []).append(e)
        return out

    def models(self) -> list[str]:
        return sorted({e.manifest.name for e in self.entries})

    def find(self, name: str, *, version: str | None = None, framework: str | None = None) -> Entry:
        """The highest matching version; UnknownModelError says what exists."""
        named = [e for e in self.entries if e.manifest.name == name]
        if not named:
            close = difflib.get_close_matches(name, self.models(), n=3, cutoff=0.6)
            hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
            raise UnknownModelError(
                f"unknown model {name!r}{hint}; known models: {', '.join(self.models()) or 'none'}",
                model=name,
                suggestions=close,
            )
        hits = [
            e
            for e in named
            if (framework is None or e.manifest.framework.name == framework)
            and (version is None or satisfies(e.manifest.version, version))
        ]
        if not hits:
            have = ", ".join(
                sorted(f"{e.manifest.version}/{e.manifest.framework.name}" for e in named)
            )
            raise UnknownModelError(
                f"model {name!r} has no manifest for version {version or 'any'} on "
                f"framework {framework or 'any'}; it has: {have}",
                model=name,
            )
        return max(hits, key=lambda e: Version(e.manifest.version))
