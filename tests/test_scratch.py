"""Scratch directories a killed process left behind are removed by the next service
that starts, and nothing else is: not a live process's, not a fresh one, not another
name, not what a symbolic link points to."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mlscope import scratch


def later() -> float:
    """A moment when every directory made by now is stale (read when used: a suite
    that collected this module half an hour before running it is no reason to differ)."""
    return time.time() + scratch.STALE_AFTER_S + 60


def dead_pid() -> int:
    """The pid of a process that has ended (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_process_scratch_directory_is_swept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    code = (
        "import sys, time\n"
        "from mlscope import scratch\n"
        "d = scratch.scratch_dir('mlperf-agent')\n"
        "open(d.name + '/mlperf_log_detail.txt', 'w').write('x' * 1000)\n"
        "print(d.name, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    left = Path(proc.stdout.readline().strip())
    assert left.parent == tmp_path and left.name.startswith(f"mlscope-mlperf-agent-{proc.pid}-")
    assert scratch.sweep(tmp_path, now=later()) == []  # its process still runs
    proc.kill()  # SIGKILL: no cleanup
    proc.communicate()
    assert (left / "mlperf_log_detail.txt").exists()
    assert scratch.sweep(tmp_path) == []  # fresh: maybe a process another namespace runs
    assert scratch.sweep(tmp_path, now=later()) == [left]
    assert not left.exists()
    # What a live process of this one makes is its own, and never swept.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = scratch.scratch_path("ortprof")
    assert mine.name.startswith(f"mlscope-ortprof-{os.getpid()}-")
    assert scratch.sweep(tmp_path, now=later()) == [] and mine.is_dir()


def test_only_stale_directories_of_gone_processes_are_swept(tmp_path: Path) -> None:
    gone = dead_pid()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("kept")
    made = {
        "stale": tmp_path / f"mlscope-mlperf-{gone}-abc",
        "huge pid": tmp_path / f"mlscope-loadgen-{10**30}-x",
        "live": tmp_path / f"mlscope-mlperf-{os.getpid()}-abc",
        "other name": tmp_path / f"mlperf-{gone}-abc",
        "no pid": tmp_path / "mlscope-mlperf-abc",
    }
    for path in made.values():
        path.mkdir()
        (path / "f").write_text("x")
    a_file = tmp_path / f"mlscope-mlperf-{gone}-file"
    a_file.write_text("not a directory")
    link = tmp_path / f"mlscope-mlperf-{gone}-link"
    link.symlink_to(target)
    removed = scratch.sweep(tmp_path, now=later())
    assert sorted(removed) == sorted([made["stale"], made["huge pid"]])
    for name in ("live", "other name", "no pid"):
        assert made[name].is_dir(), name
    assert a_file.exists() and link.is_symlink() and (target / "keep.txt").exists()
    assert scratch.sweep(tmp_path / "missing") == []
    with pytest.raises(ValueError):
        scratch.scratch_dir("../x")
