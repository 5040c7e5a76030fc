"""A service's heartbeat on a real nats-server: a beat the bucket refuses is logged,
not raised, and the beats go on, so the entry comes back once a beat is stored."""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest
from nats.js.api import KeyValueConfig

from agent.service import Agent, AgentConfig
from mlscope import bus as busmod
from mlscope.catalog import Catalog
from mlscope.natsserver import NatsServer
from mlscope.presence import heartbeat
from mlscope.provision import provisioned
from mlscope.settings import Settings


def test_a_refused_beat_is_logged_and_the_next_one_is_stored(
    nats_server: NatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "data")
    beats: list[bytes] = []

    def beat() -> bytes:
        # The first three beats are larger than the bucket takes; then small ones.
        value = b"x" * 4096 if len(beats) < 3 else b"alive %d" % len(beats)
        beats.append(value)
        return value

    async def main() -> bytes:
        async with busmod.connect(settings, name="test") as bus:
            kv = await bus.js.create_key_value(
                KeyValueConfig(bucket="beats", history=1, max_value_size=256)
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    lambda: heartbeat(kv, "svc", beat, interval_s=0.05, who="service svc")
                )
                with anyio.fail_after(20):
                    while len(beats) < 6:
                        await anyio.sleep(0.05)
                tg.cancel_scope.cancel()
            entry = await kv.get("svc")
            assert entry.value is not None
            return entry.value

    with caplog.at_level(logging.WARNING, logger="mlscope.presence"):
        stored = anyio.run(main, backend="asyncio")
    assert stored.startswith(b"alive ")
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1  # the first of the run of failures (then every 30th)
    assert "service svc: heartbeat not stored (1 in a row)" in errors[0].getMessage()
    again = [r.getMessage() for r in caplog.records if "stored again" in r.getMessage()]
    assert again == ["service svc: heartbeats stored again after 3 failed"]


def test_an_agent_whose_connection_is_closed_still_shuts_down(
    nats_server: NatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Withdrawing from the registry over a closed connection is logged (the entry
    expires by its TTL) and the shutdown goes on."""
    settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "data")
    agent = Agent(settings, AgentConfig(framework="noop", agent_id="leaving"), Catalog.load([]))

    async def main() -> None:
        async with provisioned(settings, name="agent") as bus:
            await bus.nc.close()
            await agent._withdraw(bus, [])

    with caplog.at_level(logging.WARNING, logger="mlscope.agent"):
        anyio.run(main, backend="asyncio")
    assert any("not withdrawn" in r.getMessage() for r in caplog.records)
