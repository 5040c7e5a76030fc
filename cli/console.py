"""Terminal output of the CLI: rich tables and progress bars, only for a person.

Rules, so that scripts see what they always saw:

* a progress bar is drawn on stderr, and only when stderr is a terminal; it is
  transient (gone when the command ends) and never touches stdout;
* a table is drawn with rich only when stdout is a terminal; piped or redirected
  output is the plain text the command has always printed, and ``--json`` is JSON;
* rich is imported when something is drawn, not when the CLI starts.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["Bar", "help_text", "print_table", "progress"]


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def help_text(doc: str | None) -> str:
    """A module docstring as ``--help`` shows it: the reStructuredText written for the
    code's readers becomes the plain backquotes of every other help line (a
    ``:data:`~a.b.NAME``` reference is ``NAME``)."""
    text = _ROLE.sub(lambda m: f"`{m.group(1).rsplit('.', 1)[-1]}`", doc or "")
    return text.replace("``", "`")


class Bar:
    """One progress bar on stderr, or nothing (``progress`` is None) off a terminal."""

    def __init__(self, progress: Any | None = None, task: Any = None) -> None:
        self._progress, self._task = progress, task

    @property
    def shown(self) -> bool:
        return self._progress is not None

    def update(
        self,
        description: str | None = None,
        *,
        advance: float | None = None,
        completed: float | None = None,
    ) -> None:
        """Change the label, move the bar by ``advance`` or to ``completed``."""
        if self._progress is None:
            return
        fields: dict[str, Any] = {}
        if description is not None:
            fields["description"] = description
        if advance is not None:
            fields["advance"] = advance
        if completed is not None:
            fields["completed"] = completed
        self._progress.update(self._task, **fields)

    def print(self, line: str) -> None:
        """A line of the command's output (stdout): above the bar where both are on the
        terminal, so that the bar is not torn; plainly to stdout otherwise."""
        if self._progress is not None and sys.stdout.isatty():
            self._progress.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)


@contextmanager
def progress(
    description: str, *, total: float | None = None, enabled: bool = True
) -> Iterator[Bar]:
    """A transient progress bar on stderr while the block runs (``total`` None: a bar
    that only says it is busy); a :class:`Bar` that draws nothing off a terminal or
    when not ``enabled`` (``--json``: a machine reads the output)."""
    if not enabled or not sys.stderr.isatty():
        yield Bar()
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(
        *columns,
        console=Console(stderr=True),
        transient=True,
        redirect_stdout=False,  # stdout may be a pipe: never move its text to stderr
        redirect_stderr=True,  # the bar's own terminal: other messages print above it
    ) as bars:
        yield Bar(bars, bars.add_task(description, total=total))


def print_table(
    heads: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    plain: str,
    title: str | None = None,
    right: Sequence[str] = (),
) -> None:
    """``rows`` as a rich table where stdout is a terminal, else ``plain`` as it is.

    ``right``: the heads of columns aligned right (numbers).
    """
    if not sys.stdout.isatty():
        print(plain)
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left", header_style="bold")
    for head in heads:
        table.add_column(head, justify="right" if head in right else "left", overflow="fold")
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # Text: "[cpu]" is not markup
    Console(highlight=False).print(table)
