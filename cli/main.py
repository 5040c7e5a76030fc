"""``mlscope``: run the stack and its services, and inspect it."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from mlscope import scenario_traits
from mlscope.errors import MLScopeError
from mlscope.settings import Settings

__all__ = ["main"]

# Modules that add subcommands: each has register(subparsers) -> None.
COMMAND_MODULES = (
    "cli.services",
    "cli.agents_cmd",
    "cli.demo",
    "cli.zoo_cmd",
    "cli.models_cmd",
    "cli.artifacts_cmd",
    "cli.manifest_cmd",
    "cli.rerun_cmd",
    "cli.trace_cmd",
    "cli.auth_cmd",
    "cli.edge_cmd",
    "cli.report_cmd",
    "cli.runs_cmd",
    "cli.cancel_cmd",
    "cli.export_cmd",
    "cli.dashboard_cmd",
    "cli.doctor_cmd",
    "cli.mlperf_cmd",
    "cli.loadgen_cmd",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlscope", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.settings = Settings.from_env()
        scenario_traits.load_modules(args.settings.scenario_modules)
        code: int = args.func(args)
    except MLScopeError as exc:
        print(f"mlscope {args.command}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a file the command was told to read or write
        where = f"{exc.filename}: " if exc.filename is not None else ""
        print(f"mlscope {args.command}: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    raise SystemExit(main())
