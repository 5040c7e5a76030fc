"""A local run's rows are flow-controlled on a real nats-server: a server that reads
them slowly is never cut off as a slow consumer, and gets every message in order."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.runrows import _Shipper, rows_publisher
from broker.agentrun import _read
from mlscope import bus as busmod
from mlscope.contracts import RunOp, ScenarioSpec
from mlscope.natsserver import NatsServer
from mlscope.settings import Settings

pytestmark = pytest.mark.timeout(120)

MESSAGES, SIZE = 48, 256 << 10
"""12 MiB of rows in one shipment, as an overloaded run's final rows come."""


class _Prebuilt(_Shipper):
    """A shipment of ready-made messages (a run's rows, already encoded)."""

    def messages(self, final: bool, extra: dict[str, Any]) -> list[bytes]:
        return [i.to_bytes(4, "big") * (SIZE // 4) for i in range(MESSAGES)]


def test_a_server_that_reads_rows_slowly_gets_them_all_and_is_not_cut_off(
    tmp_path: Path,
) -> None:
    """nats-server cuts a client off once it leaves more than its max pending unread
    (2 MiB here, 64 MiB by default). The server's collector blocks its event loop ~10 ms
    per message (decoding rows into the record); the agent's shipment of 12 MiB waits
    every 1 MiB until the collector says it has read them, so every message arrives,
    in order, on a connection that was never cut."""
    conf = tmp_path / "slow.conf"
    conf.write_text("max_pending: 2MB\n")
    subject = "mlscope.agent.a1.rows.ev-flow"
    spec = ScenarioSpec(name="constant", qps=100, duration_s=1)
    req = RunOp(evaluation_id="ev-flow", scenario=spec, trace_level="none")
    with NatsServer(store_dir=tmp_path / "nats", config_file=conf) as ns:
        settings = Settings(nats_url=ns.url)

        async def main() -> tuple[list[int], int]:
            async with (
                busmod.connect(settings, name="test server") as server,
                busmod.connect(settings, name="test agent") as agent,
            ):
                sub = await server.nc.subscribe(subject, pending_bytes_limit=1 << 30)
                await server.nc.flush()
                got: list[int] = []

                async def collect() -> None:
                    while len(got) < MESSAGES:
                        msg = await busmod.next_msg(sub, 10)
                        assert msg is not None, f"rows stopped after {len(got)}"
                        time.sleep(0.01)  # noqa: ASYNC251 -- the collector's own work, on its loop
                        got.append(int.from_bytes(msg.data[:4], "big"))
                        await _read(server, msg)

                shipper = _Prebuilt(
                    None,  # type: ignore[arg-type]
                    req,
                    rows_publisher(agent, subject),
                    "agent a1",
                    SIZE,
                    ack_every=1 << 20,
                )
                with anyio.fail_after(60):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(collect)
                        await shipper.ship()
                return got, server.nc.stats["reconnects"]

        got, reconnects = anyio.run(main, backend="asyncio")
        log = (tmp_path / "nats" / "nats-server.log").read_text()
    assert got == list(range(MESSAGES))
    assert reconnects == 0 and "Slow Consumer" not in log
