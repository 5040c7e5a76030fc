"""``mlscope``'s command table: each command's parser comes from the module that the
table names (and only that module is imported for it), and the full parser lists every
command the modules add, so the table can be neither stale nor incomplete. And the
program against the in-process entry: only the program freezes the collector's view."""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import COMMANDS, build_parser, main
from tests.conftest import REPO


def _added_by(module: str) -> set[str]:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    importlib.import_module(module).register(sub)
    return set(sub.choices)


def _choices(parser: argparse.ArgumentParser) -> set[str]:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


def test_the_table_names_every_command_of_every_module() -> None:
    for module in set(COMMANDS.values()):
        assert _added_by(module) == {c for c, m in COMMANDS.items() if m == module}, module
    assert _choices(build_parser()) == set(COMMANDS)
    assert _choices(build_parser("no-such-command")) == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_command_parses_with_its_module_alone(command: str) -> None:
    assert _choices(build_parser(command)) == _added_by(COMMANDS[command])


def test_a_report_imports_neither_the_agent_nor_the_server() -> None:
    probe = (
        "import sys; from cli.main import build_parser; build_parser('report'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('agent', 'broker')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout


def test_the_program_freezes_what_it_imported_and_in_process_main_does_not() -> None:
    """``program`` (the console script) moves the objects of its imports and of the
    ended command out of the collector's sight; ``main``, which tests and other programs
    call in a process that goes on, leaves the collector as it was."""
    before = gc.get_freeze_count()
    assert main(["report"]) == 2  # no evaluation named: a usage error, no server needed
    assert gc.get_freeze_count() == before
    probe = (
        "import atexit, gc; atexit.register(lambda: print('frozen', gc.get_freeze_count())); "
        "from cli.main import program; program()"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, "report"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr
    assert "give EVAL_ID" in done.stderr
    frozen = int(done.stdout.split()[-1])
    assert frozen > 10_000, done.stdout  # the imports' objects, at the least


def test_a_reader_that_leaves_early_ends_the_program_quietly(tmp_path: Path) -> None:
    """``mlscope ... | head``: once the reader has gone, the command stops with the
    shell's SIGPIPE code and says nothing (no 'Broken pipe' line, no traceback)."""
    env = {
        **os.environ,
        "MLSCOPE_DATA_DIR": str(tmp_path / "data"),
        "MLSCOPE_NATS_URL": "nats://127.0.0.1:9",  # nothing answers: none is needed
    }
    many = [str(REPO / "manifests")] * 60  # far more output than a pipe holds
    child = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "manifest", "validate", *many],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stderr is not None
    assert child.stdout.readline().endswith(b": ok (framework)\n")
    child.stdout.close()  # as head does after its first line
    with child.stderr:
        err = child.stderr.read().decode()
    assert child.wait(60) == 141, err
    assert err == ""


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and every subcommand's parser below it."""
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                found += _parsers(child)
    return found


def test_help_speaks_to_the_user_not_to_the_codes_readers() -> None:
    """``--help`` of every command: no reStructuredText of the docstrings it is made
    from (double backquotes, ``:mod:`` references), no talk of modules."""
    from cli.submit import DESCRIPTION
    from cli.submit_flags import parser as submit_parser

    parsers = [*_parsers(build_parser()), submit_parser(description=DESCRIPTION)]
    assert len(parsers) > 30
    for p in parsers:
        text = p.format_help()
        assert "``" not in text and ":mod:`" not in text and ":data:`" not in text, p.prog
        assert "this module" not in text, p.prog
