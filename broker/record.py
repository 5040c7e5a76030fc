"""Moved to :mod:`mlscope.record`: the agent's local load generator uses the same code
(``placement: agent``); this name stays for existing imports."""

from __future__ import annotations

from mlscope.record import (
    ARRAYS,
    TIME_ARRAYS,
    RunRecord,
)

__all__ = [
    "ARRAYS",
    "TIME_ARRAYS",
    "RunRecord",
]
