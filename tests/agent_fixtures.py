"""Running a real Agent in this process, on a real nats-server, for one test body."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from agent.service import Agent
from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.errors import error_from_wire
from mlscope.settings import Settings

Ask = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def run_agent(
    settings: Settings, agent: Agent, body: Callable[[busmod.Bus, Ask], Awaitable[None]]
) -> None:
    """Start ``agent`` on the bus, run ``body(bus, ask_ctl)``, stop the agent."""

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(agent.run)
            async with busmod.connect(settings, name="test") as bus:

                async def ask(req: dict[str, Any]) -> dict[str, Any]:
                    msg = await bus.nc.request(
                        names.agent_ctl(agent.agent_id), codec.encode(req), timeout=60
                    )
                    out: dict[str, Any] = codec.decode(msg.data)
                    if "error" in out and req.get("op") == "prepare" and not out.get("ok"):
                        out["ok"] = False
                        out["why"] = str(error_from_wire(out["error"]))
                    return out

                await body(bus, ask)
            tg.cancel_scope.cancel()

    switch = sys.getswitchinterval()  # the agent shortens it for its process
    try:
        anyio.run(main, backend="asyncio")
    finally:
        sys.setswitchinterval(switch)
