"""``mlscope zoo build``: build every zoo artifact offline, idempotently.

Each builder writes into a scratch directory next to ``<zoo_dir>/<name>/<version>/``
and the directory is swapped into place only when the builder finished, so an
interrupted build leaves nothing half-written. A model is skipped when every file it
produces already exists with the checksum its committed manifest pins (or, with no
manifest yet, simply exists); ``force`` rebuilds anyway.

Models that are read in place from installed wheels (``light_*``, ``silero_vad``,
``basic_pitch``, through ``pkg://``) have nothing to build.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from mlscope.artifacts import sha256_path

__all__ = ["BUILDERS", "Builder", "build", "expected_checksums"]


@dataclass(frozen=True)
class Builder:
    name: str
    version: str
    files: tuple[str, ...]
    run: Callable[[Path], object]
    """Writes ``files`` into the directory it is given (scratch; swapped in after)."""


def _digits(out: Path) -> object:
    from mlscope.zoo import digits

    return digits.build(out)


def _mnist(out: Path) -> object:
    from mlscope.zoo import mnist

    return mnist.build(out)


def _effnet(out: Path) -> object:
    from mlscope.zoo import effnet

    effnet.build(out)
    return None


def _face(out: Path) -> object:
    from mlscope.zoo import packaged

    # out is <zoo>/<name>/.<version>.partial: wheels are cached at <zoo>/_wheels
    packaged.build_face_detection(out, wheel_cache=out.parent.parent / "_wheels")
    return None


def _formats(stem: str) -> tuple[str, ...]:
    return tuple(f"{stem}{s}" for s in (".onnx", ".pt", ".savedmodel", ".tflite"))


BUILDERS: dict[str, Builder] = {
    "digits_cnn": Builder("digits_cnn", "1.0.0",
                          (*_formats("digits_cnn"), "holdout.npz", "labels.txt"), _digits),
    "mnist_lenet": Builder("mnist_lenet", "1.0.0",
                           (*_formats("mnist_lenet"), "holdout.npz", "labels.txt"), _mnist),
    "efficientnet_lite0": Builder(
        "efficientnet_lite0", "1.0.0",
        (*_formats("efficientnet_lite0"), "sanity.npz", "labels.txt"), _effnet),
    "mp_face_detection": Builder(
        "mp_face_detection", "0.10.21",
        ("face_detection_short_range.tflite", "lfw_subset.npz", "labels.txt"), _face),
}


def expected_checksums(manifest_dirs: Iterable[Path] | None = None
                       ) -> dict[str, dict[str, str]]:
    """``{model: {file: sha256}}`` pinned by the committed manifests for zoo assets."""
    from mlscope.catalog import Catalog, default_manifest_dirs

    dirs = list(manifest_dirs) if manifest_dirs is not None else default_manifest_dirs()
    out: dict[str, dict[str, str]] = {}
    for entry in Catalog.load(dirs).entries:
        m = entry.manifest
        if not (m.assets.base_url or "").startswith("zoo://") or m.name not in BUILDERS:
            continue
        pinned = out.setdefault(m.name, {})
        pinned[m.assets.graph_path] = m.assets.sha256
        if m.dataset is not None:
            pinned[m.dataset.path] = m.dataset.sha256
    return out


def _up_to_date(out: Path, b: Builder, pinned: Mapping[str, str]) -> bool:
    if not all((out / f).exists() for f in b.files):
        return False
    return all(sha256_path(out / f) == sha for f, sha in pinned.items())


def build(zoo_dir: Path, *, only: Iterable[str] | None = None, force: bool = False,
          log: Callable[[str], None] = print,
          pinned: Mapping[str, Mapping[str, str]] | None = None) -> dict[str, dict[str, str]]:
    """Build the selected models; returns ``{model: {file: sha256}}``.

    ``pinned`` (default: from the committed manifests) decides what is up to date.
    """
    wanted = list(only) if only else list(BUILDERS)
    unknown = [n for n in wanted if n not in BUILDERS]
    if unknown:
        raise KeyError(f"unknown zoo model(s) {unknown}; known: {sorted(BUILDERS)}")
    pins = expected_checksums() if pinned is None else pinned
    result: dict[str, dict[str, str]] = {}
    for name in wanted:
        b = BUILDERS[name]
        out = zoo_dir / b.name / b.version
        if force or not _up_to_date(out, b, pins.get(name, {})):
            log(f"building {b.name} {b.version} -> {out}")
            scratch = out.parent / f".{b.version}.partial"
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            info = b.run(scratch)
            if info:
                log(f"{b.name}: {info}")
            shutil.rmtree(out, ignore_errors=True)
            scratch.rename(out)
        else:
            log(f"{b.name} {b.version}: up to date")
        result[name] = {f: sha256_path(out / f) for f in b.files}
    return result
