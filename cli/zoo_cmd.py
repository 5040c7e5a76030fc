"""``mlscope zoo build [--only NAME...] [--force] [--write-manifests]``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import anyio

from cli.artifacts_cmd import push_zoo
from cli.console import progress
from mlscope.errors import MLScopeError

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    zoo = subparsers.add_parser("zoo", help="the built-in model zoo")
    sub = zoo.add_subparsers(dest="zoo_command", required=True)
    build = sub.add_parser(
        "build",
        help="build the zoo's artifacts offline (idempotent, fixed seeds)",
        description="Build every zoo model (or --only some) into <data_dir>/zoo: check the "
        "pinned inputs, check each built model's behaviour (accuracy, probe "
        "outputs) against the committed manifests, and record the sha256 of "
        "every artifact in the model's build lock.",
    )
    build.add_argument("--only", nargs="+", metavar="NAME", help="build only these models")
    build.add_argument("--force", action="store_true", help="rebuild even when up to date")
    build.add_argument("--zoo-dir", type=Path, help="default: <data_dir>/zoo")
    build.add_argument(
        "--push",
        action="store_true",
        help="then put the built models into the bus's artifact bucket "
        "(MLSCOPE_NATS_URL), for agents on other machines",
    )
    build.add_argument(
        "--write-manifests",
        type=Path,
        nargs="?",
        metavar="DIR",
        const=Path("manifests/models"),
        help="(re)write the zoo's model manifests into DIR (default: manifests/models)",
    )
    build.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from mlscope.zoo import build as zoo_build

    zoo_dir: Path = args.zoo_dir or args.settings.zoo_dir
    started = time.perf_counter()
    names = list(args.only or zoo_build.BUILDERS)
    try:
        with progress("zoo build", total=len(names)) as bar:
            done = iter(range(len(names)))

            def on_model(name: str) -> None:
                bar.update(f"building {name}", completed=next(done))

            zoo_build.build(
                zoo_dir, only=args.only, force=args.force, log=bar.print, on_model=on_model
            )
    except (MLScopeError, KeyError, RuntimeError, OSError) as exc:
        print(f"mlscope zoo build: {exc}{_install_hint(exc)}", file=sys.stderr)
        return 1
    print(f"built in {time.perf_counter() - started:.1f} s")
    if args.push:
        anyio.run(lambda: push_zoo(args.settings, zoo_dir, only=args.only), backend="asyncio")
    if args.write_manifests is not None:
        return _write(zoo_dir, args.write_manifests, args.only)
    return 0


def _install_hint(exc: BaseException) -> str:
    """Where a package that the zoo reads is missing: which extras install it."""
    if isinstance(exc, MLScopeError) and exc.fields.get("package"):
        return "; the zoo build needs pip install 'mlscope[zoo,onnx,torch,tf,tflite]'"
    return ""


def _write(zoo_dir: Path, target: Path, only: list[str] | None) -> int:
    from mlscope.zoo import specs

    target.mkdir(parents=True, exist_ok=True)
    keys = None if only is None else [*only, "light", "silero_vad", "basic_pitch"]
    for name, text in sorted(specs.render_all(zoo_dir, keys).items()):
        path = target / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path}")
    return 0
