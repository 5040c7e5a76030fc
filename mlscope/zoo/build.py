"""``mlscope zoo build``: build every zoo artifact offline, idempotently.

Each builder writes into a scratch directory next to ``<zoo_dir>/<name>/<version>/``
and the directory is swapped into place only when the builder finished, so an
interrupted build leaves nothing half-written. A model is skipped when every file it
produces already exists with the checksum its committed manifest pins (or, with no
manifest yet, simply exists); ``force`` rebuilds anyway.

Every builder runs in a fresh child process (``python -m mlscope.zoo.build NAME DIR``):
TorchScript type names and TensorFlow function names come from process-wide counters,
so only a fresh process gives the same bytes every time. (It also hands the memory of
TensorFlow and torch back after each model.)

The child also pins every numeric library to one code path whatever the processor
(``PORTABLE_MATH``): training and constant folding otherwise round differently on
AVX2, AVX-512 and AMD machines (PyTorch picks its kernels by the CPU's instruction
set), and the committed checksums would only hold on the CPU that wrote them.

Models that are read in place from installed wheels (``light_*``, ``silero_vad``,
``basic_pitch``, through ``pkg://``) have nothing to build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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


PORTABLE_MATH = {
    "ATEN_CPU_CAPABILITY": "default",  # PyTorch's own kernels: no AVX2/AVX-512 variants
    "ONEDNN_MAX_CPU_ISA": "SSE41",  # PyTorch's convolutions (oneDNN): the x86-64 baseline
    "MKL_CBWR": "COMPATIBLE",  # MKL's matrix products: the same results on every x86 CPU
    "TF_ENABLE_ONEDNN_OPTS": "0",  # TensorFlow: its Eigen kernels, not oneDNN's dispatch
    "OMP_NUM_THREADS": "1",
}
"""Environment of a build child: one code path for every numeric library, any CPU."""


def _run_child(b: Builder, out: Path) -> str:
    """Run one builder in a fresh interpreter; returns what it reported."""
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, **PORTABLE_MATH, "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONHASHSEED": "0", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "mlscope.zoo.build", b.name, str(out)],
                          env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"building {b.name} failed:\n{proc.stderr[-6000:]}")
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""


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
            info = _run_child(b, scratch)
            if info:
                log(f"{b.name}: {info}")
            shutil.rmtree(out, ignore_errors=True)
            scratch.rename(out)
        else:
            log(f"{b.name} {b.version}: up to date")
        result[name] = {f: sha256_path(out / f) for f in b.files}
    return result


def _child(argv: list[str]) -> int:
    name, out = argv
    info = BUILDERS[name].run(Path(out))
    print(info if info else "", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_child(sys.argv[1:]))
