"""What a scenario needs to drive one prepared agent (shared by every scenario and by
the distributed load generators, which :mod:`broker.scenarios` calls)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from mlscope.bus import Bus
from mlscope.contracts import AgentDescription, Placement, TraceLevel
from mlscope.record import RunRecord
from mlscope.samples import Feeders
from mlscope.settings import DEFAULT_LOADGEN_READY_S
from mlscope.tuning import ProcessTuning
from mlscope.validity import ValidityPolicy

if TYPE_CHECKING:
    from broker.run import RunsSoFar

__all__ = ["Context", "FeedersOf"]

FeedersOf = Callable[[int], Feeders]
"""``feeders(batch_size)`` -> (inputs(i), labels or None) for queries of that size."""


@dataclass
class Context:
    """What a scenario needs to drive one prepared agent."""

    bus: Bus
    evaluation_id: str
    """The id the agent was prepared for."""
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
    loadgen_ready_s: float = DEFAULT_LOADGEN_READY_S
    """How long those processes have to say they are ready (the server's settings)."""
    agent: AgentDescription | None = None
    """The agent prepared for the run (its pid and start time tell a restart), and ..."""
    prepare: dict[str, Any] = field(default_factory=dict)
    """... its prepare request (cold-start prepares again, with reload)."""
    placement: Placement = "server"
    """Where the load is generated: by this server (its Driver, or load-generator
    processes / services), or by the agent (:mod:`broker.agentrun`)."""

    runs: RunsSoFar | None = None
    """Where the runs of several (a sweep's, a search's) record how far they got, for
    what a cancelled job stores (:class:`broker.run.RunsSoFar`); None: untracked."""

    run_id: str | None = None
    """The run this context drives when the evaluation makes several (a sweep's point,
    a search's trial: ``<evaluation_id>-<k>``, :meth:`for_run`); None for its one run."""

    @property
    def query_id(self) -> str:
        """The id every query of this run names: its run's when it has one (the agent
        keeps the query's spans under it), else the evaluation's."""
        return self.run_id or self.evaluation_id

    def for_run(self, run_id: str) -> Context:
        """This context driving the run ``run_id`` (the evaluation's own id: its one run)."""
        return replace(self, run_id=None if run_id == self.evaluation_id else run_id)

    @property
    def agent_id(self) -> str:
        return "" if self.agent is None else self.agent.agent_id
