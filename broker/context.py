"""What a scenario needs to drive one prepared agent (shared by every scenario and by
the distributed load generators, which :mod:`broker.scenarios` calls)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from mlscope.bus import Bus
from mlscope.contracts import AgentDescription, Placement, TraceLevel
from mlscope.record import RunRecord
from mlscope.samples import Feeders
from mlscope.tuning import ProcessTuning
from mlscope.validity import ValidityPolicy

__all__ = ["Context", "FeedersOf"]

FeedersOf = Callable[[int], Feeders]
"""``feeders(batch_size)`` -> (inputs(i), labels or None) for queries of that size."""


@dataclass
class Context:
    """What a scenario needs to drive one prepared agent."""

    bus: Bus
    evaluation_id: str
    """The id the agent was prepared for (every query carries it)."""
    subject: str
    trace_level: TraceLevel
    offset_ns: int
    feeders: FeedersOf
    policy: ValidityPolicy
    tuning: ProcessTuning
    """The process's one owner of GC, switch interval and priority (jobs run at once)."""
    on_progress: Callable[[RunRecord, float], Awaitable[Any]] | None = None
    nats_url: str | None = None
    """For load-generator processes (distributed load)."""
    agent: AgentDescription | None = None
    """The agent prepared for the run (its pid and start time tell a restart), and ..."""
    prepare: dict[str, Any] = field(default_factory=dict)
    """... its prepare request (cold-start prepares again, with reload)."""
    placement: Placement = "server"
    """Where the load is generated: by this server (its Driver, or load-generator
    processes / services), or by the agent (:mod:`broker.agentrun`)."""

    @property
    def agent_id(self) -> str:
        return "" if self.agent is None else self.agent.agent_id
