"""An agent's registry entry stays within one bus message, however many manifests of
its framework the models bucket holds that it cannot serve.

The entry lists each refused model with its reason: without a bound, enough manifests
on the bus (anyone who may publish one) make it larger than the bus's max payload, and
an agent whose entry cannot be stored is invisible while it runs. The agents here run
in-process on a real nats-server whose max payload is small, so a few dozen manifests
are enough."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest

from agent.models import ModelHost
from agent.registration import fit_description
from agent.service import Agent, AgentConfig
from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.bus import if_found
from mlscope.catalog import Catalog
from mlscope.contracts import (
    MAX_REFUSALS,
    REFUSAL_MESSAGE_MAX_CHARS,
    AgentDescription,
    RefusedModel,
)
from mlscope.errors import BusRefused
from mlscope.manifest import NAME_MAX_CHARS, ModelManifest
from mlscope.manifest_files import parse_manifest
from mlscope.model_registry import publish_manifest
from mlscope.natsserver import NatsServer
from mlscope.provision import provisioned
from mlscope.settings import Settings
from tests.agent_fixtures import Ask, run_agent
from tests.conftest import agent_description

pytestmark = pytest.mark.timeout(120)

SMALL_PAYLOAD = 16 << 10
"""The test server's max payload: 40 refusals of long-named models are well over it."""


def refusal(i: int, message_chars: int = 100) -> RefusedModel:
    return RefusedModel(
        name=f"m{i}",
        version="1.0.0",
        framework="noop",
        reason="missing",
        message="x" * message_chars,
    )


def description(refused: tuple[RefusedModel, ...] = ()) -> AgentDescription:
    return agent_description("a1", refused=refused)


def test_refusals_are_listed_up_to_a_bound_with_messages_cut(tmp_path: Path) -> None:
    host = ModelHost(settings=Settings(data_dir=tmp_path), framework="noop", who="agent a1")
    host.refused = [refusal(i, message_chars=10_000) for i in range(MAX_REFUSALS + 7)]
    listed, more = host.advertised_refusals()
    assert len(listed) == MAX_REFUSALS and more == 7
    assert all(len(r.message) <= REFUSAL_MESSAGE_MAX_CHARS for r in listed)
    assert [r.name for r in listed] == [f"m{i}" for i in range(MAX_REFUSALS)]
    with pytest.raises(ValueError, match="at most"):
        description(tuple(host.refused))  # the contract refuses an unbounded list


def test_a_description_is_fitted_to_the_payload_by_dropping_refusals() -> None:
    full = description(tuple(refusal(i, 300) for i in range(MAX_REFUSALS)))
    whole = len(codec.encode_model(full))
    desc, payload = fit_description(full, whole)
    assert desc == full and payload == codec.encode_model(full)
    desc, payload = fit_description(full, whole // 3)
    assert len(payload) <= whole // 3
    assert 0 < len(desc.refused) < MAX_REFUSALS
    assert len(desc.refused) + desc.refused_more == MAX_REFUSALS
    assert codec.decode_model(AgentDescription, payload) == desc
    with pytest.raises(BusRefused, match="description"):
        fit_description(full, 100)  # not even without refusals


# --------------------------------------------------------------------- on the bus


@pytest.fixture
def small_bus(tmp_path: Path) -> Iterator[Settings]:
    conf = tmp_path / "small.conf"
    conf.write_text(f"max_payload: {SMALL_PAYLOAD}\n")
    with NatsServer(store_dir=tmp_path / "nats", config_file=conf) as server:
        yield Settings(nats_url=server.url, data_dir=tmp_path / "data")


def long_named(i: int) -> ModelManifest:
    """A valid noop manifest with the longest name allowed, whose artifacts were
    never built: every agent of the framework refuses it."""
    name = f"m{i}_".ljust(NAME_MAX_CHARS, "x")
    doc = {
        "kind": "model",
        "task": "platform_overhead",
        "name": name,
        "version": "1.0.0",
        "framework": {"name": "noop", "version": "*"},
        "inputs": [{"shape": [16]}],
        "outputs": [{}],
        "assets": {"base_url": f"zoo://{name}/1.0.0", "graph_path": "g.onnx"},
        "latency_only": True,
    }
    m = parse_manifest(doc, file=name)
    assert isinstance(m, ModelManifest)
    return m


async def publish(settings: Settings, count: int) -> None:
    async with provisioned(settings, name="publisher") as bus:
        for i in range(count):
            await publish_manifest(bus, long_named(i))


async def entry(bus: busmod.Bus, agent_id: str) -> AgentDescription | None:
    """The agent's registry entry; None once it has left the registry (its TTL)."""
    kv = await bus.kv(names.AGENTS_BUCKET)
    found = await if_found(kv.get(agent_id))
    return None if found is None else codec.decode_model(AgentDescription, found.value or b"")


def noop_agent(settings: Settings) -> Agent:
    return Agent(settings, AgentConfig(framework="noop", heartbeat_s=0.2), Catalog([]))


def test_an_agent_starts_and_is_listed_with_many_refused_models(small_bus: Settings) -> None:
    anyio.run(publish, small_bus, 40)
    agent = noop_agent(small_bus)

    async def body(bus: busmod.Bus, ask: Ask) -> None:
        desc = await entry(bus, agent.agent_id)
        assert desc is not None
        assert len(desc.refused) <= MAX_REFUSALS
        assert len(desc.refused) + desc.refused_more == 40
        assert {r.reason for r in desc.refused} == {"missing"}

    run_agent(small_bus, agent, body)


def test_a_running_agent_stays_listed_when_many_models_arrive(small_bus: Settings) -> None:
    agent = noop_agent(small_bus)

    async def body(bus: busmod.Bus, ask: Ask) -> None:
        async def until(check: Callable[[AgentDescription], bool]) -> AgentDescription | None:
            """The entry once ``check`` passes, else as it is after 30 s (None: gone)."""
            desc = await entry(bus, agent.agent_id)
            with anyio.move_on_after(30):
                while desc is not None and not check(desc):
                    await anyio.sleep(0.2)
                    desc = await entry(bus, agent.agent_id)
            return desc

        first = await entry(bus, agent.agent_id)
        assert first is not None and first.refused == ()
        await publish(small_bus, 40)
        listed = await until(lambda d: bool(d.refused) and len(d.refused) + d.refused_more == 40)
        assert listed is not None, "the agent left the registry while it runs"
        assert len(listed.refused) + listed.refused_more == 40, "the new models never showed"
        later = await until(lambda d: d.heartbeat_at > listed.heartbeat_at + 1)
        assert later is not None, "the agent left the registry while it runs"
        assert later.heartbeat_at > listed.heartbeat_at + 1, "the agent's heartbeats stopped"

    run_agent(small_bus, agent, body)
