"""Every message that crosses the bus: one frozen pydantic model per kind.

Each message carries ``kind`` and ``schema``; a change to a message's meaning bumps
its schema number (history below). Tensors travel as numpy arrays through
:mod:`mlscope.codec`.

Schema history:
    1 (0.1.0)  first version of every message; later additions with defaults, which
               old readers refuse (``extra="forbid"``): Query.labels,
               Query.more_inputs, QueryReply.labels, JobEvent "restarted" and its
               ``note``; the control and database requests and replies
               (``ControlRequest``, ``SqlRequest``, ...) became contracts of their own,
               and AgentDescription, JobRequest and ScenarioSpec refuse values no
               service can act on (a negative pid, a heartbeat in the far future, an
               unknown trace level, a malformed version constraint, batch size 0);
               JobRequest.mlperf, JobRequest.mlperf_import, EvaluationSummary.mlperf;
               JobRequest.placement, EvaluationSummary.placement,
               AgentDescription.features and the local run (``RunOp``,
               ``RunStarted``, ``RunRows``);
               JobRequest.system (``SystemRequirement``), AgentDescription.usable_cores
               and memory_limit_bytes, Accelerator.interconnect; ReleaseReply's RSS
               figures and EvaluationSummary's peak_rss_mb, rss_growth_mb, energy_j;
               PrepareReply.settings, mlscope_version and git_commit;
               CancelRequest / CancelReply, JobEvent "cancelled" and
               EvaluationSummary status "cancelled";
               ScenarioSpec.loadgen_hosts and the load-generator service's messages
               (LoadgenDescription, LoadgenLoadOp, LoadgenStartOp, LoadgenProgress and
               the replies); SqlRequest.format, offset and limit, and SqlArrowReply
               (Arrow IPC pages of a result); the agent's sample library and MLPerf
               LoadGen in the agent (``SamplesLoadOp``, ``SamplesUnloadOp``,
               ``SamplesReply``, ``SamplesQuery``, ``MLPerfRunOp``, ``MLPerfStarted``,
               ``MLPerfDone``, ``MLPerfFetchOp``, ``MLPerfFile``; AgentDescription
               feature ``mlperf-loadgen``).
"""

from __future__ import annotations

import enum
import math
import uuid
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    PlainValidator,
    TypeAdapter,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from mlscope import scenario_traits
from mlscope.errors import ConfigError
from mlscope.versions import parse_constraint

__all__ = [
    "LOADGEN_CONTROL",
    "LOCAL_RUN",
    "MAX_BATCH",
    "MAX_CONCURRENCY",
    "MAX_DURATION_S",
    "MAX_ID_CHARS",
    "MAX_LOADGENS",
    "MAX_QPS",
    "MAX_SAMPLE_INDICES",
    "MAX_SCHEDULED_QUERIES",
    "MAX_SEGMENTS",
    "MLPERF_LOADGEN",
    "QUERY_INDEX_LIMIT",
    "Accelerator",
    "AgentDescription",
    "CancelReply",
    "CancelRequest",
    "ControlOp",
    "ControlReply",
    "ControlRequest",
    "DescribeOp",
    "ErrorReply",
    "EvaluationReply",
    "EvaluationRequest",
    "EvaluationSummary",
    "FrameworkInfo",
    "Ident",
    "JobEvent",
    "JobRequest",
    "LatencyStats",
    "LoadgenDescription",
    "LoadgenDone",
    "LoadgenLoadOp",
    "LoadgenLoaded",
    "LoadgenProgress",
    "LoadgenStartOp",
    "LoadgenStopOp",
    "LoadgenStopped",
    "MLPerfDone",
    "MLPerfFetchOp",
    "MLPerfFile",
    "MLPerfImport",
    "MLPerfRunOp",
    "MLPerfSpec",
    "MLPerfStarted",
    "ModelOffer",
    "PingOp",
    "PingReply",
    "Placement",
    "PrepareOp",
    "PrepareReply",
    "Query",
    "QueryIndex",
    "QueryReply",
    "RefusalReason",
    "RefusedModel",
    "ReleaseOp",
    "ReleaseReply",
    "RunOp",
    "RunRows",
    "RunStarted",
    "SampleBatch",
    "SamplesLoadOp",
    "SamplesQuery",
    "SamplesReply",
    "SamplesUnloadOp",
    "ScenarioName",
    "ScenarioSpec",
    "SpanBatch",
    "SqlArrowReply",
    "SqlReply",
    "SqlRequest",
    "Subject",
    "SystemRequirement",
    "TraceLevel",
    "evaluation_id_for",
    "new_id",
]

SCHEMA = 1
LOCAL_RUN = "local-run"
"""The feature an agent advertises when it can generate a run's load itself
(``placement: agent``, :class:`RunOp`)."""
MLPERF_LOADGEN = "mlperf-loadgen"
"""The feature an agent advertises when it can run MLPerf LoadGen next to its model
(``mlscope mlperf --placement agent``, :class:`MLPerfRunOp`)."""
MAX_SAMPLE_INDICES = 262_144
"""Most data-set indices one sample-library request may name."""
MAX_ID_CHARS = 256
"""Longest id (job, evaluation, agent, run...) a message may carry: ids become subject
tokens and KV keys, and nats-server closes a connection that sends a subject longer
than its control line, which would cut a service off the bus."""
Ident = Annotated[str, Field(max_length=MAX_ID_CHARS)]
Subject = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=r"^[!-~]+$")]
"""A NATS subject a message names for another to publish on: printable ASCII without
spaces (a space or line break would end the protocol line it is written into)."""
MAX_QPS = 1e6
"""Fastest rate a run may ask for (one load generator issues ~10⁵ queries a second)."""
MAX_DURATION_S = 7 * 24 * 3600.0
"""Longest run a scenario may ask for."""
MAX_BATCH = 65_536
"""Largest batch a query may carry."""
MAX_CONCURRENCY = 65_536
"""Most queries a closed loop (or a load generator's window) may keep in flight."""
MAX_SCHEDULED_QUERIES = 50_000_000
"""Most queries one open-loop schedule may hold (its arrivals and a run's record of
them take ~150 bytes a query): a rate and duration asking for more are refused before
anything is drawn, whatever ``max_queries`` cuts them to."""
MAX_SEGMENTS = 10_000
"""Most segments a piecewise schedule may have."""
MAX_LOADGENS = 256
"""Most load-generator processes or services one run's schedule may be dealt to."""
QUERY_INDEX_LIMIT = 2**63
"""Query indices are 0 .. 2**63 - 1: they are stored as Int64 and travel as msgpack ints."""
QueryIndex = Annotated[int, Field(ge=0, lt=QUERY_INDEX_LIMIT)]
Placement = Literal["server", "agent"]
"""Where a run's load generator runs: on the server (every query crosses the bus to the
agent and back: a *served* model) or in the agent (the model itself, no bus per query)."""
Preprocess = Literal["ahead", "timed"]
"""When a query's samples are pre-processed: ``ahead`` (once, before the clock starts,
and held by the agent like LoadGen's QuerySampleLibrary: a query's time is its predict
and post-processing) or ``timed`` (in the pipeline, inside each query's time)."""


def new_id(prefix: str) -> str:
    """A short unique id such as ``ev-1f3a9c2b7d4e``."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def evaluation_id_for(job_id: str) -> str:
    """The evaluation id of a job: derived from it, so a redelivered job finds the
    evaluation its first delivery stored (or is storing) instead of making a second."""
    return f"ev-{uuid.uuid5(uuid.NAMESPACE_URL, f'mlscope:job:{job_id}').hex[:12]}"


def _ndarray(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    raise ValueError(f"expected a numpy array, got {type(value).__name__}")


NDArray = Annotated[np.ndarray, PlainValidator(_ndarray)]


class _Message(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", arbitrary_types_allowed=True, populate_by_name=True
    )
    schema_: int = Field(default=SCHEMA, alias="schema")

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="python", by_alias=True)


class TraceLevel(enum.IntEnum):
    """How much an evaluation traces (paper Listing 4); a span is kept at or below it."""

    NONE = 0
    MODEL = 1
    FRAMEWORK = 2
    SYSTEM = 3
    FULL = 4

    @classmethod
    def parse(cls, value: str | int | TraceLevel) -> TraceLevel:
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError as exc:
                names = ", ".join(m.name.lower() for m in cls)
                raise ValueError(f"unknown trace level {value!r} (one of {names})") from exc
        return cls(value)


# --------------------------------------------------------------------------- registry


class Accelerator(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["gpu", "fpga", "npu"]
    model: str
    index: int = 0
    memory_bytes: int | None = None
    interconnect: str | None = None
    """How the device is attached, as the driver reports it (``pcie4``, ``nvlink``);
    None when it does not say."""


class FrameworkInfo(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    version: str
    devices: tuple[str, ...] = ("cpu",)


class ModelOffer(BaseModel):
    """A model an agent can serve, with the artifact it would load."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    version: str
    framework: str
    sha256: str | None = None


RefusalReason = Literal[
    "missing", "checksum", "custom_code", "framework_version", "policy", "invalid"
]


class RefusedModel(BaseModel):
    """A model of the agent's framework that it does not serve, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    version: str
    framework: str
    reason: RefusalReason
    """missing: not built / not present; checksum: the file differs from its build lock
    or pin; custom_code: a step this agent may not run; framework_version: the
    manifest's constraint excludes this agent's runtime; policy: a manifest from the bus
    names an asset location the fetch policy refuses (mlscope.fetchpolicy); invalid:
    anything else."""
    message: str
    fix: str | None = None
    """The command that mends it, when there is one."""


EPOCH_LIMIT_S = 4.1e9
"""The latest wall-clock time (s since the epoch, year 2099) a registry entry may carry."""


class AgentDescription(_Message):
    """What an agent puts in the registry bucket under its id (refreshed by heartbeat)."""

    kind: Literal["agent"] = "agent"
    agent_id: Ident
    host: str
    arch: str
    os: str
    cpu_model: str
    cpu_cores: int
    memory_bytes: int
    usable_cores: int | None = Field(default=None, ge=1)
    """Cores this agent may run on (its CPU affinity); ``cpu_cores`` is the machine's."""
    memory_limit_bytes: int | None = Field(default=None, ge=0)
    """The agent's memory limit (its cgroup's) when lower than ``memory_bytes``."""
    accelerators: tuple[Accelerator, ...] = ()
    frameworks: tuple[FrameworkInfo, ...]
    models: tuple[ModelOffer, ...] = ()
    refused: tuple[RefusedModel, ...] = ()
    """Models of this framework that the agent does not serve, with the reason."""
    capabilities: tuple[str, ...] = ()
    pid: int = Field(ge=1, lt=1 << 32)
    mlscope_version: str
    started_at: float = Field(ge=0, le=EPOCH_LIMIT_S, allow_inf_nan=False)
    heartbeat_at: float = Field(ge=0, le=EPOCH_LIMIT_S, allow_inf_nan=False)
    heartbeat_s: float = Field(gt=0, le=3600, allow_inf_nan=False)
    features: tuple[str, ...] = ()
    """Optional abilities of this agent, e.g. :data:`LOCAL_RUN` (an agent that does
    not list one is refused jobs that need it)."""


# --------------------------------------------------------------------------- jobs


class _ListsScenarios:
    """The JSON schema of a scenario name: an ``enum`` of the registered ones, read when
    the schema is generated (scenarios register after this module is imported)."""

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core)
        schema["enum"] = list(scenario_traits.names())
        return schema


ScenarioName = Annotated[
    str, Field(max_length=64), AfterValidator(scenario_traits.check_name), _ListsScenarios
]
"""A registered scenario (:mod:`mlscope.scenario_traits`; one module each in
:mod:`mlscope.scenario_kinds`)."""


class ScenarioSpec(BaseModel):
    """How load is generated; latency always counts from each query's scheduled time."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: ScenarioName = "online"
    """The scenario: each is declared in :mod:`mlscope.scenario_kinds` (``mlscope-submit
    --help`` lists them with one line each)."""
    qps: float = Field(default=100.0, gt=0, le=MAX_QPS)
    duration_s: float = Field(default=10.0, gt=0, le=MAX_DURATION_S)
    batch_size: int = Field(default=1, ge=1, le=MAX_BATCH)
    seed: int = 0
    max_queries: int | None = Field(default=None, ge=1)
    min_duration_s: float | None = Field(default=None, ge=0, le=MAX_DURATION_S)
    min_queries: int | None = Field(default=None, ge=1)
    max_outstanding: int = Field(default=1024, ge=1, le=MAX_CONCURRENCY)
    warmup_queries: int = Field(default=0, ge=0)
    concurrency: int = Field(default=1, ge=1, le=MAX_CONCURRENCY)
    """Closed loops: queries kept in flight."""
    latency_bound_ms: float | None = Field(default=None, gt=0)
    """Bound on the p99 latency (online, peak): a run over it is INVALID."""
    batch_sizes: tuple[Annotated[int, Field(ge=1, le=MAX_BATCH)], ...] | None = Field(
        default=None, min_length=1, max_length=64
    )
    """batched: the batch sizes swept (default: just ``batch_size``)."""
    arrivals_s: tuple[float, ...] | None = None
    """replay: inter-arrival times in seconds (read from ``--schedule FILE``)."""
    segments: tuple[tuple[float, float, float], ...] | None = None
    """piecewise: ``(rate_start, rate_end, seconds)`` per segment (ramps and bursts)."""
    loadgens: int = Field(default=1, ge=1, le=MAX_LOADGENS)
    """Open loops: load-generator processes the global schedule is dealt to."""
    loadgen_hosts: tuple[Annotated[str, Field(min_length=1, max_length=128)], ...] | None = Field(
        default=None, min_length=1
    )
    """Open loops: ids of registered load-generator services (``mlscope loadgen``,
    possibly on other hosts) the global schedule is dealt to, slice ``j`` to the
    ``j``-th; ``loadgens`` is then their number. None: ``loadgens`` child processes of
    the server on its own host."""
    preprocess: Preprocess | None = None
    """When samples are pre-processed (:data:`Preprocess`). None: ``ahead`` with
    placement agent where the pipeline pre-processes sample by sample and the data set
    fits the agent's sample memory, else ``timed``. Placement server is always
    ``timed``: raw samples cross the bus. The summary says which one ran."""

    @field_validator("arrivals_s")
    @classmethod
    def _arrivals_within_a_run(cls, v: tuple[float, ...] | None) -> tuple[float, ...] | None:
        if v is not None:
            if not all(math.isfinite(g) and g >= 0 for g in v):
                raise ValueError("arrivals_s must be finite times >= 0")
            if math.fsum(v) > MAX_DURATION_S:
                raise ValueError(f"arrivals_s reach past {MAX_DURATION_S:.0f} s, the longest run")
        return v

    @field_validator("segments")
    @classmethod
    def _segments_within_a_run(
        cls, v: tuple[tuple[float, float, float], ...] | None
    ) -> tuple[tuple[float, float, float], ...] | None:
        if v is not None:
            if len(v) > MAX_SEGMENTS:
                raise ValueError(f"at most {MAX_SEGMENTS} segments")
            for a, b, seconds in v:
                if not (0 <= a <= MAX_QPS and 0 <= b <= MAX_QPS and seconds > 0):
                    raise ValueError(
                        f"a segment's rates must be 0 .. {MAX_QPS:g} and its seconds > 0"
                    )
            if math.fsum(seconds for _, _, seconds in v) > MAX_DURATION_S:
                raise ValueError(f"segments last past {MAX_DURATION_S:.0f} s, the longest run")
        return v

    @field_validator("loadgen_hosts")
    @classmethod
    def _distinct_hosts(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is not None and len(set(v)) != len(v):
            raise ValueError("loadgen_hosts names a load generator twice")
        return v

    @model_validator(mode="after")
    def _a_schedule_a_run_can_hold(self) -> ScenarioSpec:
        """A rate-driven scenario's queries (rate x duration) within what one run holds,
        refused here rather than when the server draws the schedule."""
        expected = self.qps * self.duration_s
        # The traits only past the bound: the product is cheap, the lookup is not.
        if expected > MAX_SCHEDULED_QUERIES and scenario_traits.get(self.name).rate_driven:
            raise ValueError(
                f"qps x duration_s is {expected:.3g} queries, over the "
                f"{MAX_SCHEDULED_QUERIES:,} one run may have"
            )
        return self

    def model_post_init(self, _context: Any) -> None:
        if self.loadgen_hosts is not None and self.loadgens != len(self.loadgen_hosts):
            if "loadgens" in self.model_fields_set:
                raise ValueError(
                    f"loadgens={self.loadgens} but {len(self.loadgen_hosts)} loadgen_hosts"
                )
            object.__setattr__(self, "loadgens", len(self.loadgen_hosts))

    peak_trials: int = Field(default=10, ge=2, le=100)
    """peak: most runs the search makes."""
    max_issue_lag_us: float | None = Field(default=None, gt=0)
    """Validity: p99 issue lag tolerated (default: the server's policy, 500 µs)."""
    repetitions: int = Field(default=5, ge=1, le=1000)
    """cold-start: how many times the model is unloaded, loaded and run again."""
    warm_queries: int = Field(default=20, ge=1, le=1_000_000)
    """cold-start: warm queries after each load (closed loop, ``batch_size`` samples)."""


class MLPerfSpec(BaseModel):
    """A run of MLPerf LoadGen against the job's agent (``mlscope mlperf``).

    Settings apply in LoadGen's order: ``mlperf_conf`` (LoadGen's built-in one when
    None), then ``user_conf``, then the explicit fields that are set.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    scenario: Literal["SingleStream", "MultiStream", "Server", "Offline"]
    mode: Literal["PerformanceOnly", "AccuracyOnly"] = "PerformanceOnly"
    target_qps: float | None = Field(default=None, gt=0, le=MAX_QPS)
    """Server: ``server_target_qps``; Offline: ``offline_expected_qps``."""
    user_conf: str | None = None
    """The text of an MLPerf ``user.conf`` (``model.Scenario.key = value`` lines)."""
    mlperf_conf: str | None = None
    """The text of an ``mlperf.conf`` replacing the one LoadGen ships."""
    conf_model: str | None = None
    """The model name the conf files' lines use (default: the mlscope model's name)."""
    batch_size: int = Field(default=32, ge=1, le=MAX_BATCH)
    """Most samples the system under test sends the agent in one query (Offline)."""
    window: int = Field(default=8, ge=1, le=MAX_CONCURRENCY)
    """Most agent queries the system under test keeps in flight (the rest wait in it)."""
    seed: int | None = None
    """LoadGen's sample, sample-index and schedule seeds (default: the conf files')."""


class MLPerfImport(BaseModel):
    """MLPerf logs written elsewhere, loaded as an evaluation (``mlscope import mlperf``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    files: dict[str, str]
    """Log file name -> text: ``mlperf_log_summary.txt`` and ``mlperf_log_detail.txt``
    (required), ``mlperf_log_accuracy.json`` / ``mlperf_log_trace.json`` when present."""
    source: str = ""
    """Where the logs were read (a path on the importing machine)."""
    system: str = ""
    """The submitter's system name (the results tree's ``<system>`` directory)."""


class SystemRequirement(BaseModel):
    """What an agent's machine must have to run a job (each field None: anything).

    Matched against the agent's description by :mod:`mlscope.sysmatch`; from
    ``mlscope-submit``'s flags or ``--system FILE``, merged over the model manifest's
    ``system`` by the server."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    arch: str | None = None
    """CPU architecture (``amd64`` and ``x86_64`` are one, as are ``arm64`` and
    ``aarch64``)."""
    device: Literal["cpu", "gpu", "fpga"] | None = None
    """A device kind the agent's framework runs on (``cpu``: every agent)."""
    accelerator: str | None = None
    """Part of an accelerator's model name, case-insensitive (``H100``, ``u250``)."""
    min_memory_bytes: int | None = Field(default=None, ge=0)
    """Host memory the agent may use (its cgroup limit when lower)."""
    min_cores: int | None = Field(default=None, ge=1)
    """CPU cores the agent may run on (its affinity)."""
    interconnect: str | None = None
    """An accelerator attached so (``pcie4``, ``nvlink``)."""
    host: str | None = None
    """Exactly this host name (``mlscope rerun`` pins the original's)."""


def _scenario_placement(job: dict[str, Any]) -> Placement:
    """The placement a job's scenario runs at by default (see ``JobRequest.placement``)."""
    if job.get("mlperf") is not None or job.get("mlperf_import") is not None:
        return "server"
    spec = job.get("scenario")

    def field(name: str, default: Any) -> Any:
        if isinstance(spec, ScenarioSpec):
            return getattr(spec, name)
        return spec.get(name, default) if isinstance(spec, dict) else default

    name = field("name", "online")
    if not isinstance(name, str) or field("loadgens", 1) != 1 or field("loadgen_hosts", None):
        return "server"  # the model's own validation then names what is wrong
    try:
        traits = scenario_traits.get(name)
    except ConfigError:
        return "server"
    return "agent" if traits.placement == "agent" and traits.local else "server"


class JobRequest(_Message):
    """A request to evaluate one model on one framework (published by mlscope-submit)."""

    kind: Literal["job"] = "job"
    job_id: Ident = Field(default_factory=lambda: new_id("job"))
    model: str
    model_version: str | None = None
    framework: str
    framework_version: str | None = None
    device: str = "cpu"
    agent_id: Ident | None = None
    scenario: ScenarioSpec = Field(default_factory=ScenarioSpec)
    trace_level: str = "model"
    submitted_at: float = 0.0
    rerun_of: str | None = None
    manifest_sha256: str | None = None
    """Run only with the model manifest whose content hashes to this
    (``ModelManifest.digest``): set by ``mlscope rerun``."""
    accuracy: bool = False
    """Also run the labelled data set once (top-1/top-5, per-sample outputs stored)."""
    accuracy_samples: int | None = Field(default=None, ge=1)
    """At most this many data-set samples for the accuracy pass (None: all)."""
    parallel: bool = False
    """Let this job run beside other evaluations on the same hosts (``--parallel``);
    by default a submitter runs jobs that share a host one after another."""
    mlperf: MLPerfSpec | None = None
    """Run MLPerf LoadGen as the load generator instead of ``scenario``."""
    mlperf_import: MLPerfImport | None = None
    """Store these MLPerf logs as an evaluation; no agent is involved."""
    system: SystemRequirement | None = None
    """What the agent's machine must have; the server merges it over the model
    manifest's ``system`` (a field set here wins)."""
    placement: Placement = "server"
    """Where the load generator runs: ``server`` (queries cross the bus; measures the
    served model) or ``agent`` (the agent runs the scenario on its own copy of the
    sample set and ships the per-query times back; measures the model itself). Left
    out (or None): the scenario's own default (``ScenarioTraits.placement``: ``agent``
    for the batched throughput sweep, ``server`` for the rest); always ``server`` for
    MLPerf jobs, imports and runs dealt to several load generators."""

    @model_validator(mode="before")
    @classmethod
    def _default_placement(cls, data: Any) -> Any:
        """A job that names no placement gets its scenario's."""
        if not isinstance(data, dict) or data.get("placement") is not None:
            return data
        return {**data, "placement": _scenario_placement(data)}

    @field_validator("trace_level")
    @classmethod
    def _level(cls, value: str) -> str:
        TraceLevel.parse(value)  # ValueError names the levels
        return value

    @field_validator("framework_version")
    @classmethod
    def _constraint(cls, value: str | None) -> str | None:
        parse_constraint(value)  # ValueError names the bad text
        return value

    @model_validator(mode="after")
    def _placement(self) -> JobRequest:
        """A local run (placement agent) is one load generator driving one executor;
        samples are pre-processed ahead only where the agent holds them."""
        if self.placement == "server" and self.scenario.preprocess == "ahead":
            raise ValueError(
                "preprocess ahead needs placement agent (with placement server raw samples "
                "cross the bus and are pre-processed in each query's time)"
            )
        if self.placement == "agent":
            s = self.scenario
            what = (
                "an MLPerf import"
                if self.mlperf_import is not None
                else ""
                if self.mlperf is not None  # LoadGen runs in the agent's host
                else f"scenario {s.name!r}"
                if not scenario_traits.get(s.name).local
                else f"{s.loadgens} load generators"
                if s.loadgens > 1
                else "load-generator hosts (loadgen_hosts)"
                if s.loadgen_hosts
                else ""
            )
            if what:
                raise ValueError(f"{what} cannot run with placement agent; use placement server")
        return self


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
    """The load generator's own cost: ``cpu_us_per_query`` (its process's CPU time per
    issued query), ``host``, ``shared_host`` (it ran on the agent's host, sharing its
    cores)."""
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
    started_at: float
    finished_at: float


class JobEvent(_Message):
    """Progress of a job, published on ``mlscope.job.<job_id>.events``."""

    kind: Literal["job_event"] = "job_event"
    job_id: Ident
    event: Literal["accepted", "restarted", "progress", "done", "failed", "cancelled"]
    """restarted: a server took the job again after the one running it was lost;
    cancelled: stopped on request (``summary`` is the stored cancelled evaluation)."""
    note: str = ""
    server_id: Ident = ""
    evaluation_id: Ident | None = None
    queries_done: int = 0
    elapsed_s: float = 0.0
    p50_ms: float | None = None
    summary: EvaluationSummary | None = None
    error: dict[str, Any] | None = None


# --------------------------------------------------------------------------- queries


# --------------------------------------------------------------------------- control


class PingOp(_Message):
    """Clock probe: the agent answers with its monotonic clock."""

    op: Literal["ping"] = "ping"


class DescribeOp(_Message):
    op: Literal["describe"] = "describe"


class PrepareOp(_Message):
    """Load (or reuse) a model for an evaluation; ``reload`` unloads it first."""

    op: Literal["prepare"] = "prepare"
    evaluation_id: Ident
    model: str
    model_version: str
    batch_size: int = Field(default=1, ge=1)
    max_batch: int | None = Field(default=None, ge=1)
    trace_level: str = "model"
    reload: bool = False

    @field_validator("trace_level")
    @classmethod
    def _level(cls, value: str) -> str:
        TraceLevel.parse(value)
        return value


class ReleaseOp(_Message):
    op: Literal["release"] = "release"
    evaluation_id: Ident
    unload: bool = False


class RunOp(_Message):
    """Run a scenario in the agent (``placement: agent``) for a prepared evaluation.

    The agent builds the same schedule and sample order the server would (from
    ``scenario`` and its seed), answers :class:`RunStarted` at once, runs the load on
    its own pipeline executor and sends :class:`RunRows` to the same reply subject
    while it runs, the last one with ``final`` (published, not requested: one
    request, many replies, as ``allow_responses`` grants a responder).
    """

    op: Literal["run"] = "run"
    evaluation_id: Ident
    scenario: ScenarioSpec
    trace_level: str = "model"
    max_bytes: int = Field(default=1 << 20, ge=4096, le=64 << 20)
    """Largest message the agent may send back (the bus's max payload, less room for
    the subject and headers)."""

    @field_validator("trace_level")
    @classmethod
    def _level(cls, value: str) -> str:
        TraceLevel.parse(value)
        return value


SampleIndex = Annotated[int, Field(strict=True, ge=0)]


class SamplesLoadOp(_Message):
    """Hold these data-set samples for a prepared evaluation (LoadGen's
    ``load_samples``): the agent reads its own copy of the model's data set,
    pre-processes the samples once where the pipeline allows, and keeps them until
    they are unloaded or the evaluation is released. Queries then name samples by
    index (:class:`SamplesQuery`)."""

    op: Literal["load_samples"] = "load_samples"
    evaluation_id: Ident
    indices: tuple[SampleIndex, ...] = Field(max_length=MAX_SAMPLE_INDICES)


class SamplesUnloadOp(_Message):
    """Drop these samples (LoadGen's ``unload_samples``); unknown ones are ignored."""

    op: Literal["unload_samples"] = "unload_samples"
    evaluation_id: Ident
    indices: tuple[SampleIndex, ...] = Field(max_length=MAX_SAMPLE_INDICES)


class MLPerfRunOp(_Message):
    """Run MLPerf LoadGen in the agent's host (``mlscope mlperf --placement agent``)
    for a prepared evaluation: LoadGen in a child process of the agent whose system
    under test calls the model in that process. Answered with :class:`MLPerfStarted`
    at once; :class:`MLPerfDone` follows on the agent's rows subject
    (``mlscope.agent.<id>.rows.<evaluation_id>``) when the test is over, and the
    server then fetches the files (:class:`MLPerfFetchOp`)."""

    op: Literal["mlperf"] = "mlperf"
    evaluation_id: Ident
    spec: MLPerfSpec
    conf_model: str = Field(max_length=256)


class MLPerfFetchOp(_Message):
    """Part of a file an agent's MLPerf run left (named in its :class:`MLPerfDone`):
    at most ``max_bytes`` from ``offset``, answered with :class:`MLPerfFile`."""

    op: Literal["mlperf_fetch"] = "mlperf_fetch"
    evaluation_id: Ident
    name: str = Field(max_length=256)
    offset: int = Field(default=0, ge=0)
    max_bytes: int = Field(default=1 << 20, ge=4096, le=64 << 20)
    """The requester's max payload (nats-server's limit is 64 MiB at most)."""


ControlOp = (
    PingOp
    | DescribeOp
    | PrepareOp
    | ReleaseOp
    | RunOp
    | SamplesLoadOp
    | SamplesUnloadOp
    | MLPerfRunOp
    | MLPerfFetchOp
)
"""Every control request an agent takes."""
ControlRequest = Annotated[ControlOp, Field(discriminator="op")]
"""What ``mlscope.agent.<id>.ctl`` takes (decode with ``CONTROL``)."""
CONTROL: TypeAdapter[ControlOp] = TypeAdapter(ControlRequest)


class PingReply(_Message):
    kind: Literal["pong"] = "pong"
    t_agent: int


class PrepareReply(_Message):
    kind: Literal["prepared"] = "prepared"
    ok: bool = True
    cold: bool
    load_ns: int
    first_inference_ns: int
    sha256: str | None = None
    t_agent: int
    settings: dict[str, Any] | None = None
    """What the agent really ran the model with: its runtime options (threads,
    execution providers, graph optimization, ...), device and pipeline settings
    (batching, queue, pre-processing threads)."""
    mlscope_version: str | None = None
    """The agent's mlscope version (the server's may differ)."""
    git_commit: str | None = None
    """The agent's source commit, when it runs from a git checkout."""


class ReleaseReply(_Message):
    kind: Literal["released"] = "released"
    ok: bool = True
    unloaded: bool = False
    rss_start_bytes: int | None = None
    """The agent process's resident memory when the evaluation was prepared."""
    rss_peak_bytes: int | None = None
    """The highest resident memory seen while it was prepared (sampled every 50 ms,
    plus the kernel's high-water mark where it rose meanwhile)."""
    rss_end_bytes: int | None = None
    """Resident memory at its release."""
    energy_j: float | None = None
    """Energy of the agent's device between prepare and release (NVML on a GPU, RAPL
    packages on the CPU); None when no counter was readable."""


class RunStarted(_Message):
    """The agent took a :class:`RunOp`: offset 0 of the run is ``t0_agent`` (its clock)."""

    kind: Literal["run_started"] = "run_started"
    t0_agent: int
    queries: int = 0
    """Queries the open-loop schedule holds (0 for a closed loop: not known ahead)."""
    preprocess: Preprocess = "timed"
    """When the run's samples are pre-processed (``ahead``: before ``t0_agent``)."""


class RunRows(_Message):
    """Per-query rows of a local run, column by column (numpy arrays, one length).

    Columns are those of :data:`mlscope.record.ARRAYS` for the rows ``start`` ..
    ``start + len - 1``, times in ns from the run's ``t0_agent``, plus ``top1``
    (rows x batch size, int32: each sample's predicted class, -1 if none). The last
    message of a run has ``final`` and the run's totals; its ``seq`` + 1 is the
    number of messages the run sent (a gap means rows were lost).
    """

    kind: Literal["run_rows"] = "run_rows"
    evaluation_id: Ident
    seq: int = Field(ge=0)
    start: int = Field(ge=0)
    columns: dict[str, NDArray]
    errors: dict[int, str] = Field(default_factory=dict)
    """Row index -> error message, for rows that failed or were refused."""
    issued: int = 0
    """Queries issued so far (shipped or still in flight)."""
    final: bool = False
    queries: int = 0
    """final: rows in the run."""
    not_issued: int = 0
    cpu_s: float = 0.0
    """final: CPU time of the agent's process during the run (its load generator's and
    its model's: they share it)."""
    error: dict[str, Any] | None = None
    """final: the typed error that ended the run early, if one did."""


class SamplesReply(_Message):
    """What an evaluation's sample library holds after a load or unload."""

    kind: Literal["samples"] = "samples"
    held: int
    """Samples held now."""
    bytes: int
    """Memory they take (the agent's limit applies to all its libraries together)."""
    preprocessed: bool
    """Whether they are held pre-processed (queries then skip pre-processing)."""


class MLPerfStarted(_Message):
    """The agent started LoadGen for an :class:`MLPerfRunOp`."""

    kind: Literal["mlperf_started"] = "mlperf_started"
    pid: int


class MLPerfFile(_Message):
    """The answer to an :class:`MLPerfFetchOp`: ``data`` from ``offset`` of one file."""

    kind: Literal["mlperf_file"] = "mlperf_file"
    name: str
    offset: int = Field(ge=0)
    data: bytes


class MLPerfDone(_Message):
    """The end of an MLPerf run in the agent (on its rows subject): the files
    LoadGen's process left (its logs, and what its system under test saw:
    ``sut-timing.npz``) by name with their sizes, kept in the agent until the
    evaluation is released and fetched part by part (:class:`MLPerfFetchOp`:
    request/reply, so the server takes them at its own pace); ``error`` the typed
    error that ended the run, if one did."""

    kind: Literal["mlperf_done"] = "mlperf_done"
    evaluation_id: Ident
    files: dict[str, int] = Field(default_factory=dict)
    error: dict[str, Any] | None = None


ControlReply = (
    PingReply
    | AgentDescription
    | PrepareReply
    | ReleaseReply
    | RunStarted
    | SamplesReply
    | MLPerfStarted
    | MLPerfFile
)


class ErrorReply(_Message):
    """Any request's failure: ``error`` is ``MLScopeError.to_wire()`` (code, message,
    fields), rebuilt into the same typed exception by ``errors.error_from_wire``."""

    kind: Literal["error"] = "error"
    error: dict[str, Any]


# --------------------------------------------------------------------------- database


class SqlRequest(_Message):
    """One read-only statement for the server that owns the evaluation database.

    ``format="rows"``: the whole result as msgpack rows (:class:`SqlReply`);
    ``format="arrow"``: one page of it, rows ``offset`` onwards, at most ``limit`` and
    at most what fits one message, as Arrow IPC (:class:`SqlArrowReply`)."""

    kind: Literal["sql"] = "sql"
    sql: str = Field(max_length=1 << 20)
    parameters: dict[str, Any] | None = None
    format: Literal["rows", "arrow"] = "rows"
    offset: int = Field(default=0, ge=0, le=1 << 53)
    limit: int = Field(default=100_000, ge=1, le=1 << 31)


class SqlReply(_Message):
    kind: Literal["rows"] = "rows"
    columns: list[str]
    rows: list[list[Any]]


class SqlArrowReply(_Message):
    """One page of a result: an Arrow IPC stream of ``rows`` rows; ``more`` when rows
    may follow (ask again from ``offset + rows``)."""

    kind: Literal["arrow"] = "arrow"
    arrow: bytes
    rows: int = Field(ge=0)
    more: bool


class CancelRequest(_Message):
    """Stop a job (``mlscope.job.<job_id>.cancel``): the server running it cancels the
    run and stores it as ``cancelled``; a server that takes it later does not run it."""

    kind: Literal["cancel_request"] = "cancel_request"
    job_id: Ident
    reason: str = Field(default="cancelled by the user", max_length=1024)


class CancelReply(_Message):
    """From the server that was running the job, once its cancelled run is stored."""

    kind: Literal["cancel_reply"] = "cancel_reply"
    job_id: Ident
    evaluation_id: Ident
    server_id: Ident


class EvaluationRequest(_Message):
    kind: Literal["evaluation_request"] = "evaluation_request"
    evaluation_id: Ident


class EvaluationReply(_Message):
    kind: Literal["evaluation"] = "evaluation"
    spec: str
    summary: str


# --------------------------------------------------------------------------- queries


class Query(_Message):
    """One query: a batch of raw samples for one agent (hot path: kept small)."""

    kind: Literal["query"] = "query"
    evaluation_id: Ident
    index: QueryIndex
    inputs: NDArray
    trace_level: int = int(TraceLevel.MODEL)
    raw: bool = False
    """Also return the model's raw first output (accuracy and divergence runs only)."""
    labels: bool = False
    """Also return the labels of the classes the post-processing picked (top-k, argmax),
    when the model has a labels file; load runs leave it off."""
    more_inputs: tuple[NDArray, ...] = ()
    """A multi-input model's further inputs, in manifest order, each batched on its own
    ``batch_axis``; the agent fills those left out from the manifest's ``fill``."""


class SamplesQuery(_Message):
    """A query naming samples of the evaluation's sample library by data-set index
    (``mlscope.agent.<id>.samples``; MLPerf LoadGen's system under test): the agent
    answers with a :class:`QueryReply` as for a :class:`Query`."""

    kind: Literal["samples_query"] = "samples_query"
    evaluation_id: Ident
    index: QueryIndex
    samples: NDArray
    """Data-set indices (int64, one per sample), all loaded (:class:`SamplesLoadOp`)."""


class QueryReply(_Message):
    """The agent's answer, with its own monotonic timestamps (ns, agent clock)."""

    kind: Literal["reply"] = "reply"
    index: int
    ok: bool
    outputs: NDArray | None = None
    error: dict[str, Any] | None = None
    t_received: int = 0
    t_predict_start: int = 0
    t_predict_end: int = 0
    t_replied: int = 0
    raw_outputs: NDArray | None = None
    """The model's raw first output for this query's samples, when the query asked."""
    labels: NDArray | None = None
    """Unicode array shaped like ``outputs``: the label of each class index, when the
    query asked and the model has a labels file."""


# --------------------------------------------------------------------------- traces


class _ColumnBatch(_Message):
    """Rows of one evaluation from one agent, column by column (lists of one length)."""

    evaluation_id: Ident
    agent_id: Ident
    host: str
    batch_id: Ident
    columns: dict[str, list[Any]]
    dicts: dict[str, list[str]] = Field(default_factory=dict)
    """Dictionary-encoded string columns: a column named here holds, per row, the index
    of its value in this list (a layer's name and attributes repeat on every query, so
    a batch carries each distinct string once)."""

    def __len__(self) -> int:
        first = next(iter(self.columns.values()), [])
        return len(first)

    def values(self, name: str) -> list[Any]:
        """Column ``name`` with its values, dictionary-encoded or not (a reader's view;
        the ingester checks the indices before it trusts them)."""
        column = self.columns[name]
        words = self.dicts.get(name)
        return column if words is None else [words[int(i)] for i in column]


class SpanBatch(_ColumnBatch):
    """Many spans in one message, column by column (one list per field, same length).

    Columns: :data:`mlscope.schema.SPAN_FIELDS` (span_id, parent_id, query_index, level,
    kind, name, start_ns, end_ns, attrs as JSON text). Times are the agent's monotonic
    clock in ns and are stored so; readers put them on the load generator's clock with
    the evaluation's stored ``clock_offset_ns`` (``mlscope trace`` does).
    """

    kind: Literal["spans"] = "spans"


class SampleBatch(_ColumnBatch):
    """System samples of one evaluation, column by column (trace level ``system``+).

    Columns: :data:`mlscope.schema.SAMPLE_FIELDS`: ts_ns (agent monotonic clock, like
    spans), metric (``cpu.util``,
    ``proc.rss_bytes``, ``gpu.power_w``, ``perf.cycles`` ...), device (``all``,
    ``cpu3``, ``proc``, ``gpu0``), value (float). Published on the same stream as
    spans; the ingester stores them in ``system_samples``.
    """

    kind: Literal["samples"] = "samples"


# --------------------------------------------------------------- load-generator services


class LoadgenDescription(_Message):
    """A load-generator service's registry entry (bucket ``mlscope_loadgens``, kept
    alive by a heartbeat like an agent's)."""

    kind: Literal["loadgen"] = "loadgen"
    loadgen_id: str = Field(min_length=1, max_length=128)
    host: str
    pid: int = Field(ge=1, le=2**32 - 1)
    mlscope_version: str
    started_at: float = Field(ge=0, le=EPOCH_LIMIT_S, allow_inf_nan=False)
    heartbeat_at: float = Field(ge=0, le=EPOCH_LIMIT_S, allow_inf_nan=False)


class LoadgenLoadOp(_Message):
    """Fetch one dealt slice of a run from the work bucket and get ready to start it."""

    op: Literal["load"] = "load"
    run_id: Ident
    evaluation_id: Ident
    subject: Subject
    """Where the queries go (the prepared agent's query subject)."""
    spec: ScenarioSpec
    offset_ns: int
    """The agent's clock minus this load generator's (agent times are converted)."""
    trace_level: int
    has_labels: bool
    slice_object: str


class LoadgenLoaded(_Message):
    kind: Literal["loaded"] = "loaded"
    run_id: Ident
    queries: int


class LoadgenStopOp(_Message):
    """Stop a run of this service, loaded or running (its job was cancelled or failed):
    its queries stop at once, not at the end of its slice."""

    op: Literal["stop"] = "stop"
    run_id: Ident


class LoadgenStopped(_Message):
    kind: Literal["stopped"] = "stopped"
    run_id: Ident
    running: bool
    """The run was running (else it was only loaded, or not known here)."""


LoadgenControl = Annotated[PingOp | LoadgenLoadOp | LoadgenStopOp, Field(discriminator="op")]
"""What ``mlscope.loadgen.<id>.ctl`` takes (decode with ``LOADGEN_CONTROL``)."""
LOADGEN_CONTROL: TypeAdapter[PingOp | LoadgenLoadOp | LoadgenStopOp] = TypeAdapter(LoadgenControl)


class LoadgenStartOp(_Message):
    """Run a loaded slice from ``start_ns`` (this load generator's monotonic clock);
    answered when the run is over and its raw arrays are in the work bucket."""

    op: Literal["start"] = "start"
    run_id: Ident
    start_ns: int
    result_object: str
    progress_subject: Subject | None = None
    """Where to publish :class:`LoadgenProgress` about every half second while it runs:
    the service's own :func:`mlscope.names.loadgen_progress` subject, which its user may
    publish to (no one may publish into another's inbox)."""


class LoadgenProgress(_Message):
    kind: Literal["loadgen-progress"] = "loadgen-progress"
    run_id: Ident
    result_object: str
    """Which slice of the run (its result's name is unique per slice)."""
    done: int


class LoadgenDone(_Message):
    kind: Literal["loadgen-done"] = "loadgen-done"
    run_id: Ident
    result_object: str
    queries: int
    completed: int
    cpu_s: float
