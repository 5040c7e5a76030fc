"""Shared helpers for the zoo tests (plain functions; tests/conftest.py builds on them).

The zoo is built once per test session into a temporary directory, or reused from
``MLSCOPE_TEST_ZOO`` when that is set (CI can point several jobs at one build).
Building is cached at module level, so every test module that asks shares one build.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MANIFESTS = REPO / "manifests"

_session_dir: Path | None = None


def zoo_dir() -> Path:
    global _session_dir
    env = os.environ.get("MLSCOPE_TEST_ZOO")
    if env:
        return Path(env)
    if _session_dir is None:
        _session_dir = Path(tempfile.mkdtemp(prefix="mlscope-test-zoo-"))
    return _session_dir


def remove_session_zoo() -> None:
    """Remove the zoo this session built in a temporary directory (one built for
    ``MLSCOPE_TEST_ZOO`` stays): each is ~75 MB, and a machine that runs the suite
    often would keep them all."""
    global _session_dir
    if _session_dir is not None:
        shutil.rmtree(_session_dir, ignore_errors=True)
        _session_dir = None
        built.cache_clear()


@functools.cache
def built(name: str) -> Path:
    """``<zoo>/<name>/<version>``, built (or found up to date) once per session."""
    from mlscope.zoo.build import BUILDERS, build

    build(zoo_dir(), only=[name], log=lambda _m: None)
    b = BUILDERS[name]
    return zoo_dir() / b.name / b.version
