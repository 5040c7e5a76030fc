"""``mlscope artifacts``: the bus's artifact bucket of built zoo models.

- ``mlscope artifacts push [--only NAME...]``: put the data dir's built zoo models into
  the bucket (what agents with an empty data dir fetch);
- ``mlscope artifacts list``: the models the bucket holds.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path

import anyio

from mlscope import artifact_bucket
from mlscope import bus as busmod
from mlscope.buildlock import LOCK_NAME
from mlscope.settings import Settings

__all__ = ["built_models", "push_zoo", "register"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("artifacts", help="the bus's artifact bucket (built models)")
    sub = p.add_subparsers(dest="artifacts_command", required=True)
    push = sub.add_parser("push", help="push the data dir's built zoo models to the bus")
    push.add_argument("--only", nargs="+", metavar="NAME", help="push only these models")
    push.add_argument("--zoo-dir", type=Path, help="default: <data_dir>/zoo")
    push.set_defaults(func=run_push)
    ls = sub.add_parser("list", help="the models the bucket holds")
    ls.set_defaults(func=run_list)


def built_models(zoo_dir: Path, only: Iterable[str] | None = None) -> list[Path]:
    """Model directories under ``zoo_dir`` that carry a build lock."""
    wanted = set(only) if only else None
    return sorted(
        lock.parent
        for lock in zoo_dir.glob(f"*/*/{LOCK_NAME}")
        if wanted is None or lock.parent.parent.name in wanted
    )


async def push_zoo(
    settings: Settings,
    zoo_dir: Path,
    *,
    only: Iterable[str] | None = None,
    log: Callable[[str], None] = print,
) -> int:
    """Push every built model of ``zoo_dir``; returns how many were sent."""
    dirs = built_models(zoo_dir, only)
    if not dirs:
        log(f"nothing built under {zoo_dir} (run `mlscope zoo build`)")
        return 0
    async with busmod.connect(settings, name="mlscope artifacts push") as bus:
        sent = 0
        for d in dirs:
            sent += await artifact_bucket.push(bus, d, log=log, replicas=settings.js_replicas)
        return sent


def run_push(args: argparse.Namespace) -> int:
    zoo_dir: Path = args.zoo_dir or args.settings.zoo_dir
    anyio.run(lambda: push_zoo(args.settings, zoo_dir, only=args.only), backend="asyncio")
    return 0


def run_list(args: argparse.Namespace) -> int:
    async def go() -> list[tuple[str, str]]:
        async with busmod.connect(args.settings, name="mlscope artifacts list") as bus:
            return await artifact_bucket.pushed_models(bus)

    models = anyio.run(go, backend="asyncio")
    for name, version in models:
        print(f"{name} {version}")
    if not models:
        print("the artifact bucket is empty")
    return 0
