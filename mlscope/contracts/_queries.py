"""One query and its answer on an agent's query subject."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from mlscope.contracts._base import (
    BatchArray,
    Ident,
    NDArray,
    QueryIndex,
    TraceLevel,
    _Message,
)


class Query(_Message):
    """One query: a batch of raw samples for one agent (hot path: kept small)."""

    kind: Literal["query"] = "query"
    evaluation_id: Ident
    """The prepared evaluation, or the run of it the query belongs to when it makes
    several (``<evaluation_id>-<k>``, :attr:`PrepareOp.runs`): the agent keeps the
    query's spans under the id named here."""
    index: QueryIndex
    inputs: BatchArray
    trace_level: int = Field(default=int(TraceLevel.MODEL), ge=TraceLevel.NONE, le=TraceLevel.FULL)
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
