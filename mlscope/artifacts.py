"""The data manager (paper section 4.4.1): a manifest's assets as verified local files.

Asset locations (``assets.base_url``):

    (none)               the manifest's own directory
    relative/dir         a directory below the manifest's directory
    zoo://NAME/VER       the built zoo, ``<zoo_dir>/NAME/VER``
    file:///abs/dir      a local directory
    pkg://PACKAGE/sub    a directory inside an installed Python package (found without
                         importing it), e.g. ``pkg://onnx/backend/test/data/light``
    http(s)://host/dir   downloaded into ``<data_dir>/artifacts/<sha256>/<file name>``

Rules:

* An asset path is relative; absolute paths and anything that escapes its root
  (``..``, symlinks pointing out) are refused with :class:`ArtifactError`.
* Every file's sha256 is checked before it is used (a directory's checksum covers its
  sorted relative paths and file hashes), and every download is checked as it lands.
* Built ``zoo://`` assets are checked against the model directory's build lock
  (:mod:`mlscope.buildlock`) rather than the manifest: their bytes depend on the CPU
  that built them. A missing lock or file says how to build it; a file that differs from
  its lock names the file, both hashes and the command that rebuilds it.
* Downloads go to a temporary file in the cache directory, which is renamed into place
  only after its checksum matched; a mismatch raises :class:`ChecksumMismatch` and the
  bad bytes are deleted (a corrupt file already in the cache is deleted and fetched
  again). Files outside the cache are never deleted.
* Concurrent requests for one asset download it once: a per-checksum thread lock
  within the process and an ``flock`` on ``<sha256>.lock`` across processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from mlscope.buildlock import BuildLock
from mlscope.errors import ArtifactError, ChecksumMismatch
from mlscope.fetchpolicy import FetchPolicy
from mlscope.hashing import sha256_path

__all__ = [
    "ArtifactStore",
    "asset_root",
    "check_relative",
    "is_remote",
    "resolve_package",
    "safe_join",
    "verify",
    "zoo_coordinates",
]

_CHUNK = 1 << 20
_REMOTE = ("http://", "https://")


def check_relative(relative: str) -> PurePosixPath:
    """A relative asset path without ``..``; ArtifactError otherwise."""
    if not relative or relative.startswith(("/", "\\")) or Path(relative).is_absolute():
        raise ArtifactError(f"asset path {relative!r} must be relative", path=relative)
    pure = PurePosixPath(relative.replace("\\", "/"))
    if ".." in pure.parts:
        raise ArtifactError(f"asset path {relative!r} must not contain '..'", path=relative)
    return pure


def safe_join(root: Path, relative: str) -> Path:
    """``root / relative``, refusing absolute paths and anything that escapes root."""
    if Path(relative).is_absolute():
        raise ArtifactError(f"path {relative!r} must be relative to {root}", path=relative)
    target = (root / relative).resolve()
    if not target.is_relative_to(root.resolve()):
        raise ArtifactError(f"path {relative!r} escapes {root}", path=relative)
    return target


def is_remote(base_url: str | None) -> bool:
    return bool(base_url) and str(base_url).startswith(_REMOTE)


def resolve_package(url: str) -> Path:
    """``pkg://PACKAGE/sub/dir`` -> that directory of the installed package."""
    rest = url.removeprefix("pkg://").strip("/")
    package, _, sub = rest.partition("/")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError) as exc:
        raise ArtifactError(f"cannot locate package {package!r} for {url}", url=url) from exc
    if spec is None or not spec.submodule_search_locations:
        raise ArtifactError(
            f"package {package!r} is not installed (needed by {url})", url=url, package=package
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    return safe_join(root, sub) if sub else root


def asset_root(base_url: str | None, *, manifest_dir: Path, zoo_dir: Path) -> Path:
    """The local directory that a (non-http) ``base_url`` names."""
    if not base_url:
        return manifest_dir
    if base_url.startswith("zoo://"):
        return safe_join(zoo_dir, base_url.removeprefix("zoo://").strip("/"))
    if base_url.startswith("file://"):
        return Path(urllib.parse.unquote(base_url.removeprefix("file://")))
    if base_url.startswith("pkg://"):
        return resolve_package(base_url)
    if "://" not in base_url:
        return safe_join(manifest_dir, base_url)
    raise ArtifactError(f"unsupported asset location {base_url!r}", url=base_url)


def verify(path: Path, expected: str, *, against: str = "manifest", fix: str = "") -> Path:
    """Return ``path`` when it exists and matches ``expected``; else a typed error.

    ``against`` names where ``expected`` came from; ``fix`` is the command that mends it.
    """
    hint = f"; run `{fix}`" if fix else ""
    if not path.exists():
        raise ArtifactError(
            f"missing artifact {path}{hint or ' (run `mlscope zoo build`?)'}",
            path=str(path),
            reason="missing",
            fix=fix,
        )
    actual = sha256_path(path)
    if actual != expected:
        raise ChecksumMismatch(
            f"{path}: sha256 {actual} does not match the {against}'s {expected}{hint}",
            path=str(path),
            expected=expected,
            actual=actual,
            reason="checksum",
            fix=fix,
        )
    return path


_ZOO_NAME = re.compile(r"[A-Za-z0-9_\-]{1,128}")
_ZOO_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+\-]{0,63}")


def zoo_coordinates(base_url: str) -> tuple[str, str]:
    """``zoo://NAME/VERSION`` -> (NAME, VERSION): a model name as manifests have them
    and a version that names one directory (no ``/``, no ``..``); ArtifactError for
    anything else (the pair names ``<zoo_dir>/NAME/VERSION``, which a fetch replaces)."""
    name, _, version = base_url.removeprefix("zoo://").strip("/").partition("/")
    if not _ZOO_NAME.fullmatch(name) or not _ZOO_VERSION.fullmatch(version) or ".." in version:
        raise ArtifactError(
            f"built asset location {base_url[:100]!r} is not zoo://NAME/VERSION",
            path=base_url[:100],
        )
    return name, version


class ArtifactStore:
    """Resolves, downloads, caches and verifies assets (see the module docstring)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        zoo_dir: Path | None = None,
        timeout_s: float = 30.0,
        policy: FetchPolicy | None = None,
    ) -> None:
        self.policy = policy or FetchPolicy()
        """Which locations untrusted manifests may name; every download's size cap."""
        self.cache_dir = data_dir / "artifacts"
        """Downloads, by checksum: ``<cache_dir>/<sha256>/<file name>``."""
        self.zoo_dir = zoo_dir if zoo_dir is not None else data_dir / "zoo"
        self.timeout_s = timeout_s
        self._guard = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._verified: dict[Path, tuple[int, int, str]] = {}

    def resolve(
        self,
        base_url: str | None,
        relative: str,
        sha256: str | None,
        *,
        manifest_dir: Path,
        trusted: bool = True,
        max_bytes: int | None = None,
    ) -> Path:
        """The verified local file (or directory) for one asset of a manifest; an
        untrusted one (from the bus) only where the fetch policy allows, checked
        before anything is read or requested."""
        pure = check_relative(relative)
        if not trusted:
            self.policy.check_untrusted(base_url)
        if is_remote(base_url):
            if sha256 is None:
                raise ArtifactError(f"a remote asset needs a sha256: {relative!r}", path=relative)
            url = f"{str(base_url).rstrip('/')}/{urllib.parse.quote(pure.as_posix())}"
            return self.download(url, sha256, name=pure.name, max_bytes=max_bytes, trusted=trusted)
        root = asset_root(base_url, manifest_dir=manifest_dir, zoo_dir=self.zoo_dir)
        if base_url and base_url.startswith("zoo://"):
            return self.resolve_built(root, pure.as_posix(), sha256, base_url=base_url)
        if sha256 is None:
            raise ArtifactError(
                f"asset {relative!r} has no sha256 to verify it against", path=relative
            )
        return self.verify_local(safe_join(root, pure.as_posix()), sha256)

    def resolve_built(
        self, root: Path, relative: str, pinned: str | None, *, base_url: str
    ) -> Path:
        """A built artifact, verified against its build lock (and ``pinned``, the
        manifest's sha256, when the manifest pins these bytes too)."""
        name, version = zoo_coordinates(base_url)
        build = f"mlscope zoo build --only {name}"
        lock = BuildLock.read(root)
        expected = lock.artifacts.get(relative) if lock is not None else None
        if expected is None:
            raise ArtifactError(
                f"{name} {version} is not built here: no build lock lists {relative} in "
                f"{root}; run `{build}`",
                path=str(root / relative),
                reason="missing",
                fix=build,
            )
        if pinned is not None and pinned != expected:
            raise ChecksumMismatch(
                f"{root / relative}: the build lock's sha256 {expected} differs from the "
                f"manifest's {pinned}; run `{build} --force`",
                path=str(root / relative),
                expected=pinned,
                actual=expected,
                reason="checksum",
                fix=f"{build} --force",
            )
        return self.verify_local(
            safe_join(root, relative), expected, against="build lock", fix=f"{build} --force"
        )

    def verify_local(
        self, path: Path, sha256: str, *, against: str = "manifest", fix: str = ""
    ) -> Path:
        """:func:`verify`, remembering files whose size and mtime have not changed."""
        if path.is_file():
            st = path.stat()
            if self._verified.get(path) == (st.st_size, st.st_mtime_ns, sha256):
                return path
            verify(path, sha256, against=against, fix=fix)
            self._verified[path] = (st.st_size, st.st_mtime_ns, sha256)
            return path
        return verify(path, sha256, against=against, fix=fix)

    def download(
        self,
        url: str,
        sha256: str,
        *,
        name: str | None = None,
        max_bytes: int | None = None,
        trusted: bool = True,
    ) -> Path:
        """The cached, verified copy of ``url``; downloaded once, atomically, at most
        ``max_bytes`` (the policy's ceiling caps it) and, for an untrusted manifest,
        only from under the policy's URL prefixes."""
        if not url.startswith(_REMOTE):
            raise ArtifactError(f"not an http(s) URL: {url!r}", url=url)
        if not trusted:
            self.policy.check_url(url)
        fname = name or PurePosixPath(urllib.parse.urlparse(url).path).name or "asset"
        check_relative(fname)
        folder = self.cache_dir / sha256
        target = folder / fname
        with self._thread_lock(sha256), self._file_lock(sha256):
            if target.is_file():
                if sha256_path(target) == sha256:
                    return target
                target.unlink()  # a corrupt cache entry: fetch it again
            folder.mkdir(parents=True, exist_ok=True)
            part = folder / f".{fname}.{uuid.uuid4().hex}.part"
            try:
                actual = self._fetch(url, part, cap=self.policy.cap(max_bytes), trusted=trusted)
                if actual != sha256:
                    raise ChecksumMismatch(
                        f"{url}: downloaded sha256 {actual} does not match manifest {sha256}; "
                        "the download was deleted",
                        url=url,
                        expected=sha256,
                        actual=actual,
                    )
                os.replace(part, target)
            finally:
                part.unlink(missing_ok=True)
        return target

    def _fetch(self, url: str, dest: Path, *, cap: int, trusted: bool = True) -> str:
        """Stream ``url`` into ``dest``, hashing as it lands; ArtifactError as soon as
        the response announces or sends more than ``cap`` bytes."""
        digest = hashlib.sha256()
        opener = self.policy.opener(untrusted=not trusted)
        try:
            with opener.open(url, timeout=self.timeout_s) as resp, dest.open("wb") as fh:
                announced = int(resp.headers.get("Content-Length") or 0)
                if announced > cap:
                    raise _too_big(url, cap, announced)
                got = 0
                while chunk := resp.read(min(_CHUNK, cap + 1 - got)):
                    got += len(chunk)
                    if got > cap:
                        raise _too_big(url, cap, got)
                    digest.update(chunk)
                    fh.write(chunk)
                fh.flush()
                os.fsync(fh.fileno())
        except urllib.error.HTTPError as exc:
            raise ArtifactError(
                f"cannot download {url}: HTTP {exc.code} {exc.reason}", url=url, status=exc.code
            ) from exc
        except urllib.error.URLError as exc:
            raise ArtifactError(f"cannot reach {url}: {exc.reason}", url=url) from exc
        except (OSError, TimeoutError, ValueError) as exc:
            raise ArtifactError(f"cannot download {url}: {exc}", url=url) from exc
        return digest.hexdigest()

    def _thread_lock(self, key: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    @contextlib.contextmanager
    def _file_lock(self, key: str) -> Iterator[None]:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with (self.cache_dir / f"{key}.lock").open("a") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _too_big(url: str, cap: int, size: int) -> ArtifactError:
    return ArtifactError(
        f"{url}: more than the {cap}-byte cap ({size} bytes); the download was stopped and deleted",
        url=url,
        cap=cap,
        size=size,
        reason="too_large",
    )
