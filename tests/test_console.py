"""Tables and progress bars are for a terminal; pipes and --json see plain text."""

from __future__ import annotations

import io

import pytest

from cli import console


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


ROWS = [("agent-1", "onnxruntime 1.31.1 [cpu]", "2")]
HEADS = ("AGENT", "FRAMEWORKS", "CORES")


def test_a_piped_table_is_the_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    console.print_table(HEADS, ROWS, plain="AGENT FRAMEWORKS\nplain row")
    assert capsys.readouterr().out == "AGENT FRAMEWORKS\nplain row\n"


def test_a_terminal_gets_a_rich_table(monkeypatch: pytest.MonkeyPatch) -> None:
    out = _Terminal()
    monkeypatch.setattr("sys.stdout", out)
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setenv("NO_COLOR", "1")
    console.print_table(HEADS, ROWS, plain="unused", title="agents", right=("CORES",))
    text = out.getvalue()
    assert "unused" not in text
    assert "agents" in text and "AGENT" in text and "─" in text
    assert "onnxruntime 1.31.1 [cpu]" in text  # a cell is text, not rich markup


def test_no_bar_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    with console.progress("building", total=2) as bar:
        assert not bar.shown
        bar.update("step", advance=1)
        bar.print("a line of output")
    got = capsys.readouterr()
    assert got.out == "a line of output\n" and got.err == ""


def test_a_bar_on_a_terminal_stderr_leaves_a_piped_stdout_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    err, out = _Terminal(), io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr("sys.stdout", out)
    with console.progress("building", total=2) as bar:
        assert bar.shown
        bar.update("digits_cnn", completed=1)
        bar.print("digits_cnn: up to date")
    assert out.getvalue() == "digits_cnn: up to date\n"
    assert "digits_cnn: up to date" not in err.getvalue()
    with console.progress("quiet", enabled=False) as bar:  # --json
        assert not bar.shown
