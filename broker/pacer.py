"""Moved to :mod:`mlscope.pacer`: the agent's local load generator uses the same code
(``placement: agent``); this name stays for existing imports."""

from __future__ import annotations

from mlscope.pacer import (
    DEFAULT_BUSY_S,
    DEFAULT_SPIN_S,
    REALTIME_PRIORITY,
    Gate,
    OutstandingLimit,
    Pacer,
    PacerResult,
    RealtimeThread,
)

__all__ = [
    "DEFAULT_BUSY_S",
    "DEFAULT_SPIN_S",
    "REALTIME_PRIORITY",
    "Gate",
    "OutstandingLimit",
    "Pacer",
    "PacerResult",
    "RealtimeThread",
]
