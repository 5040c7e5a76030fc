"""What every message shares: its schema number, ids, the limits it may carry, trace levels."""

from __future__ import annotations

import enum
import uuid
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
)

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
CURSOR_ID_CHARS = 32
CursorId = Annotated[
    str, Field(min_length=CURSOR_ID_CHARS, max_length=CURSOR_ID_CHARS, pattern=r"^[A-Za-z0-9_-]+$")
]
"""The id of a result held for paging: 24 random bytes, URL-safe base64 (unguessable;
anything else is refused before any lookup)."""
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
ClockNs = Annotated[int, Field(ge=0, lt=2**63)]
"""A reading of a process's monotonic clock (``perf_counter_ns``): ns since its host
booted, stored as Int64."""
MAX_CLOCK_OFFSET_NS = 2**62
"""The offset between two processes' clocks a measurement stays under (146 years):
both count ns since their host booted, so a real offset is within either host's
uptime. Under it, every time an offset moves stays an Int64, and so does the
difference of two offsets (a load-generator service's offset to the agent)."""
MAX_RUNS = 1000
"""Most runs one evaluation may make (a sweep's points, a search's trials: each run
``k`` of several is traced and stored under :func:`run_evaluation_id`)."""
MAX_SEED = 2**64 - 1
"""The largest seed: LoadGen's seeds are unsigned 64-bit, and so is the largest int a
message carries (msgpack); numpy's ``SeedSequence`` takes any of 0 .. MAX_SEED."""
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
"""A random seed (a job's ``--seed``): a whole number from 0 to :data:`MAX_SEED`."""
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


def run_evaluation_id(evaluation_id: str, k: int) -> str:
    """The id of run ``k`` (from 0) of an evaluation of several runs (a sweep's point, a
    search's trial): ``<evaluation_id>-<k>``. The run is stored as an evaluation of its
    own under it, and its queries name it, so that the agent keeps their spans under it
    (:attr:`PrepareOp.runs` says which runs an agent accepts)."""
    return f"{evaluation_id}-{k}"


def _ndarray(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    raise ValueError(f"expected a numpy array, got {type(value).__name__}")


NDArray = Annotated[np.ndarray, PlainValidator(_ndarray)]


def _batch(value: Any) -> np.ndarray:
    arr = _ndarray(value)
    if arr.ndim and arr.shape[0] > MAX_BATCH:
        raise ValueError(f"a query carries at most {MAX_BATCH} samples, not {arr.shape[0]}")
    return arr


BatchArray = Annotated[np.ndarray, PlainValidator(_batch)]
"""A query's samples: an array of at most :data:`MAX_BATCH` on its first axis. The
bytes of an array bound its shape only when it has elements: one with a zero-length
axis travels in a few bytes whatever its other axes say, and an agent allocates the
inputs a query leaves out (a manifest's ``fill``) for as many samples as it declares."""


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
