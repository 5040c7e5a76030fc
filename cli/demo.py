"""``mlscope demo``: start the embedded stack, evaluate digits_cnn, print, stop."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import anyio

from cli.agents_cmd import fetch_agents
from cli.flag_types import port_or_zero, positive_float, positive_int
from cli.stack import Stack
from cli.submit_errors import flags_contract
from cli.summary_text import format_summary
from mlscope.contracts import JobRequest, ScenarioSpec
from mlscope.errors import BusError
from mlscope.jobs import submit
from mlscope.settings import Settings
from mlscope.zoo.build import build

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="run the local stack and evaluate digits_cnn")
    p.add_argument("--data-dir", type=Path, default=None)
    p.add_argument("--nats-port", type=port_or_zero, default=0, help="0 picks a free port")
    p.add_argument("--qps", type=positive_float, default=200.0)
    p.add_argument(
        "--duration",
        type=positive_float,
        default=10.0,
        help="seconds per run (10 s is the shortest VALID run by default)",
    )
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.set_defaults(func=run)


async def wait_for_agent(settings: Settings, framework: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            agents = await fetch_agents(settings)
        except BusError:
            agents = []
        if any(f.name == framework for a in agents for f in a.frameworks):
            return
        await anyio.sleep(0.3)
    raise BusError(f"no {framework} agent registered within {timeout:g} s")


def run(args: argparse.Namespace) -> int:
    settings: Settings = args.settings
    if args.data_dir is not None:
        settings = settings.with_(data_dir=args.data_dir.expanduser())
    with flags_contract():  # before anything starts: a value the contracts refuse stops here
        jobs = [
            JobRequest(
                model="digits_cnn",
                framework="onnxruntime",
                scenario=ScenarioSpec(name="online", qps=args.qps, duration_s=args.duration),
            ),
            JobRequest(
                model="digits_cnn",
                framework="onnxruntime",
                scenario=ScenarioSpec(
                    name="batched", batch_size=args.batch_size, duration_s=args.duration
                ),
            ),
        ]
    build(settings.zoo_dir, only=["digits_cnn"])  # idempotent: skipped when present
    stack = Stack(settings, nats_port=args.nats_port, frameworks=["onnxruntime"])
    live = stack.start()
    try:

        async def go() -> None:
            await wait_for_agent(live, "onnxruntime")
            for job in jobs:
                s = await submit(live, job)
                print(f"\n== digits_cnn on onnxruntime, {job.scenario.name} ==")
                print(format_summary(s), flush=True)

        anyio.run(go, backend="asyncio")
    finally:
        stack.stop()
    return 0
