"""What an evaluation reports: its summary and the job's progress events."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
)

from mlscope.contracts._base import Ident, Placement, Preprocess, _Message


class LatencyStats(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    trimmed_mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


class EvaluationSummary(_Message):
    """The result of one evaluation; the JSON that ``mlscope-submit --json`` prints."""

    kind: Literal["summary"] = "summary"
    evaluation_id: Ident
    job_id: Ident
    status: Literal["completed", "failed", "cancelled"]
    """``cancelled``: stopped on request (``mlscope cancel``, Ctrl-C); never VALID."""
    valid: bool
    invalid_reasons: tuple[str, ...] = ()
    model: dict[str, str]
    framework: dict[str, str]
    agent_id: Ident
    host: str = ""
    device: str = "cpu"
    scenario: dict[str, Any]
    trace_level: str
    queries: int
    samples: int
    errors: int
    """Issued queries not answered with outputs: ``failed + refused + lost``
    (:mod:`mlscope.outcomes`)."""
    not_issued: int
    failed: int = 0
    refused: int = 0
    """Answered "overloaded" by the agent without running."""
    lost: int = 0
    """Issued and never answered."""
    warmup_queries: int = 0
    """The first queries, run to warm up: stored and flagged, left out of the latency,
    throughput, accuracy and failure figures (rates and load rules count them)."""
    duration_s: float
    requested_qps: float | None
    scheduled_qps: float | None = None
    """Offered rate: scheduled queries / last scheduled offset."""
    achieved_qps: float | None
    """Issued rate: issued queries / last issue offset."""
    completed_qps: float | None = None
    """Completed rate: queries answered with outputs / last answer offset."""
    backlog_s: float | None = None
    """Open loops: queries arrived and unanswered at the end of the load window, in
    seconds of offered load (about one mean latency when the system keeps up)."""
    issue_lag_split_us: dict[str, dict[str, float | None]] | None = None
    """Issue lag's two parts: ``pacer`` (scheduled -> released by the pacer thread) and
    ``loop`` (released -> handed to the bus client by the event loop)."""
    loadgen_cost: dict[str, Any] | None = None
    """The load generator's own cost: ``cpu_us_per_query`` (its CPU time per issued
    query: its process's in placement server, its own threads' in placement agent),
    ``host``, ``shared_host`` (it ran on the agent's host, sharing its cores),
    ``placement``; placement agent adds the agent process's ``process_cpu_s`` and
    ``process_cpu_us_per_query`` (model and load generator together)."""
    parallel: bool = False
    """Run with ``--parallel``: other evaluations may have shared its hosts meanwhile."""
    warnings: tuple[str, ...] = ()
    """What may have disturbed the measurement without making the run INVALID."""
    latency_ms: LatencyStats
    issue_lag_us: dict[str, float | None]
    throughput_ips: float | None
    accuracy: dict[str, float] | None = None
    clock_offset_ns: int = 0
    clock_rtt_ns: int = 0
    cold_start: dict[str, Any] | None = None
    latency_split_ms: dict[str, dict[str, float | None]] | None = None
    """Per stage (issue_lag, transport, queueing, compute, reply): p50/p99/mean in ms."""
    peak_qps: float | None = None
    """peak: the highest Poisson rate that met the latency bound."""
    optimal_batch_size: int | None = None
    """batched: the batch size with the highest throughput."""
    points: tuple[dict[str, Any], ...] = ()
    """peak / batched: every run made (rate or batch size, latencies, verdict, its id)."""
    loadgens: int = 1
    placement: Placement = "server"
    """Where the load generator ran (the job's ``placement``)."""
    preprocess: Preprocess = "timed"
    """When the samples were pre-processed (``ahead``: before the clock started, not
    part of any query's latency)."""
    mlperf: dict[str, Any] | None = None
    """MLPerf LoadGen's own result: scenario, mode, ``result_*`` keys of its detail
    log, its verdict and early-stopping text, the log files kept, ``imported``."""
    peak_rss_mb: float | None = None
    """The agent process's peak resident memory while the evaluation was prepared (MB,
    10⁶ bytes); None when the agent did not report it."""
    rss_growth_mb: float | None = None
    """Its resident memory at release minus at prepare (MB): what the run kept."""
    energy_j: float | None = None
    """Energy the evaluation used, joules; None when no power source was readable
    (never 0 for "unknown"). On a CPU it is the whole package's (RAPL)."""
    energy_per_inference_j: float | None = None
    """``energy_j`` over the run's samples (joules per inference); None with it."""
    host_other_cores: float | None = None
    """Cores that processes other than the agent kept busy on its host, on average
    between prepare and release (the server and load generator included when they
    shared it); None when the agent could not read its host's counters."""
    host_steal_cores: float | None = None
    """Cores the hypervisor took from the agent's host meanwhile (steal time)."""
    started_at: float
    finished_at: float


class JobEvent(_Message):
    """Progress of a job, published on ``mlscope.job.<job_id>.events``."""

    kind: Literal["job_event"] = "job_event"
    job_id: Ident
    event: Literal["queued", "accepted", "restarted", "progress", "done", "failed", "cancelled"]
    """queued: said by the submitter itself, when no server took the job at once but
    servers answer (each runs a few jobs at a time; the job waits its turn);
    restarted: a server took the job again after the one running it was lost;
    cancelled: stopped on request (``summary`` is the stored cancelled evaluation)."""
    note: str = ""
    server_id: Ident = ""
    evaluation_id: Ident | None = None
    queries_done: int = 0
    """progress: queries answered so far (with outputs, an error or a refusal) in the
    run named by ``evaluation_id``; done and cancelled: the same count for the run the
    summary describes, at its end (:meth:`ended`)."""
    elapsed_s: float = 0.0
    """progress: seconds since that run's clock started; done and cancelled: the
    summary's ``duration_s``."""
    p50_ms: float | None = None
    summary: EvaluationSummary | None = None
    error: dict[str, Any] | None = None

    @classmethod
    def ended(
        cls, summary: EvaluationSummary, *, server_id: str, job_id: str | None = None
    ) -> JobEvent:
        """A job's last event: ``done`` (``cancelled`` for a cancelled run) with its
        summary, and that summary's run's final figures in the fields progress events
        fill, so that a callback that shows ``queries_done`` ends on the true count.
        Answered queries are those neither left unissued nor lost. ``job_id``: the job
        that ends, when its summary is another job's (an MLPerf import of logs stored
        before answers with the evaluation stored then); default the summary's."""
        cancelled = summary.status == "cancelled"
        return cls(
            job_id=job_id or summary.job_id,
            event="cancelled" if cancelled else "done",
            server_id=server_id,
            evaluation_id=summary.evaluation_id,
            queries_done=max(0, summary.queries - summary.not_issued - summary.lost),
            elapsed_s=summary.duration_s,
            p50_ms=summary.latency_ms.p50,
            summary=summary,
            note=summary.invalid_reasons[0] if cancelled and summary.invalid_reasons else "",
        )
