"""A real stack with a noop agent (nats-server, server and agent processes), per module."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from cli.services import Stack
from mlscope.settings import Settings
from tests.conftest import REPO, make_data_dir, wait_agents


@pytest.fixture(scope="module")
def noop_stack(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[Stack]:
    """``mlscope up --frameworks noop`` as child processes; yields the running Stack."""
    base = make_data_dir(tmp_path_factory.mktemp("noopstack"), zoo_dir)
    os.environ.setdefault("PYTHONPATH", str(REPO))
    s = Stack(Settings(data_dir=base), nats_port=0, frameworks=["noop"])
    s.start()
    try:
        anyio.run(wait_agents, s.settings, 1)
        yield s
    finally:
        s.stop()
        shutil.rmtree(base / "nats", ignore_errors=True)
