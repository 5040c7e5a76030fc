"""``mlscope zoo build`` run twice at once on one zoo, and after a killed build.

The builder child (torch, TensorFlow: minutes) is replaced by one that writes each
file of the builder naming who wrote it, and that can be held half-way; everything
else (the build lock, the scratch directory, the swap) is mlscope's own code. The two
builds are threads of this process: an ``flock`` taken through two opens excludes
them as it excludes two processes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlscope.buildlock import BuildLock
from mlscope.errors import MLScopeError
from mlscope.hashing import sha256_path
from mlscope.zoo import build as zoo_build

pytestmark = pytest.mark.timeout(60)

MODEL = zoo_build.BUILDERS["digits_cnn"]


class HeldChild:
    """A fake builder child: the thread named ``held`` signals ``held_inside`` and waits
    for ``release``; any other thread signals ``other_got_far`` (so does the second
    build's log line saying it waits for the lock)."""

    def __init__(self) -> None:
        self.held_inside = threading.Event()
        self.release = threading.Event()
        self.other_got_far = threading.Event()

    def __call__(self, b: zoo_build.Builder, out: Path, env: object) -> dict[str, Any] | None:
        me = threading.current_thread().name
        if me == "held":
            self.held_inside.set()
            if not self.release.wait(30):
                raise RuntimeError("never released")
        else:
            self.other_got_far.set()
        for f in b.files:
            (out / f).write_text(f"{f} by {me}\n")
        return None


def start(
    name: str, zoo: Path, log: Callable[[str], None], errors: dict[str, BaseException]
) -> threading.Thread:
    def go() -> None:
        try:
            zoo_build.build(zoo, only=[MODEL.name], pinned={}, log=log)
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors[name] = exc

    thread = threading.Thread(target=go, name=name)
    thread.start()
    return thread


def installed_writers(model_dir: Path) -> set[str]:
    """Who wrote each installed file; every file must match the build lock."""
    lock = BuildLock.read(model_dir)
    assert lock is not None
    assert set(lock.artifacts) == set(MODEL.files)
    for f, digest in lock.artifacts.items():
        assert sha256_path(model_dir / f) == digest, f
    return {(model_dir / f).read_text().split()[-1] for f in MODEL.files}


def scratch_left(zoo: Path) -> list[str]:
    return sorted(p.name for p in (zoo / MODEL.name).glob(".*partial*"))


def test_a_second_build_waits_for_the_first_and_finds_it_up_to_date(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    child = HeldChild()
    monkeypatch.setattr(zoo_build, "_run_child", child)
    errors: dict[str, BaseException] = {}
    second_log: list[str] = []

    def log_second(line: str) -> None:
        second_log.append(line)
        if "waiting" in line:
            child.other_got_far.set()

    first = start("held", tmp_path, lambda _line: None, errors)
    assert child.held_inside.wait(30)
    second = start("second", tmp_path, log_second, errors)
    assert child.other_got_far.wait(30)  # waiting on the lock, or (wrongly) building
    child.release.set()
    first.join(30)
    second.join(30)
    assert errors == {}
    assert installed_writers(tmp_path / MODEL.name / MODEL.version) == {"held"}
    assert any("waiting" in line for line in second_log)
    assert second_log[-1] == f"{MODEL.name} {MODEL.version}: up to date"
    assert scratch_left(tmp_path) == []


def test_the_scratch_of_a_killed_build_does_not_stop_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zoo_build, "_run_child", HeldChild())
    model_dir = tmp_path / MODEL.name
    for stale in (f".{MODEL.version}.partial", f".{MODEL.version}.partial-k1ll3d"):
        (model_dir / stale).mkdir(parents=True)
        (model_dir / stale / MODEL.files[0]).write_text("half-written\n")
    zoo_build.build(tmp_path, only=[MODEL.name], pinned={}, log=lambda _line: None)
    assert installed_writers(model_dir / MODEL.version) == {"MainThread"}
    assert scratch_left(tmp_path) == []
    mode = (model_dir / MODEL.version).stat().st_mode & 0o777
    assert mode == model_dir.stat().st_mode & 0o777  # as the umask says, not a temp dir's 0700


def test_a_failed_build_leaves_no_scratch_and_lets_the_next_one_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(b: zoo_build.Builder, out: Path, env: object) -> None:
        (out / b.files[0]).write_text("half\n")
        raise zoo_build.BuildFailed(f"building {b.name} failed", model=b.name)

    monkeypatch.setattr(zoo_build, "_run_child", failing)
    with pytest.raises(MLScopeError, match="failed"):
        zoo_build.build(tmp_path, only=[MODEL.name], pinned={}, log=lambda _line: None)
    assert scratch_left(tmp_path) == []
    assert not (tmp_path / MODEL.name / MODEL.version).exists()
    monkeypatch.setattr(zoo_build, "_run_child", HeldChild())
    zoo_build.build(tmp_path, only=[MODEL.name], pinned={}, log=lambda _line: None)
    assert installed_writers(tmp_path / MODEL.name / MODEL.version) == {"MainThread"}


def test_a_lock_hashes_each_file_once_and_its_trees_as_sha256_path_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build lock's hash of a directory artifact (a SavedModel) is made from its files'
    hashes, the same digest ``sha256_path`` gives the tree; no file is read twice."""
    from mlscope import buildlock

    (tmp_path / "m.savedmodel" / "variables").mkdir(parents=True)
    (tmp_path / "m.savedmodel" / "saved_model.pb").write_bytes(b"graph")
    (tmp_path / "m.savedmodel" / "variables" / "v.data").write_bytes(b"\0" * 3000)
    (tmp_path / "m.savedmodel" / "variables" / "v.index").write_bytes(b"index")
    (tmp_path / "m.onnx").write_bytes(b"onnx")
    expected = {a: sha256_path(tmp_path / a) for a in ("m.savedmodel", "m.onnx")}
    read: list[Path] = []

    def counted(path: Path) -> str:
        if path.is_file():
            read.append(path)
        return sha256_path(path)

    monkeypatch.setattr(buildlock, "sha256_path", counted)
    lock = BuildLock.of(
        tmp_path, model="m", version="1", artifacts=["m.savedmodel", "m.onnx"], origin={}
    )
    assert lock.artifacts == expected
    assert sorted(lock.files) == [
        "m.onnx",
        "m.savedmodel/saved_model.pb",
        "m.savedmodel/variables/v.data",
        "m.savedmodel/variables/v.index",
    ]
    assert lock.files["m.savedmodel/variables/v.data"] == sha256_path(
        tmp_path / "m.savedmodel/variables/v.data"
    )
    assert sorted(read) == sorted(p for p in tmp_path.rglob("*") if p.is_file())
