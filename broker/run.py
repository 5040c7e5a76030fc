"""One run of a scenario as judged (:class:`Run`: its raw record, figures, verdict),
and how far a scenario of several runs got (:class:`RunsSoFar`: what a cancelled job
stores, :mod:`broker.cancel`). The scenarios that make runs are
:mod:`broker.scenario`'s and :mod:`broker.scenario_kinds`'."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from broker.summary import Figures
from mlscope.contracts import LatencyStats, ScenarioSpec
from mlscope.record import RunRecord
from mlscope.validity import Verdict

__all__ = ["Run", "RunsSoFar"]


@dataclass
class Run:
    """One run: its raw record, figures, latency split and verdict."""

    evaluation_id: str
    spec: ScenarioSpec
    record: RunRecord
    figures: Figures
    verdict: Verdict
    split: dict[str, dict[str, float | None]]
    requested_qps: float | None

    def point(self) -> dict[str, Any]:
        """This run as one entry of a summary's ``points``."""
        f = self.figures
        return {
            "evaluation_id": self.evaluation_id,
            "qps": self.requested_qps,
            "batch_size": self.spec.batch_size,
            "queries": f.queries,
            "scheduled_qps": f.scheduled_qps,
            "achieved_qps": f.achieved_qps,
            "completed_qps": f.completed_qps,
            "backlog_s": f.backlog_s,
            "throughput_ips": f.throughput_ips,
            "latency_ms": f.latency_ms.model_dump(),
            "issue_lag_us": f.issue_lag_us,
            "valid": self.verdict.valid,
            "invalid_reasons": list(self.verdict.reasons),
        }

    @staticmethod
    def cancelled_point(
        evaluation_id: str, spec: ScenarioSpec, requested_qps: float | None, queries: int, why: str
    ) -> dict[str, Any]:
        """A run stopped by its job's cancel as one entry of its parent's ``points``:
        the keys of :meth:`point`, no figures, never valid, ``status`` ``cancelled``."""
        none = LatencyStats(trimmed_mean=None, p50=None, p90=None, p99=None, max=None)
        return {
            "evaluation_id": evaluation_id,
            "qps": requested_qps,
            "batch_size": spec.batch_size,
            "queries": queries,
            "scheduled_qps": None,
            "achieved_qps": None,
            "completed_qps": None,
            "backlog_s": None,
            "throughput_ips": None,
            "latency_ms": none.model_dump(),
            "issue_lag_us": {},
            "valid": False,
            "invalid_reasons": [why],
            "status": "cancelled",
        }


@dataclass
class RunsSoFar:
    """How far a scenario of several runs got, for what its job stores when cancelled
    (:mod:`broker.cancel`): the runs with their own id that ended, the one in progress
    and the live record of the run being measured (as last reported as progress).
    A scenario of one run (a sweep of one point included) leaves ``finished`` empty and
    ``current`` None: a cancel stores it as the evaluation itself."""

    finished: list[Run] = field(default_factory=list)
    """The runs that ended, each under its own id, in the order they ran."""
    current: tuple[str, ScenarioSpec, float | None] | None = None
    """The run in progress: its id, spec and requested rate; None between runs."""
    record: RunRecord | None = None
    """The live record of the run being measured (its progress reports')."""

    def begin(self, evaluation_id: str, spec: ScenarioSpec, requested_qps: float | None) -> None:
        """Run ``evaluation_id`` starts: no record of it yet (an earlier run's is not its)."""
        self.current, self.record = (evaluation_id, spec, requested_qps), None

    def end(self, run: Run) -> None:
        """``run`` ended (judged): it is stored on its own whatever comes next."""
        self.finished.append(run)
        self.current, self.record = None, None
