"""Where running code came from: the git commit of the checkout it runs from."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["git_commit"]


def git_commit(path: Path | None = None) -> str:
    """``git rev-parse HEAD`` of the checkout holding ``path`` (default: mlscope's own
    source), with ``+dirty`` when tracked files differ from it; "" when it is not a
    git checkout or git is missing."""
    where = path or Path(__file__).resolve().parent

    def git(*args: str) -> str:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=where, timeout=5, check=False
        )
        return out.stdout.strip() if out.returncode == 0 else ""

    try:
        head = git("rev-parse", "HEAD")
        if not head:
            return ""
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return f"{head}+dirty" if dirty else head
