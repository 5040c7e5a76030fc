"""``mlscope``: run the stack and its services, and inspect it."""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from cli.submit_errors import FlagError
from mlscope import scenario_traits
from mlscope.errors import MLScopeError
from mlscope.settings import Settings

__all__ = ["main", "program"]

# The module that adds each subcommand (its register(subparsers) -> None adds every
# command it names here, aliases included). Only the module of the command given is
# imported: `mlscope report` does not pay for the agent's or the server's imports.
COMMANDS: dict[str, str] = {
    "up": "cli.services",
    "server": "cli.services",
    "agent": "cli.services",
    "agents": "cli.agents_cmd",
    "demo": "cli.demo",
    "zoo": "cli.zoo_cmd",
    "models": "cli.models_cmd",
    "artifacts": "cli.artifacts_cmd",
    "manifest": "cli.manifest_cmd",
    "rerun": "cli.rerun_cmd",
    "trace": "cli.trace_cmd",
    "auth": "cli.auth_cmd",
    "edge": "cli.edge_cmd",
    "report": "cli.report_cmd",
    "runs": "cli.runs_cmd",
    "ls": "cli.runs_cmd",
    "cancel": "cli.cancel_cmd",
    "export": "cli.export_cmd",
    "dashboard": "cli.dashboard_cmd",
    "doctor": "cli.doctor_cmd",
    "mlperf": "cli.mlperf_cmd",
    "import": "cli.mlperf_cmd",
    "loadgen": "cli.loadgen_cmd",
}

EXIT_PIPE = 128 + 13
"""The exit code of a command whose stdout reader left: 128 + SIGPIPE, as a shell has it."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``command``, or of every command (``None`` or not a command: the
    full list, for ``mlscope --help`` and for an error that names the choices)."""
    parser = argparse.ArgumentParser(
        prog="mlscope",
        description="Run the stack and its services, and inspect it (jobs are submitted "
        "with mlscope-submit).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    every = list(dict.fromkeys(COMMANDS.values()))
    for name in [COMMANDS[command]] if command in COMMANDS else every:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command in this process (as tests and other programs do); its exit code."""
    return _execute(_parse(sys.argv[1:] if argv is None else list(argv)))


def program() -> NoReturn:
    """``mlscope`` as a program of its own (its console script, ``python -m cli.main``).

    The objects alive after the imports (modules, classes, tables: nearly all live as
    long as the program), and those left when the command ends, are moved out of the
    cyclic collector's sight (:func:`gc.freeze`): each full collection walked them all,
    and so did the interpreter's exit; for a report that was 0.1-0.3 s of pandas' and
    pydantic's objects (docs/BENCHMARKS.md). A service's measurement unfreezes them
    (``mlscope.tuning``), which only returns them to the collector. Not done by
    :func:`main`: a process that goes on after the command (a test session) must keep
    collecting what it makes."""
    args = _parse(sys.argv[1:])
    gc.freeze()
    code = _execute(args)
    gc.freeze()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = EXIT_PIPE
    if code == EXIT_PIPE:  # nothing left to write to: the exit's own flush must not say so
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise SystemExit(code)


def _parse(argv: list[str]) -> argparse.Namespace:
    # the command is the first word (mlscope itself takes no option but --help)
    return build_parser(next((a for a in argv if not a.startswith("-")), None)).parse_args(argv)


def _execute(args: argparse.Namespace) -> int:
    """Run the parsed command: the one place its failures become a line and a code.

    Exit 2: a FlagError, a contract the command built from its flags refused a value
    (the flags' argparse types catch most first): argparse's ``error:`` line naming the
    flag. Exit 1: any other MLScopeError, or an OSError (a file the command was told to
    read or write). Exit 141 (a shell's code for SIGPIPE), silently: stdout's reader
    left before the output ended (``| head``). Every other exception, a pydantic
    refusal of a reply or a stored record included, is a bug and keeps its traceback."""
    try:
        args.settings = Settings.from_env()
        scenario_traits.load_modules(args.settings.scenario_modules)
        code: int = args.func(args)
    except FlagError as exc:
        print(f"mlscope {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except MLScopeError as exc:
        print(f"mlscope {args.command}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader of stdout left (`mlscope runs | head`): quiet
        return EXIT_PIPE
    except OSError as exc:  # a file the command was told to read or write
        where = f"{exc.filename}: " if exc.filename is not None else ""
        print(f"mlscope {args.command}: {where}{exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    program()
