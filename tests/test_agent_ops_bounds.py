"""An agent's control operations against hostile-but-valid requests, on a real
nats-server with ONNX Runtime's digits_cnn: a released evaluation's local run stops, a
samples query cannot take more memory than the agent's samples may, and a run whose
answers no run could hold is refused before anything is allocated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from agent.service import Agent, AgentConfig
from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.catalog import Catalog
from mlscope.errors import error_from_wire
from mlscope.settings import Settings
from tests.agent_fixtures import Ask, run_agent
from tests.pipeline_fixtures import digits_entry

pytestmark = pytest.mark.timeout(180)
AGENT = "ops-bounds"


def _agent(settings: Settings, **config: Any) -> Agent:
    return Agent(
        settings,
        AgentConfig(framework="onnxruntime", agent_id=AGENT, threads=1, **config),
        Catalog([digits_entry()]),
    )


def _prepare(ev: str) -> dict[str, Any]:
    return {"op": "prepare", "evaluation_id": ev, "model": "digits_cnn"} | {
        "model_version": "1.0.0",
        "trace_level": "none",
    }


def _run(ev: str, **scenario: Any) -> dict[str, Any]:
    return {"op": "run", "evaluation_id": ev, "trace_level": "none", "scenario": scenario}


def test_releasing_an_evaluation_stops_its_local_run(settings: Settings, zoo_dir: Path) -> None:
    """A cancelled job's server releases the evaluation: its run ends now (its final
    rows still shipped), its held samples are given back, and the next run may hold
    samples again. The run had half a minute to go."""
    agent = _agent(settings, sample_memory_bytes=150_000)

    async def body(bus: busmod.Bus, ask: Ask) -> None:
        assert (await ask(_prepare("ev-1")))["ok"]
        rows = await bus.nc.subscribe(names.agent_rows(AGENT, "ev-1"))
        long = {"name": "single-stream", "duration_s": 30, "preprocess": "ahead"}
        started = await ask(_run("ev-1", **long))
        assert started["preprocess"] == "ahead" and agent.sample_memory.used > 0
        await anyio.sleep(1.0)
        await ask({"op": "release", "evaluation_id": "ev-1", "unload": False})
        final: dict[str, Any] = {}
        with anyio.fail_after(20):  # far less than the run's 30 s
            while not final.get("final"):
                final = codec.decode((await rows.next_msg(timeout=20)).data)
        with pytest.raises(TimeoutError):  # nothing after the final rows
            await rows.next_msg(timeout=1.0)
        assert agent.sample_memory.used == 0 and not agent.runs.running
        assert (await ask(_prepare("ev-2")))["ok"]
        again = await ask(_run("ev-2", **{**long, "duration_s": 0.5}))
        assert again["preprocess"] == "ahead", again

    run_agent(settings, agent, body)


def test_preparing_an_evaluation_again_takes_over_its_local_run(
    settings: Settings, zoo_dir: Path
) -> None:
    """A job restarted after its server was lost prepares its evaluation again: the
    lost server's local run ends (its final rows shipped before the prepare is
    answered, so none reaches the new run's subscriber) and the new run starts."""
    agent = _agent(settings)

    async def body(bus: busmod.Bus, ask: Ask) -> None:
        assert (await ask(_prepare("ev-1")))["ok"]
        long = {"name": "single-stream", "duration_s": 30}
        await ask(_run("ev-1", **long))
        await anyio.sleep(0.5)
        assert (await ask(_prepare("ev-1")))["ok"]  # the restarted job's server
        assert not agent.runs.running
        rows = await bus.nc.subscribe(names.agent_rows(AGENT, "ev-1"))
        again = await ask(_run("ev-1", **{**long, "duration_s": 0.5}))
        assert again.get("kind") == "run_started", again
        got: list[dict[str, Any]] = []
        with anyio.fail_after(20):
            while not (got and got[-1].get("final")):
                got.append(codec.decode((await rows.next_msg(timeout=20)).data))
        # Only the new run's messages, from its first: the old run's final rows went
        # out before the prepare was answered.
        assert (got[0]["seq"], got[0]["start"]) == (0, 0)
        assert [m["seq"] for m in got] == list(range(len(got)))
        with pytest.raises(TimeoutError):
            await rows.next_msg(timeout=1.0)

    run_agent(settings, agent, body)


def test_a_samples_query_takes_no_more_than_the_agents_sample_memory(
    settings: Settings, zoo_dir: Path
) -> None:
    """One held sample named many times in one query would be stacked that many times
    (a 3 KB message took 4 GB): refused, and the agent answers the next query."""
    agent = _agent(settings, sample_memory_bytes=1 << 20)

    async def body(bus: busmod.Bus, ask: Ask) -> None:
        assert (await ask(_prepare("ev-1")))["ok"]
        await ask({"op": "load_samples", "evaluation_id": "ev-1", "indices": [0]})

        async def query(n: int) -> dict[str, Any]:
            q = {"kind": "samples_query", "evaluation_id": "ev-1", "index": n}
            data = codec.encode({**q, "samples": np.zeros(n, np.int64)})
            out: dict[str, Any] = codec.decode(
                (await bus.nc.request(names.agent_samples(AGENT), data, timeout=30)).data
            )
            return out

        refused = await query(100_000)
        assert refused["kind"] == "error", refused
        assert "sample memory" in str(error_from_wire(refused["error"]))
        assert (await query(4))["ok"]

    run_agent(settings, agent, body)


@pytest.mark.parametrize(
    "scenario",
    [
        {"name": "online", "qps": 1000, "duration_s": 100, "batch_size": 65536},
        {"name": "concurrency", "concurrency": 4096, "duration_s": 1, "batch_size": 65536},
    ],
)
def test_a_run_whose_answers_no_run_could_hold_is_refused(
    settings: Settings, zoo_dir: Path, scenario: dict[str, Any]
) -> None:
    """Each sample's answer is kept (queries x batch): 6.5 billion would take 26 GB
    before the run starts. Refused with the reason; the agent goes on."""
    agent = _agent(settings)

    async def body(bus: busmod.Bus, ask: Ask) -> None:
        assert (await ask(_prepare("ev-1")))["ok"]
        refused = await ask(_run("ev-1", **scenario, preprocess="timed"))
        assert refused["kind"] == "error", str(refused)[:300]
        assert "samples' answers" in str(error_from_wire(refused["error"]))
        assert (await ask({"op": "ping"}))["kind"] == "pong"

    run_agent(settings, agent, body)


def test_a_query_larger_than_the_agents_sample_memory_is_refused(
    settings: Settings, zoo_dir: Path
) -> None:
    """A local run gathers each query's batch of inputs: a batch over the agent's sample
    memory (a large model at a large batch size: tens of GB for one query) is refused
    before anything is allocated, naming the flag and the largest batch that fits; a
    batch that fits runs."""
    agent = _agent(settings, sample_memory_bytes=150_000)  # digits_cnn: 256 bytes a sample

    async def body(bus: busmod.Bus, ask: Ask) -> None:
        assert (await ask(_prepare("ev-1")))["ok"]
        big = {"name": "batched", "duration_s": 0.5, "batch_size": 1024}
        refused = await ask(_run("ev-1", **big))
        assert refused["kind"] == "error", str(refused)[:300]
        said = str(error_from_wire(refused["error"]))
        assert "batch size 1024 holds 262,144 bytes" in said and "--sample-memory" in said
        assert "the largest batch size that fits is 585" in said, said
        assert agent.sample_memory.used == 0 and not agent.runs.running
        fits = await ask(_run("ev-1", **{**big, "batch_size": 512}))
        assert fits.get("kind") == "run_started", str(fits)[:300]

    run_agent(settings, agent, body)
