"""A job: the model, framework and scenario a user asks to evaluate."""

from __future__ import annotations

import hashlib
import math
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from mlscope import scenario_traits
from mlscope.contracts._base import (
    MAX_BATCH,
    MAX_CONCURRENCY,
    MAX_DURATION_S,
    MAX_LOADGENS,
    MAX_QPS,
    MAX_SCHEDULED_QUERIES,
    MAX_SEGMENTS,
    Ident,
    Placement,
    Preprocess,
    Seed,
    TraceLevel,
    _Message,
    evaluation_id_for,
    new_id,
)
from mlscope.errors import ConfigError
from mlscope.hashing import tree_sha256
from mlscope.versions import parse_constraint


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
    seed: Seed = 0
    max_queries: int | None = Field(default=None, ge=1)
    min_duration_s: float | None = Field(default=None, ge=0, le=MAX_DURATION_S)
    min_queries: int | None = Field(default=None, ge=1)
    max_outstanding: int = Field(default=1024, ge=1, le=MAX_CONCURRENCY)
    warmup_queries: int = Field(default=0, ge=0)
    concurrency: int = Field(default=1, ge=1, le=MAX_CONCURRENCY)
    """Closed loops: queries kept in flight."""
    latency_bound_ms: float | None = Field(default=None, gt=0, le=MAX_DURATION_S * 1e3)
    """Bound on the p99 latency (online, peak): a run over it is INVALID. At most the
    longest run: the verdict holds it in whole nanoseconds (an infinite one cannot be)."""
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
    max_issue_lag_us: float | None = Field(default=None, gt=0, le=MAX_DURATION_S * 1e6)
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
    seed: Seed | None = None
    """LoadGen's sample, sample-index and schedule seeds (default: the conf files')."""


IMPORT_IDENTITY_LOGS = ("mlperf_log_summary.txt", "mlperf_log_detail.txt")
"""The logs that are an imported MLPerf run's identity (:meth:`MLPerfImport.identity`):
the two every import carries (``broker.mlperf_logs.REQUIRED``)."""


def mlperf_run_identity(files: dict[str, str]) -> str:
    """What an MLPerf run is, from its log files (name -> text): the sha256 of its
    summary and detail logs (:data:`IMPORT_IDENTITY_LOGS`), each by its own sha256 and
    name (:func:`mlscope.hashing.tree_sha256`). The one definition both an import
    (:meth:`MLPerfImport.identity`) and a run of ``mlscope mlperf``, which stores it
    with its logs, are found by: the logs of a run imported later are that run."""
    return tree_sha256(
        (name, hashlib.sha256(files.get(name, "").encode()).hexdigest())
        for name in sorted(IMPORT_IDENTITY_LOGS)
    )


IMPORT_ID_HEX = 16
"""Hex digits of the identity in an imported run's evaluation id (64 bits; the server
checks the whole digest stored with the run, so a shorter match is never taken)."""


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

    def identity(self) -> str:
        """What the imported run is: the sha256 of its summary and detail logs' text
        (:func:`mlscope.hashing.tree_sha256` of each one's sha256, by name: a directory
        holding just these two files hashes the same), the one definition the server
        stores and finds an import by (``broker.mlperf``). The same logs imported
        again, from any path, at any time, by any job, are the same run; one changed
        character in either is another.

        Left out, on purpose:

        * where the logs were read (``source``) and when: a copy of a results tree, or
          the same tree imported again after a run was added, holds the same runs;
        * the trace and accuracy logs: by-products of the run the two logs already name
          (the detail log records its settings, start time and every result), which
          are routinely left out or rewritten after it -- the importer drops them to fit
          a job, ``enable_trace`` is off in most runs, and MLPerf's submission tooling
          truncates the accuracy log and deletes the trace -- so counting them would
          make one run two evaluations whenever a copy ships other by-products;
        * model, framework and system: labels given to the run (from the results tree or
          flags), not what it measured; no two runs share a detail log, so leaving them
          out never merges two runs, while counting them would store one run once per
          label. The labels (and by-products) kept are the first import's.

        The text is what the importer read (``mlscope import mlperf`` decodes with
        universal newlines and U+FFFD for a byte that is not UTF-8)."""
        return mlperf_run_identity(self.files)

    def evaluation_id(self) -> str:
        """The evaluation these logs are stored as: ``ev-`` and the first
        :data:`IMPORT_ID_HEX` hex digits of :meth:`identity`."""
        return f"ev-{self.identity()[:IMPORT_ID_HEX]}"


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

    def evaluation_id(self) -> str:
        """The evaluation this job stores: an MLPerf import's is its logs'
        (:meth:`MLPerfImport.evaluation_id`: the same logs imported again are the
        evaluation stored the first time); any other job's is derived from its id
        (:func:`~mlscope.contracts.evaluation_id_for`: a redelivered job finds its own)."""
        if self.mlperf_import is not None:
            return self.mlperf_import.evaluation_id()
        return evaluation_id_for(self.job_id)

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
