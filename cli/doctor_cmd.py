"""``mlscope doctor [--json] [--limit N]``: what the services gave up on, and stream sizes.

Lists the dead letters (messages a consumer could not decode, or that failed on every
delivery, each with its error) and the size of every mlscope stream, so an operator
sees poison and growth without reading logs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import anyio

from cli.flag_types import positive_int
from mlscope import bus as busmod
from mlscope import names
from mlscope.errors import BusDenied, BusError
from mlscope.serving import DeadLetter, dead_letters
from mlscope.settings import Settings

__all__ = ["diagnose", "register"]

STREAMS = (names.JOBS_STREAM, names.TRACES_STREAM, names.DEAD_STREAM)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("doctor", help="list dead letters and stream sizes")
    p.add_argument(
        "--limit", type=positive_int, default=50, help="newest dead letters shown (default 50)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


async def diagnose(settings: Settings, *, limit: int = 50) -> dict[str, Any]:
    """{"streams": {name: {messages, bytes}}, "dead_letters": kept, "newest": [...]}"""
    async with busmod.connect(settings, name="mlscope doctor") as bus:
        streams: dict[str, dict[str, int]] = {}
        for name in STREAMS:
            try:
                with busmod.bus_errors(f"cannot read stream {name}"):
                    state = (await bus.js.stream_info(name)).state
            except BusDenied:
                raise  # every stream would be denied alike
            except BusError:
                continue
            streams[name] = {"messages": int(state.messages), "bytes": int(state.bytes)}
        kept, newest = await dead_letters(bus, limit=limit)
    return {
        "streams": streams,
        "dead_letters": kept,
        "newest": [dataclasses.asdict(d) for d in newest],
    }


def run(args: argparse.Namespace) -> int:
    report = anyio.run(lambda: diagnose(args.settings, limit=args.limit), backend="asyncio")
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for name, st in report["streams"].items():
        print(f"{name:<16} {st['messages']:>10} messages {st['bytes'] / 1e6:>10.1f} MB")
    print(f"dead letters: {report['dead_letters']}")
    for d in report["newest"]:
        print(_line(DeadLetter(**d)))
    return 0


def _line(d: DeadLetter) -> str:
    return f"  #{d.seq} {d.subject} ({d.size} B, {d.delivered}x, {d.service}): {d.error}"
