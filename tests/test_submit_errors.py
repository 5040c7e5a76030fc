"""Errors a user can act on: ``mlscope-submit`` and ``mlscope`` refuse bad arguments
in argparse's style (exit 2, one message, no pydantic text), name unknown frameworks
and models with what exists, exit 3 under ``--strict`` for an INVALID run, and name
the path of a file they cannot write. The refusals of arguments need no server (they
come before anything connects); the rest run against a real stack."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cli.stack import Stack
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.errors import UnknownModelError
from mlscope.settings import Settings
from tests.conftest import child_env

pytestmark = pytest.mark.timeout(180)

SUBMIT = Path(sys.executable).parent / "mlscope-submit"
NOWHERE = Settings(nats_url="nats://127.0.0.1:9")
"""No server listens there: a refusal must come before any connection."""


def run(settings: Settings, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv),
        env=child_env(settings),
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )


def submit(settings: Settings, *flags: str) -> subprocess.CompletedProcess[str]:
    return run(settings, str(SUBMIT), *flags)


def last_line(stderr: str) -> str:
    assert "Traceback" not in stderr and "pydantic" not in stderr, stderr
    return stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--qps", "-5"), "argument --qps: must be greater than 0 (got -5.0)"),
        (("--batch-size", "0"), "argument --batch-size: must be greater than or equal to 1"),
        (("--duration", "0"), "argument --duration: must be greater than 0"),
        (("--batch-sizes", "1,x"), "argument --batch-sizes: 'x' is not a whole number"),
        (("--repeat", "0"), "argument --repeat: must be at least 1"),
        (("--qps", "nan"), "argument --qps: must be a number (got nan)"),
        (("--duration", "nan"), "argument --duration: must be a number (got nan)"),
        (("--min-memory", "1.5.5G"), "argument --min-memory: not a size: '1.5.5G'"),
        (("--min-memory", "99999999999999999999T"), "argument --min-memory: '9999"),
        (("--duration", "inf"), "argument --duration: must be less than or equal to 604800"),
        (
            ("--scenario", "concurrency", "--concurrency", "1000000000"),
            "argument --concurrency: must be less than or equal to 65536",
        ),
        (("--qps", "1e6", "--duration", "1e5"), "error: qps x duration_s is 1e+11 queries"),
        (("--arch", ""), "argument --arch: must not be empty"),
        (("--host", " "), "argument --host: must not be empty"),
        (("--min-cores", "0"), "argument --min-cores: '0' is not a whole number above 0"),
        (("--framework", "noop,noop"), "framework 'noop' named twice"),
        (("--scenario", "replay"), "argument --scenario: scenario 'replay' needs --schedule"),
        (
            ("--scenario", "piecewise"),
            "argument --scenario: scenario 'piecewise' needs segments, set in a --scenario-file",
        ),
    ],
)
def test_bad_arguments_are_usage_errors(flags: tuple[str, ...], message: str) -> None:
    done = submit(NOWHERE, "noop", "--framework", "noop", *flags)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("usage: mlscope-submit")
    line = last_line(done.stderr)
    assert line.startswith("mlscope-submit: error: ") and message in line, line
    assert "validation error" not in done.stderr and "errors.pydantic.dev" not in done.stderr


def test_unknown_framework_lists_the_known_ones() -> None:
    done = submit(NOWHERE, "noop", "--framework", "pytroch")
    assert done.returncode == 2
    line = last_line(done.stderr)
    assert "unknown framework 'pytroch'; known: onnxruntime, pytorch," in line, line


def test_unknown_model_suggests_the_closest() -> None:
    catalog = Catalog.load(default_manifest_dirs(None))
    with pytest.raises(UnknownModelError, match=r"did you mean 'digits_cnn'\?"):
        catalog.find("digts_cnn")
    with pytest.raises(UnknownModelError) as nothing_close:
        catalog.find("zzzzzzzz")
    assert "did you mean" not in str(nothing_close.value)


def test_unknown_model_through_the_server(noop_stack: Stack) -> None:
    done = submit(noop_stack.settings, "nop", "--framework", "noop", "--duration", "0.2")
    assert done.returncode == 1
    line = last_line(done.stderr)
    assert "unknown model 'nop' (did you mean 'noop'?)" in line, line


def test_strict_exits_3_on_an_invalid_run(noop_stack: Stack) -> None:
    short = ("noop", "--framework", "noop", "--qps", "50", "--duration", "0.3", "--json")
    plain = submit(noop_stack.settings, *short)
    assert plain.returncode == 0, plain.stderr  # INVALID (too short) but completed
    strict = submit(noop_stack.settings, *short, "--strict")
    assert strict.returncode == 3, strict.stderr
    loose = ("--min-duration", "0", "--min-queries", "1", "--max-issue-lag-us", "1000000")
    valid = submit(
        noop_stack.settings,
        "noop",
        "--framework",
        "noop",
        "--scenario",
        "batched",
        "--duration",
        "0.3",
        *loose,
        "--strict",
    )
    assert valid.returncode == 0, valid.stderr + valid.stdout


def test_an_unwritable_output_names_its_path(tmp_path: Path) -> None:
    target = tmp_path / "missing" / "dir" / "x.json"
    for command in (("trace", "ev-any"), ("report", "ev-any")):
        done = run(NOWHERE, sys.executable, "-m", "cli.main", *command, "-o", str(target))
        assert done.returncode == 1, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
        line = last_line(done.stderr)
        assert str(target) in line and "no directory" in line, line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--nats-port", "-1"], "'-1' is not a port (0 for any, or 1 to 65535)"),
        (["up", "--nats-port", "70000"], "'70000' is not a port (1 to 65535)"),
        (["up", "--nats-port", "0"], "'0' is not a port (1 to 65535)"),
        (["dashboard", "--port", "http"], "'http' is not a port (1 to 65535)"),
        (
            ["edge", "init", "--hub", "nats-leaf://h:7422", "--out", "x", "--port", "65536"],
            "'65536' is not a port (0 for any, or 1 to 65535)",
        ),
    ],
)
def test_a_port_flag_takes_ports_only(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A port is checked where it is read, not by the nats-server or Streamlit it is
    passed to (-1 made nats-server pick a random port the command never printed)."""
    from cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().endswith(message)


def test_a_failed_submission_is_one_line_and_its_exit_status(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every mlscope-submit path says why it failed the same way: 1 for a failure, 2 for
    invalid arguments, a task group's first failure counted, anything else raised."""
    from cli.submit_errors import EXIT_FAILED, EXIT_USAGE, failed
    from mlscope.errors import BusError

    assert failed(BusError("no NATS server")) == EXIT_FAILED
    assert capsys.readouterr().err == "mlscope-submit: no NATS server\n"
    assert failed(ValueError("qps must be > 0")) == EXIT_USAGE
    assert capsys.readouterr().err == "mlscope-submit: invalid arguments: qps must be > 0\n"
    group = ExceptionGroup("jobs", [ExceptionGroup("inner", [BusError("first")]), ValueError()])
    assert failed(group) == EXIT_FAILED
    assert capsys.readouterr().err == "mlscope-submit: first\n"
    other = ExceptionGroup("jobs", [RuntimeError("a bug")])
    with pytest.raises(ExceptionGroup) as raised:
        failed(other)
    assert raised.value is other
