"""A real stack with a noop agent (nats-server, server and agent processes), per module,
and the noop model prepared on it for a Driver of a test's own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker.loadgen import Driver
from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.contracts import PrepareOp, ReleaseOp, ScenarioSpec, TraceLevel
from mlscope.record import RunRecord
from mlscope.registry import list_agents
from mlscope.schedule import constant, poisson
from mlscope.tuning import ProcessTuning
from tests.conftest import running_stack


@pytest.fixture(scope="module")
def noop_stack(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[Stack]:
    """``mlscope up --frameworks noop`` as child processes; yields the running Stack."""
    with running_stack(tmp_path_factory.mktemp("noopstack"), zoo_dir, ["noop"]) as s:
        yield s


async def prepared_noop(bus: busmod.Bus, evaluation_id: str) -> str:
    """Load the noop model for ``evaluation_id`` on the stack's noop agent; its id."""
    agent = next(a for a in await list_agents(bus) if any(f.name == "noop" for f in a.frameworks))
    prepare = PrepareOp(
        evaluation_id=evaluation_id, model="noop", model_version="1.0.0", trace_level="none"
    )
    ctl = names.agent_ctl(agent.agent_id)
    await busmod.request(bus, ctl, codec.encode_model(prepare), timeout=60)
    return agent.agent_id


@asynccontextmanager
async def noop_prepared(bus: busmod.Bus, evaluation_id: str) -> AsyncIterator[str]:
    """The stack's noop agent prepared for ``evaluation_id`` (its id), for the block;
    the evaluation released after it."""
    agent_id = await prepared_noop(bus, evaluation_id)
    try:
        yield agent_id
    finally:
        release = codec.encode_model(ReleaseOp(evaluation_id=evaluation_id))
        await busmod.request(bus, names.agent_ctl(agent_id), release, timeout=10)


def one_sample(g: int) -> np.ndarray:
    """Every query's inputs: one sample of four zeros (the noop model's)."""
    return np.zeros((1, 4), np.float32)


def open_loop(
    bus: busmod.Bus,
    evaluation_id: str,
    subject: str,
    *,
    qps: float,
    duration_s: float,
    seed: int = 0,
    scenario: str = "online",
    inputs: Callable[[int], np.ndarray] = one_sample,
    on_progress: Callable[[RunRecord, float], Awaitable[Any]] | None = None,
) -> Driver:
    """A load generator's open loop to ``subject``: Poisson arrivals (``online``) or
    evenly spaced ones (``constant``) at ``qps`` for ``duration_s``, untraced."""
    schedule = (
        poisson(qps, duration_s=duration_s, seed=seed)
        if scenario == "online"
        else constant(qps, duration_s=duration_s)
    )
    return Driver(
        bus,
        evaluation_id=evaluation_id,
        subject=subject,
        spec=ScenarioSpec(name=scenario, qps=qps, duration_s=duration_s),
        inputs=inputs,
        labels=None,
        trace_level=TraceLevel.NONE,
        schedule=schedule,
        on_progress=on_progress,
        tuning=ProcessTuning(),
    )
