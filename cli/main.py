"""``mlscope``: run the stack and its services, and inspect it."""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

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


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``command``, or of every command (``None`` or not a command: the
    full list, for ``mlscope --help`` and for an error that names the choices)."""
    parser = argparse.ArgumentParser(prog="mlscope", description=__doc__)
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
    raise SystemExit(code)


def _parse(argv: list[str]) -> argparse.Namespace:
    # the command is the first word (mlscope itself takes no option but --help)
    return build_parser(next((a for a in argv if not a.startswith("-")), None)).parse_args(argv)


def _execute(args: argparse.Namespace) -> int:
    """Run the parsed command: the one place its failures become a line and a code.

    Exit 1: an MLScopeError or an OSError (a file the command was told to read or
    write). Exit 2: a contract the command built from its flags refused a value (the
    flags' argparse types catch most first): argparse's ``error:`` line naming the flag.
    Every other exception, a pydantic refusal raised anywhere else included, is a bug
    and keeps its traceback."""
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
    except ValueError as exc:  # pydantic's ValidationError is one
        problem = _flag_refusal(exc)
        if problem is None:
            raise
        print(f"mlscope {args.command}: error: {problem}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


def _flag_refusal(exc: ValueError) -> str | None:
    """What a contract built by a command of ``cli/`` refused (``argument --qps: must be
    greater than 0 (got -1.0)``), or None for any other error: the innermost frame that
    called into pydantic must be a ``cli/`` module's, where the flags become a contract
    (a reply that fails its model, or a library's own check, is not the user's doing)."""
    from pydantic import ValidationError  # a ValueError was raised: imported by now, or moot

    if not isinstance(exc, ValidationError):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    callers = [f for f in frames if "pydantic" not in Path(f.filename).parts]
    if not callers or Path(callers[-1].filename).resolve().parent != _CLI_DIR:
        return None
    from cli.submit_errors import flag_message

    return flag_message(exc)


_CLI_DIR = Path(__file__).resolve().parent


if __name__ == "__main__":
    program()
