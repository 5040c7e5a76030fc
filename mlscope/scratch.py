"""Scratch directories: where a process keeps files for the length of one task (an
MLPerf test's logs, a load generator's slices, a profiler's trace), removed when the
task ends.

A process killed outright (SIGKILL, the OOM killer) cannot remove its own, so each
directory's name carries the pid of the process that made it
(``mlscope-<kind>-<pid>-<random>`` in the system's temporary directory), and every
mlscope service that starts removes those whose process is gone (:func:`sweep`):
an MLPerf test's detail and trace logs reach hundreds of MB, and a host whose agent
was killed now and then would keep each one until reboot.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

__all__ = ["STALE_AFTER_S", "scratch_dir", "scratch_path", "sweep"]

STALE_AFTER_S = 12 * 3600.0
"""How long unchanged a dead process's directory must be before it is removed: a
process in another PID namespace (a container sharing ``/tmp``) looks dead from here,
and none of mlscope's tasks runs half a day."""
_NAME = re.compile(r"mlscope-[a-z]+(?:-[a-z]+)*-(\d+)-[^/]+")


def scratch_dir(kind: str) -> tempfile.TemporaryDirectory[str]:
    """A new scratch directory for ``kind`` of task (lower-case words joined by ``-``),
    named so that :func:`sweep` can tell whose it is; removed on ``cleanup()`` or when
    the returned object is collected."""
    return tempfile.TemporaryDirectory(prefix=_prefix(kind))


def scratch_path(kind: str) -> Path:
    """A new scratch directory as :func:`scratch_dir` names it, which the caller
    removes (``shutil.rmtree``) when its task ends."""
    return Path(tempfile.mkdtemp(prefix=_prefix(kind)))


def _prefix(kind: str) -> str:
    if not re.fullmatch(r"[a-z]+(?:-[a-z]+)*", kind):
        raise ValueError(f"scratch kind {kind!r} is not lower-case words joined by '-'")
    return f"mlscope-{kind}-{os.getpid()}-"


def sweep(
    root: Path | None = None, *, stale_after_s: float = STALE_AFTER_S, now: float | None = None
) -> list[Path]:
    """Remove the scratch directories under ``root`` (the system's temporary directory)
    that this user owns, whose process is gone and that nobody changed for
    ``stale_after_s``; the ones removed. Never raises: a directory that cannot be read
    or removed is left as it is."""
    root = Path(tempfile.gettempdir()) if root is None else root
    now = time.time() if now is None else now
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    for entry in entries:
        m = _NAME.fullmatch(entry.name)
        if m is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not entry.is_dir(follow_symlinks=False) or st.st_uid != os.getuid():
                continue
        except OSError:
            continue
        if now - st.st_mtime < stale_after_s or _alive(int(m.group(1))):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            removed.append(Path(entry.path))
    return removed


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists here (one of another user's counts: not ours to
    judge)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # none has it (or could: too large)
        return False
    except PermissionError:
        return True
    return True
