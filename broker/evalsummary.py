"""An evaluation's summaries: what every run of one evaluation shares in its summary
(:class:`Summarizer`), the summary of a sweep or search (:func:`parent_summary`), the
figures of the agent's release reply (memory, energy, host load: :func:`release_figures`)
and the span batches its trace budget refused (:func:`budget_warnings`)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import anyio

from broker import scenario
from broker.evalprep import Prepared
from broker.run import Run
from broker.summary import LoadgenCost, stream_warnings, tracing_warnings
from mlscope import codec, names
from mlscope.bus import Bus, request
from mlscope.catalog import Entry
from mlscope.contracts import (
    AgentDescription,
    EvaluationSummary,
    JobRequest,
    ReleaseOp,
    ReleaseReply,
)
from mlscope.errors import MLScopeError, WireError
from mlscope.provision import AGENT_TRACE_BATCHES

__all__ = [
    "HOST_OTHER_WARN_CORES",
    "HOST_STEAL_WARN_CORES",
    "Summarizer",
    "budget_warnings",
    "host_warnings",
    "parent_summary",
    "release_agent",
    "release_facts",
    "release_figures",
]

log = logging.getLogger("mlscope.server")


@dataclass(frozen=True, kw_only=True)
class Summarizer:
    """What every run of one evaluation shares in its summary (a sweep's runs and
    their parent alike)."""

    job: JobRequest
    manifest: Any
    framework: Any
    agent: AgentDescription
    level: str
    cost: LoadgenCost
    offset_ns: int
    rtt_ns: int
    cold_start: dict[str, Any]
    started: float
    finished: float

    @classmethod
    def of(
        cls,
        job: JobRequest,
        agent: AgentDescription,
        entry: Entry,
        p: Prepared,
        outcome: scenario.Outcome,
        span: tuple[float, float],
    ) -> Summarizer:
        """What turns each run of this job into a summary."""
        fw = next(x for x in agent.frameworks if x.name == job.framework)
        cost = (
            LoadgenCost(agent_host=agent.host, loadgens=job.scenario.loadgens)
            if job.placement == "server"
            else LoadgenCost(
                agent_host=agent.host, placement="agent", host=agent.host, cores=agent.cpu_cores
            )
        )
        prep = p.prep
        return cls(
            job=job,
            manifest=entry.manifest,
            framework=fw,
            agent=agent,
            level=p.level.name.lower(),
            cost=cost,
            offset_ns=p.offset,
            rtt_ns=p.rtt,
            cold_start=outcome.cold_start
            or {
                "load_ms": prep.load_ns / 1e6,
                "first_inference_ms": prep.first_inference_ns / 1e6,
                "cold": prep.cold,
            },
            started=span[0],
            finished=span[1],
        )

    def __call__(self, run: Run, reasons: tuple[str, ...] = (), **extra: Any) -> EvaluationSummary:
        """The summary of ``run`` (``reasons``: more than its verdict's; ``extra``:
        fields a sweep's or search's parent adds)."""
        job, m, fw, agent = self.job, self.manifest, self.framework, self.agent
        cost = self.cost.served_by(run.record.sources)
        f, why = run.figures, (*run.verdict.reasons, *reasons)
        return EvaluationSummary(
            evaluation_id=run.evaluation_id,
            job_id=job.job_id,
            status="completed",
            valid=not why,
            invalid_reasons=why,
            model={"name": m.name, "version": m.version},
            framework={"name": fw.name, "version": fw.version},
            agent_id=agent.agent_id,
            host=agent.host,
            device=job.device,
            scenario=run.spec.model_dump(),
            trace_level=self.level,
            queries=f.queries,
            samples=f.samples,
            errors=f.errors,
            not_issued=f.not_issued,
            failed=f.outcomes["failed"],
            refused=f.outcomes["refused"],
            lost=f.outcomes["lost"],
            warmup_queries=f.warmup_queries,
            duration_s=f.duration_s,
            requested_qps=run.requested_qps,
            scheduled_qps=f.scheduled_qps,
            achieved_qps=f.achieved_qps,
            completed_qps=f.completed_qps,
            backlog_s=f.backlog_s,
            issue_lag_split_us=f.issue_lag_split_us,
            loadgen_cost={
                **cost.facts(f),
                **({"services": list(run.record.sources)} if run.record.sources else {}),
            },
            parallel=job.parallel,
            warnings=(
                *cost.warnings(f, parallel=job.parallel),
                *tracing_warnings(self.level),
                *stream_warnings(run.record),
            ),
            latency_ms=f.latency_ms,
            issue_lag_us=f.issue_lag_us,
            throughput_ips=f.throughput_ips,
            accuracy=({"top1": f.top1} if f.top1 is not None else None),
            clock_offset_ns=self.offset_ns,
            clock_rtt_ns=self.rtt_ns,
            cold_start=self.cold_start,
            latency_split_ms=run.split,
            loadgens=run.spec.loadgens,
            placement=job.placement,
            preprocess="ahead" if run.record.preprocessed else "timed",
            started_at=self.started,
            finished_at=self.finished,
            **extra,
        )


def parent_summary(
    summarize: Summarizer,
    eval_id: str,
    outcome: scenario.Outcome,
    lost: str,
) -> EvaluationSummary:
    """The job's summary: its main run's, with what a sweep or search found."""
    # A sweep of one point is that run: it is stored once, as the parent. Of a sweep
    # of several, and of a search (however many trials it made), each run has its own
    # id (:meth:`broker.scenario.Outcome.separate`) and is stored on its own, and the
    # parent holds only the summary (its figures those of the best run, and no query
    # rows). Either way its scenario is the main run's (the batch size or rate its
    # figures and rows come from; the sweep's list stays in it), and the job's own
    # spec is in the stored specification.
    separate = bool(outcome.separate(eval_id))
    points = [
        r.point() if separate else {**r.point(), "evaluation_id": eval_id} for r in outcome.points
    ]
    return summarize(
        outcome.main,
        (*outcome.extra_reasons, *([lost] if lost else [])),
        peak_qps=outcome.peak_qps,
        optimal_batch_size=outcome.optimal_batch_size,
        points=tuple(points),
    ).model_copy(update={"evaluation_id": eval_id})


async def release_agent(
    bus: Bus, agent_id: str, eval_id: str, *, timeout: float = 5.0
) -> dict[str, Any]:
    """End the agent's session of ``eval_id`` (a run it runs for it stopped, its spans
    published): what its release reply says (:func:`release_facts`), or {} when it does
    not answer within ``timeout`` seconds or answers with an error: the evaluation's
    outcome is its run's, whatever its release says."""
    with anyio.move_on_after(timeout), contextlib.suppress(MLScopeError):
        reply = await request(
            bus,
            names.agent_ctl(agent_id),
            codec.encode_model(ReleaseOp(evaluation_id=eval_id)),
            timeout=timeout,
        )
        return release_facts(reply, agent_id)
    return {}


def release_facts(reply: Any, agent_id: str) -> dict[str, Any]:
    """What the agent's answer to a release says (memory, energy, span batches refused),
    read as a :class:`ReleaseReply` where it arrives: an answer that is none (a wrong
    type, a negative size, an energy that is no number) is logged and told nothing, as
    an agent that did not answer, rather than failing the evaluation after its run or
    going into its summary."""
    try:
        return codec.validate(ReleaseReply, reply).model_dump()
    except WireError as exc:
        log.warning("agent %s: its release reply is no ReleaseReply: %s", agent_id, exc.message)
        return {}


def budget_warnings(released: dict[str, Any]) -> tuple[str, ...]:
    """What the agent's release says of span batches the traces stream refused."""
    refused = int(released.get("span_batches_refused") or 0)
    if not refused:
        return ()
    return (
        f"{refused} span batches refused: the agent's trace budget "
        f"({AGENT_TRACE_BATCHES} batches not yet stored) was full; their spans are missing",
    )


def release_figures(released: dict[str, Any], samples: int) -> dict[str, float | None]:
    """``peak_rss_mb`` and ``rss_growth_mb`` (MB = 10⁶ bytes), ``energy_j`` and
    ``energy_per_inference_j``, ``host_other_cores`` and ``host_steal_cores`` from the
    agent's release reply; None where the agent did not report them (no readable
    counter, an older agent, a lost one)."""
    start, peak, end = (released.get(f"rss_{k}_bytes") for k in ("start", "peak", "end"))
    energy = released.get("energy_j")
    window = released.get("host_window_s")
    other, steal = (released.get(k) for k in ("host_other_cpu_s", "host_steal_s"))
    return {
        "peak_rss_mb": peak / 1e6 if peak is not None else None,
        "rss_growth_mb": (end - start) / 1e6 if start is not None and end is not None else None,
        "energy_j": energy,
        "energy_per_inference_j": energy / samples if energy is not None and samples else None,
        "host_other_cores": other / window if other is not None and window else None,
        "host_steal_cores": steal / window if steal is not None and window else None,
    }


HOST_OTHER_WARN_CORES = 0.25
"""Other processes keeping a quarter of a core busy on the agent's host, on average
over the evaluation, are said to have shared it (an idle host's daemons use ~0.01)."""
HOST_STEAL_WARN_CORES = 0.05
"""The hypervisor taking a twentieth of a core meanwhile is said to have."""


def host_warnings(figures: dict[str, Any], loadgen_cost: dict[str, Any]) -> tuple[str, ...]:
    """What the agent's host did besides the agent (:func:`release_figures`' host
    figures): other processes' CPU and the hypervisor's steal, each when large enough
    to have taken CPU from the model. A load generator sharing the host is counted out
    of "other processes" (its own warning says what it used: ``LoadgenCost.warnings``)."""
    out = []
    other, steal = figures.get("host_other_cores"), figures.get("host_steal_cores")
    loadgen = loadgen_cost.get("busy_cores") if loadgen_cost.get("shared_host") else None
    if other is not None:
        besides = other - (loadgen or 0.0)
        if besides >= HOST_OTHER_WARN_CORES:
            told = " besides the load generator" if loadgen else ""
            out.append(
                f"other processes on the agent's host kept {besides:.2f} cores busy on "
                f"average{told} while the evaluation ran: the model had less CPU than on "
                "a quiet host, and its figures may not reproduce there"
            )
    if steal is not None and steal >= HOST_STEAL_WARN_CORES:
        out.append(
            f"the hypervisor took {steal:.2f} cores from the agent's host (steal time) "
            "while the evaluation ran: the model had less CPU than the host's cores"
        )
    return tuple(out)
