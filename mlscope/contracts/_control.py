"""An agent's control requests (``mlscope.agent.<id>.ctl``) and their replies."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    TypeAdapter,
    field_validator,
    model_validator,
)

from mlscope.contracts._base import (
    MAX_BATCH,
    MAX_DURATION_S,
    MAX_ID_CHARS,
    MAX_RUNS,
    MAX_SAMPLE_INDICES,
    MAX_SCHEDULED_QUERIES,
    ClockNs,
    Ident,
    NDArray,
    Preprocess,
    TraceLevel,
    _Message,
)
from mlscope.contracts._jobs import MLPerfSpec, ScenarioSpec
from mlscope.contracts._registry import AgentDescription

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
    batch_size: int = Field(default=1, ge=1, le=MAX_BATCH)
    """Samples per query (a runtime that allocates its buffers once, such as XRT's,
    sizes them by it)."""
    max_batch: int | None = Field(default=None, ge=1, le=MAX_BATCH)
    trace_level: str = "model"
    reload: bool = False
    runs: int = Field(default=1, ge=1, le=MAX_RUNS)
    """The most runs the job makes (``ScenarioTraits.runs``: a sweep's points, a
    search's trials). Of more than one, each run ``k`` is traced under its own id
    (:func:`~mlscope.contracts.run_evaluation_id`, ``<evaluation_id>-<k>``): the agent
    takes a query or :class:`RunOp` naming ``<evaluation_id>-<k>`` for ``k`` below
    ``runs`` as one of this evaluation's, and refuses any other id."""

    @field_validator("trace_level")
    @classmethod
    def _level(cls, value: str) -> str:
        TraceLevel.parse(value)
        return value

    @model_validator(mode="after")
    def _run_ids_fit(self) -> PrepareOp:
        """Every run's id fits where an id goes (a query, a subject token)."""
        if self.runs > 1 and len(f"{self.evaluation_id}-{self.runs - 1}") > MAX_ID_CHARS:
            raise ValueError(f"the ids of {self.runs} runs are over {MAX_ID_CHARS} characters")
        return self


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
    run_id: Ident | None = None
    """Which of the evaluation's runs this is when it makes several
    (``<evaluation_id>-<k>``, :attr:`PrepareOp.runs`): the agent keeps the run's spans
    under it. None: the evaluation's one run, traced under ``evaluation_id``."""
    trace_level: str = "model"
    max_bytes: int = Field(default=1 << 20, ge=4096, le=64 << 20)
    """Largest message the agent may send back (the bus's max payload, less room for
    the subject and headers)."""

    @field_validator("trace_level")
    @classmethod
    def _level(cls, value: str) -> str:
        TraceLevel.parse(value)
        return value


SampleIndex = Annotated[int, Field(strict=True, ge=0, lt=2**63)]
"""A data-set index: the agent reads its samples with int64 indices."""


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


MAX_MLPERF_FILE_BYTES = 2 << 30
"""Largest file an agent's MLPerf run may leave. The server holds each file in memory
while it parses and stores it; the trace log is the large one, at ~270 bytes a sample
(Offline) to ~780 a query (Server): 2 GiB is ~8 M Offline samples or ~2.7 M Server
queries."""


class MLPerfFetchOp(_Message):
    """Part of a file an agent's MLPerf run left (named in its :class:`MLPerfDone`):
    at most ``max_bytes`` from ``offset``, answered with :class:`MLPerfFile`."""

    op: Literal["mlperf_fetch"] = "mlperf_fetch"
    evaluation_id: Ident
    name: str = Field(max_length=256)
    offset: int = Field(default=0, ge=0, le=MAX_MLPERF_FILE_BYTES)
    """Where to read from: within the largest file a run keeps (a seek past what a file
    offset holds failed the agent's handler)."""
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
    t_agent: ClockNs
    """The responder's ``perf_counter_ns`` (CLOCK_MONOTONIC) when it answered."""


class PrepareReply(_Message):
    kind: Literal["prepared"] = "prepared"
    ok: bool = True
    cold: bool = Field(strict=True)
    """Whether the model was loaded for this evaluation (a real bool: ``"no"`` is not
    read as one)."""
    load_ns: int = Field(ge=0)
    first_inference_ns: int = Field(ge=0)
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


ByteCount = Annotated[int, Field(ge=0, lt=2**63)]
"""A size in bytes a process reports of itself (its memory)."""
HostSeconds = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]
"""Seconds an agent reports of its host: finite, and within any run's reach."""


class ReleaseReply(_Message):
    kind: Literal["released"] = "released"
    ok: bool = True
    unloaded: bool = False
    rss_start_bytes: ByteCount | None = None
    """The agent process's resident memory when the evaluation was prepared."""
    rss_peak_bytes: ByteCount | None = None
    """The highest resident memory seen while it was prepared (sampled every 50 ms,
    plus the kernel's high-water mark where it rose meanwhile)."""
    rss_end_bytes: ByteCount | None = None
    """Resident memory at its release."""
    energy_j: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """Energy of the agent's device between prepare and release (NVML on a GPU, RAPL
    packages on the CPU); None when no counter was readable."""
    span_batches_refused: int = Field(default=0, ge=0, lt=2**63)
    """Span and sample batches of the evaluation the traces stream refused: the
    agent's trace budget (:data:`mlscope.provision.AGENT_TRACE_BATCHES` batches not
    yet stored) was full, so their rows are missing."""
    host_other_cpu_s: HostSeconds | None = None
    """CPU seconds every process on the agent's host but the agent used between
    prepare and release (:mod:`agent.hostload`); None where not readable."""
    host_steal_s: HostSeconds | None = None
    """CPU seconds the hypervisor took from the host's virtual CPUs meanwhile."""
    host_window_s: HostSeconds | None = None
    """Seconds from prepare to release, over which both were counted."""


class RunStarted(_Message):
    """The agent took a :class:`RunOp`: offset 0 of the run is ``t0_agent`` (its clock)."""

    kind: Literal["run_started"] = "run_started"
    t0_agent: ClockNs
    """The agent's monotonic clock, ns (stored as Int64)."""
    queries: int = Field(default=0, ge=0, le=MAX_SCHEDULED_QUERIES)
    """Queries the open-loop schedule holds (0 for a closed loop: not known ahead)."""
    preprocess: Preprocess = "timed"
    """When the run's samples are pre-processed (``ahead``: before ``t0_agent``)."""
    streamed: bool = False
    """The run is one stream on the model's predict thread: its answers are
    post-processed in blocks, each query's answer waiting for its block (a throughput
    run; ``agent.stream``)."""


ROWS_EVERY_S = 0.25
"""How often an agent ships a local run's finished rows (:class:`RunRows`); also its
sign of life, and what bounds how many messages a run can have lost by a time."""


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
    seq: int = Field(ge=0, le=MAX_SCHEDULED_QUERIES)
    start: int = Field(ge=0, le=MAX_SCHEDULED_QUERIES)
    columns: dict[str, NDArray]
    errors: dict[Annotated[int, Field(ge=0, lt=MAX_SCHEDULED_QUERIES)], str] = Field(
        default_factory=dict
    )
    """Row index -> error message, for rows that failed or were refused."""
    issued: int = Field(default=0, ge=0, le=MAX_SCHEDULED_QUERIES)
    """Queries issued so far (shipped or still in flight)."""
    final: bool = False
    queries: int = Field(default=0, ge=0, le=MAX_SCHEDULED_QUERIES)
    """final: rows in the run."""
    not_issued: int = Field(default=0, ge=0, le=MAX_SCHEDULED_QUERIES)
    time_up: int = Field(default=0, ge=0, le=2 * int(MAX_DURATION_S * 1e9))
    """final: a closed loop's :attr:`~mlscope.record.RunRecord.time_up_ns` (ns from
    ``t0_agent``; 0: it ended for another reason)."""
    process_cpu_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """final: CPU time (s) of the agent's process during the run: its model's, its load
    generator's and the agent's own work together."""
    loadgen_cpu_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """final: CPU time (s) of the load generator's own threads during the run (an open
    loop's: its pacer's thread and the one that runs it); None where its work is done
    on the model's predict thread (a closed loop, a stream) and cannot be told apart."""
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


MLPERF_FILE_NAMES = frozenset(
    (
        "mlperf_log_summary.txt",
        "mlperf_log_detail.txt",
        "mlperf_log_accuracy.json",
        "mlperf_log_trace.json",
        "sut-timing.npz",
    )
)
"""The files an agent's MLPerf run may leave for the server: LoadGen's four logs
(``broker.mlperf_logs.LOG_FILES``) and what its system under test saw
(``mlscope.mlperf.TIMING``)."""
MAX_MLPERF_FILES_BYTES = 3 << 30
"""Most bytes all the files of one agent's MLPerf run may take together."""


class MLPerfDone(_Message):
    """The end of an MLPerf run in the agent (on its rows subject): the files
    LoadGen's process left (its logs, and what its system under test saw:
    ``sut-timing.npz``) by name with their sizes, kept in the agent until the
    evaluation is released and fetched part by part (:class:`MLPerfFetchOp`:
    request/reply, so the server takes them at its own pace); ``error`` the typed
    error that ended the run, if one did. Only :data:`MLPERF_FILE_NAMES`, and sizes
    past :data:`MAX_MLPERF_FILE_BYTES` a file or :data:`MAX_MLPERF_FILES_BYTES` in all
    are refused, before the server fetches anything."""

    kind: Literal["mlperf_done"] = "mlperf_done"
    evaluation_id: Ident
    files: dict[str, Annotated[int, Field(ge=0, le=MAX_MLPERF_FILE_BYTES)]] = Field(
        default_factory=dict
    )
    error: dict[str, Any] | None = None

    @field_validator("files")
    @classmethod
    def _known(cls, files: dict[str, int]) -> dict[str, int]:
        unknown = sorted(set(files) - MLPERF_FILE_NAMES)
        if unknown:
            raise ValueError(f"files not of an MLPerf run: {[n[:64] for n in unknown[:5]]}")
        total = sum(files.values())
        if total > MAX_MLPERF_FILES_BYTES:
            raise ValueError(f"the files take {total:,} bytes, over {MAX_MLPERF_FILES_BYTES:,}")
        return files


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
