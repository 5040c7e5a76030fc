"""A load-generator service's registry entry, control requests and replies."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    Field,
    TypeAdapter,
    model_validator,
)

from mlscope.contracts._base import (
    MAX_CLOCK_OFFSET_NS,
    MAX_SCHEDULED_QUERIES,
    ClockNs,
    Ident,
    Subject,
    TraceLevel,
    _Message,
)
from mlscope.contracts._control import PingOp
from mlscope.contracts._jobs import ScenarioSpec
from mlscope.contracts._registry import EPOCH_LIMIT_S


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
    offset_ns: int = Field(gt=-2 * MAX_CLOCK_OFFSET_NS, lt=2 * MAX_CLOCK_OFFSET_NS)
    """The agent's clock minus this load generator's (agent times are converted): the
    difference of the two offsets the server measured, each under
    :data:`MAX_CLOCK_OFFSET_NS`."""
    trace_level: int = Field(ge=TraceLevel.NONE, le=TraceLevel.FULL)
    has_labels: bool
    slice_object: Ident


class LoadgenLoaded(_Message):
    kind: Literal["loaded"] = "loaded"
    run_id: Ident
    queries: int = Field(ge=0, le=MAX_SCHEDULED_QUERIES)


class LoadgenStopOp(_Message):
    """Stop runs of this service, loaded or running, at once rather than at the end of
    their slices: one run (``run_id``: its job was cancelled or failed), or every run of
    an evaluation (``evaluation_id``: a restarted job's server stops what its lost
    attempt left running before it runs the job again)."""

    op: Literal["stop"] = "stop"
    run_id: Ident | None = None
    evaluation_id: Ident | None = None

    @model_validator(mode="after")
    def _names_one(self) -> LoadgenStopOp:
        if (self.run_id is None) == (self.evaluation_id is None):
            raise ValueError("a stop names either a run_id or an evaluation_id")
        return self


class LoadgenStopped(_Message):
    kind: Literal["stopped"] = "stopped"
    run_ids: list[Ident]
    """The runs let go, loaded or running."""
    running: bool
    """One of them was running (else they were only loaded, or none was known here)."""
    kept: list[str] = Field(default_factory=list)
    """The result objects in which stopped running runs put what they had issued (the
    rows of a cancelled evaluation); empty from a service that keeps none."""


LoadgenControl = Annotated[PingOp | LoadgenLoadOp | LoadgenStopOp, Field(discriminator="op")]
"""What ``mlscope.loadgen.<id>.ctl`` takes (decode with ``LOADGEN_CONTROL``)."""
LOADGEN_CONTROL: TypeAdapter[PingOp | LoadgenLoadOp | LoadgenStopOp] = TypeAdapter(LoadgenControl)


class LoadgenStartOp(_Message):
    """Run a loaded slice from ``start_ns`` (this load generator's monotonic clock);
    answered when the run is over and its raw arrays are in the work bucket."""

    op: Literal["start"] = "start"
    run_id: Ident
    start_ns: ClockNs
    result_object: Ident
    progress_subject: Subject | None = None
    """Where to publish :class:`LoadgenProgress` about every half second while it runs:
    the service's own :func:`mlscope.names.loadgen_progress` subject, which its user may
    publish to (no one may publish into another's inbox)."""


class LoadgenProgress(_Message):
    kind: Literal["loadgen-progress"] = "loadgen-progress"
    run_id: Ident
    result_object: Ident
    """Which slice of the run (its result's name is unique per slice)."""
    done: int = Field(ge=0, le=MAX_SCHEDULED_QUERIES)
    """Queries of the slice completed so far."""


class LoadgenDone(_Message):
    kind: Literal["loadgen-done"] = "loadgen-done"
    run_id: Ident
    result_object: Ident
    queries: int = Field(ge=0, le=MAX_SCHEDULED_QUERIES)
    completed: int = Field(ge=0, le=MAX_SCHEDULED_QUERIES)
    cpu_s: float = Field(ge=0, allow_inf_nan=False)
