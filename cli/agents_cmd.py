"""``mlscope agents [--json]``: the live registry."""

from __future__ import annotations

import argparse
import json

import anyio

from mlscope import bus as busmod
from mlscope.contracts import AgentDescription
from mlscope.registry import list_agents
from mlscope.settings import Settings
from mlscope.sysmatch import usable_memory

__all__ = ["fetch_agents", "register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("agents", help="list live agents")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


async def fetch_agents(settings: Settings) -> list[AgentDescription]:
    async with busmod.connect(settings, name="mlscope agents") as bus:
        return await list_agents(bus)


def run(args: argparse.Namespace) -> int:
    agents = anyio.run(fetch_agents, args.settings, backend="asyncio")
    if args.json:
        print(json.dumps([a.model_dump(mode="json", by_alias=True) for a in agents], indent=2))
        return 0
    if not agents:
        print("no live agents")
        return 0
    print(
        f"{'AGENT':<40} {'HOST':<16} {'ARCH':<8} {'CORES':>5} {'MEM GiB':>7} "
        f"{'FRAMEWORKS':<32} MODELS"
    )
    for a in agents:
        fws = ", ".join(f"{f.name} {f.version} [{'/'.join(f.devices)}]" for f in a.frameworks)
        models = ", ".join(sorted({f"{m.name}@{m.version}" for m in a.models})) or "-"
        # What the agent may use (its affinity, its cgroup limit): what requirements match.
        cores, mem = a.usable_cores or a.cpu_cores, usable_memory(a) / (1 << 30)
        print(
            f"{a.agent_id:<40} {a.host[:16]:<16} {a.arch:<8} {cores:>5} {mem:>7.1f} "
            f"{fws:<32} {models}"
        )
    return 0
