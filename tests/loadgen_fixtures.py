"""A real stack with a noop agent (nats-server, server and agent processes), per module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.services import Stack
from tests.conftest import running_stack


@pytest.fixture(scope="module")
def noop_stack(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[Stack]:
    """``mlscope up --frameworks noop`` as child processes; yields the running Stack."""
    with running_stack(tmp_path_factory.mktemp("noopstack"), zoo_dir, ["noop"]) as s:
        yield s
