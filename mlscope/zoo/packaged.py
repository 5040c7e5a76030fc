"""Zoo models whose files ship inside Python wheels.

* ``light_*`` (onnx wheel), ``silero_vad`` and ``basic_pitch`` are read in place
  through ``pkg://`` asset locations; nothing is built for them.
* ``mp_face_detection``: MediaPipe's short-range face detector. mediapipe's own
  dependencies clash with numpy 2, so its wheel is only downloaded (``pip download
  --no-deps``, cached under ``<zoo_dir>/_wheels``, sha256 pinned below) and the
  ``.tflite`` file is extracted from it. Its data set is scikit-image's
  ``lfw_subset``: 100 faces then 100 non-faces, 25x25 gray, stored as uint8.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

from mlscope.zoo.effnet import package_file

__all__ = [
    "LIGHT_MODELS",
    "MEDIAPIPE_WHEEL",
    "build_face_detection",
    "fetch_mediapipe_wheel",
]

LIGHT_MODELS = (
    "bvlc_alexnet",
    "densenet121",
    "inception_v1",
    "inception_v2",
    "resnet50",
    "shufflenet",
    "squeezenet",
    "vgg19",
    "zfnet512",
)

MEDIAPIPE_VERSION = "0.10.21"
MEDIAPIPE_WHEEL = (
    "mediapipe-0.10.21-cp311-cp311-manylinux_2_28_x86_64.whl",
    "05dc4a9e593655a79558d05d6227d31018c2537a4bd3362b51e230cf22aecfe3",
)
FACE_MODEL = "mediapipe/modules/face_detection/face_detection_short_range.tflite"


def fetch_mediapipe_wheel(cache: Path) -> Path:
    """The pinned mediapipe wheel, downloaded once (no dependencies) and verified."""
    name, sha = MEDIAPIPE_WHEEL
    wheel = cache / name
    if not wheel.exists():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.11",
            "--platform",
            "manylinux_2_28_x86_64",
            "-d",
            str(cache),
            f"mediapipe=={MEDIAPIPE_VERSION}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not wheel.exists():
            raise RuntimeError(f"cannot download {name}: {proc.stderr[-2000:]}")
    actual = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if actual != sha:
        wheel.unlink()
        raise RuntimeError(f"{name}: sha256 {actual} is not the pinned {sha}")
    return wheel


def build_face_detection(out: Path, *, wheel_cache: Path) -> None:
    wheel = fetch_mediapipe_wheel(wheel_cache)
    with zipfile.ZipFile(wheel) as zf:
        (out / Path(FACE_MODEL).name).write_bytes(zf.read(FACE_MODEL))
    faces = np.load(package_file("skimage", "data/lfw_subset.npy"))
    x = np.clip(np.rint(faces * 255.0), 0, 255).astype(np.uint8)
    y = np.r_[np.ones(100, np.int64), np.zeros(100, np.int64)]
    with (out / "lfw_subset.npz").open("wb") as fh:
        np.savez(fh, x=x, y=y)
    (out / "labels.txt").write_text("not_face\nface\n")
