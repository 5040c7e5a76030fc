"""Every message that crosses the bus: one frozen pydantic model per kind.

Import every message from this package (``from mlscope.contracts import JobRequest``);
its private modules only group them by conversation: ``_base`` (schema number, ids,
limits, trace levels), ``_registry`` (an agent's entry), ``_jobs`` (a job and its
scenario), ``_results`` (the summary and job events), ``_control`` (an agent's control
requests and replies), ``_server`` (requests the server answers), ``_queries``,
``_traces`` (span and sample batches) and ``_loadgen`` (load-generator services).

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
               the replies); SqlRequest.format and page_rows, SqlArrowReply (Arrow IPC
               pages of one execution's result) and its cursor, SqlPageRequest,
               SqlCloseRequest / SqlCloseReply; the
               agent's sample library and MLPerf LoadGen in the agent
               (``SamplesLoadOp``, ``SamplesUnloadOp``,
               ``SamplesReply``, ``SamplesQuery``, ``MLPerfRunOp``, ``MLPerfStarted``,
               ``MLPerfDone``, ``MLPerfFetchOp``, ``MLPerfFile``; AgentDescription
               feature ``mlperf-loadgen``); AgentDescription.refused_more, and
               AgentDescription.refused lists at most ``MAX_REFUSALS`` models;
               ReleaseReply.span_batches_refused; PrepareOp.runs and RunOp.run_id,
               and a Query's ``evaluation_id`` may name one of its evaluation's runs
               (``<evaluation_id>-<k>``).
"""

from __future__ import annotations

from mlscope.contracts._base import (
    CURSOR_ID_CHARS,
    LOCAL_RUN,
    MAX_BATCH,
    MAX_CLOCK_OFFSET_NS,
    MAX_CONCURRENCY,
    MAX_DURATION_S,
    MAX_ID_CHARS,
    MAX_LOADGENS,
    MAX_QPS,
    MAX_RUNS,
    MAX_SAMPLE_INDICES,
    MAX_SCHEDULED_QUERIES,
    MAX_SEGMENTS,
    MLPERF_LOADGEN,
    QUERY_INDEX_LIMIT,
    SCHEMA,
    ClockNs,
    CursorId,
    Ident,
    NDArray,
    Placement,
    Preprocess,
    QueryIndex,
    Subject,
    TraceLevel,
    evaluation_id_for,
    new_id,
    run_evaluation_id,
)
from mlscope.contracts._control import (
    CONTROL,
    MAX_MLPERF_FILE_BYTES,
    MAX_MLPERF_FILES_BYTES,
    MLPERF_FILE_NAMES,
    ROWS_EVERY_S,
    ControlOp,
    ControlReply,
    ControlRequest,
    DescribeOp,
    ErrorReply,
    MLPerfDone,
    MLPerfFetchOp,
    MLPerfFile,
    MLPerfRunOp,
    MLPerfStarted,
    PingOp,
    PingReply,
    PrepareOp,
    PrepareReply,
    ReleaseOp,
    ReleaseReply,
    RunOp,
    RunRows,
    RunStarted,
    SamplesLoadOp,
    SamplesReply,
    SamplesUnloadOp,
)
from mlscope.contracts._jobs import (
    IMPORT_ID_HEX,
    IMPORT_IDENTITY_LOGS,
    JobRequest,
    MLPerfImport,
    MLPerfSpec,
    ScenarioName,
    ScenarioSpec,
    SystemRequirement,
    mlperf_run_identity,
)
from mlscope.contracts._loadgen import (
    LOADGEN_CONTROL,
    LoadgenDescription,
    LoadgenDone,
    LoadgenLoaded,
    LoadgenLoadOp,
    LoadgenProgress,
    LoadgenStartOp,
    LoadgenStopOp,
    LoadgenStopped,
)
from mlscope.contracts._queries import (
    Query,
    QueryReply,
    SamplesQuery,
)
from mlscope.contracts._registry import (
    EPOCH_LIMIT_S,
    MAX_REFUSALS,
    REFUSAL_MESSAGE_MAX_CHARS,
    Accelerator,
    AgentDescription,
    FrameworkInfo,
    ModelOffer,
    RefusalReason,
    RefusedModel,
)
from mlscope.contracts._results import (
    EvaluationSummary,
    JobEvent,
    LatencyStats,
)
from mlscope.contracts._server import (
    CancelReply,
    CancelRequest,
    EvaluationReply,
    EvaluationRequest,
    SqlArrowReply,
    SqlCloseReply,
    SqlCloseRequest,
    SqlPageRequest,
    SqlReply,
    SqlRequest,
)
from mlscope.contracts._traces import (
    SampleBatch,
    SpanBatch,
)

__all__ = [
    "CONTROL",
    "CURSOR_ID_CHARS",
    "EPOCH_LIMIT_S",
    "IMPORT_IDENTITY_LOGS",
    "IMPORT_ID_HEX",
    "LOADGEN_CONTROL",
    "LOCAL_RUN",
    "MAX_BATCH",
    "MAX_CLOCK_OFFSET_NS",
    "MAX_CONCURRENCY",
    "MAX_DURATION_S",
    "MAX_ID_CHARS",
    "MAX_LOADGENS",
    "MAX_MLPERF_FILES_BYTES",
    "MAX_MLPERF_FILE_BYTES",
    "MAX_QPS",
    "MAX_REFUSALS",
    "MAX_RUNS",
    "MAX_SAMPLE_INDICES",
    "MAX_SCHEDULED_QUERIES",
    "MAX_SEGMENTS",
    "MLPERF_FILE_NAMES",
    "MLPERF_LOADGEN",
    "QUERY_INDEX_LIMIT",
    "REFUSAL_MESSAGE_MAX_CHARS",
    "ROWS_EVERY_S",
    "SCHEMA",
    "Accelerator",
    "AgentDescription",
    "CancelReply",
    "CancelRequest",
    "ClockNs",
    "ControlOp",
    "ControlReply",
    "ControlRequest",
    "CursorId",
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
    "NDArray",
    "PingOp",
    "PingReply",
    "Placement",
    "PrepareOp",
    "PrepareReply",
    "Preprocess",
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
    "SqlCloseReply",
    "SqlCloseRequest",
    "SqlPageRequest",
    "SqlReply",
    "SqlRequest",
    "Subject",
    "SystemRequirement",
    "TraceLevel",
    "evaluation_id_for",
    "mlperf_run_identity",
    "new_id",
    "run_evaluation_id",
]
