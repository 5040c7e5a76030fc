"""Moved to :mod:`mlscope.schedule`: the agent's local load generator uses the same code
(``placement: agent``); this name stays for existing imports."""

from __future__ import annotations

from mlscope.schedule import (
    ARRIVAL_STREAM,
    SAMPLE_STREAM,
    Schedule,
    constant,
    deal,
    merge,
    merge_values,
    multi_stream,
    piecewise,
    poisson,
    replay,
    write_replay,
)

__all__ = [
    "ARRIVAL_STREAM",
    "SAMPLE_STREAM",
    "Schedule",
    "constant",
    "deal",
    "merge",
    "merge_values",
    "multi_stream",
    "piecewise",
    "poisson",
    "replay",
    "write_replay",
]
