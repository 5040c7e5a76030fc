"""Moved to :mod:`mlscope.tuning`: an agent running load itself (``placement: agent``)
owns one too; this name stays for existing imports."""

from __future__ import annotations

from mlscope.tuning import PACER_SWITCH_INTERVAL_S, ProcessTuning

__all__ = ["PACER_SWITCH_INTERVAL_S", "ProcessTuning"]
