"""Log lines under a budget: a flood of bad input is counted in full but cannot turn a
service into a log writer.

Whatever logs a line per hostile input (a serving boundary's refusals and dead letters,
a registry watcher's rejected values) asks its :class:`LogBudget` first. The first
``burst`` lines of each window are written; the rest are counted, and the next line
written says how many were left out.
"""

from __future__ import annotations

import time

__all__ = ["LOG_BURST", "LOG_WINDOW_S", "LogBudget"]

LOG_BURST = 50
LOG_WINDOW_S = 10.0
"""Failure log lines: at most LOG_BURST per LOG_WINDOW_S per budget (all are counted)."""


class LogBudget:
    """At most ``burst`` lines per ``window_s`` (the window starts at its first line)."""

    def __init__(self, burst: int = LOG_BURST, window_s: float = LOG_WINDOW_S) -> None:
        self.burst, self.window_s = burst, window_s
        self._window_start = -window_s
        self._logged = 0
        self._quiet = 0

    def take(self) -> str | None:
        """None when this line is over the budget (it is counted); otherwise what the
        line should end with: "" or " (N more not logged)" for the lines left out since
        the last one written."""
        t = time.monotonic()
        if t - self._window_start >= self.window_s:
            self._window_start, self._logged = t, 0
        if self._logged >= self.burst:
            self._quiet += 1
            return None
        self._logged += 1
        more = f" ({self._quiet} more not logged)" if self._quiet else ""
        self._quiet = 0
        return more
