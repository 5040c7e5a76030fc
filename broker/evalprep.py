"""Before an evaluation's clock starts: intake's size check and the agent's prepare.

Intake refuses, before anything runs, a job whose one query would not fit through the
bus (its encoded size against the connection's max payload, for every batch size the
job uses). The evaluation id is derived from the job (one evaluation per job).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from broker.lgclock import estimate_offset
from mlscope import codec, names, samples, scenario_traits
from mlscope.bus import PAYLOAD_HEADROOM, Bus, request_model
from mlscope.catalog import Entry
from mlscope.contracts import (
    AgentDescription,
    JobRequest,
    PrepareOp,
    PrepareReply,
    Query,
    TraceLevel,
    evaluation_id_for,
)
from mlscope.errors import ConfigError
from mlscope.samples import dataset

__all__ = ["PREPARE_TIMEOUT_S", "Prepared", "check_query_size", "prepare_agent"]

PREPARE_TIMEOUT_S = 300.0
"""How long an agent has to answer a prepare (opening a model, MLPerf's sample library,
a cold start's reload): the one limit for every prepare a server sends."""


@dataclass(frozen=True)
class Prepared:
    """An evaluation's agent, prepared: what its runs and summaries need of it."""

    eval_id: str
    level: TraceLevel
    data: tuple[np.ndarray, np.ndarray] | None
    """The model's data set (inputs, labels), None for synthetic inputs."""
    prepare: dict[str, Any]
    prep: PrepareReply
    """The agent's prepare reply."""
    offset: int
    rtt: int


async def prepare_agent(
    bus: Bus, zoo_dir: Path, job: JobRequest, agent: AgentDescription, entry: Entry
) -> Prepared:
    """Intake's size check, the agent's prepare and its clock offset."""
    eval_id = evaluation_id_for(job.job_id)
    m, spec = entry.manifest, job.scenario
    level = TraceLevel.parse(job.trace_level)
    # Off the event loop: a data set is read from disk, and a query may be encoded.
    data = await anyio.to_thread.run_sync(dataset, entry, zoo_dir)
    if job.placement == "server" or job.accuracy:  # only these send queries over the bus
        await anyio.to_thread.run_sync(
            check_query_size, data, m.inputs[0].shape, spec, int(bus.nc.max_payload)
        )
    prepare = PrepareOp(
        evaluation_id=eval_id,
        model=m.name,
        model_version=m.version,
        batch_size=spec.batch_size,
        trace_level=level.name.lower(),
        runs=scenario_traits.get(spec.name).runs(spec),  # each traced under its own id
    ).dump()
    prep = await request_model(
        bus,
        names.agent_ctl(agent.agent_id),
        codec.encode(prepare),
        PrepareReply,
        timeout=PREPARE_TIMEOUT_S,
    )
    offset, rtt = await estimate_offset(bus, agent.agent_id)
    return Prepared(eval_id, level, data, prepare, prep, offset, rtt)


def check_query_size(
    data: tuple[np.ndarray, np.ndarray] | None, shape: tuple[int, ...], spec: Any, max_payload: int
) -> None:
    """Refuse a job whose query of its largest batch size is over the bus's max payload,
    naming the largest batch size that fits. A query whose raw inputs alone are over it
    is refused by arithmetic (a manifest's shape must not make the server build what it
    is about to refuse); one that may fit is measured on a real encoded query."""
    sizes = sorted({spec.batch_size, *(spec.batch_sizes or ())})
    limit = max_payload - PAYLOAD_HEADROOM
    row_bytes = (
        data[0][0].nbytes
        if data is not None and len(data[0])
        else math.prod(shape) * np.dtype(np.float32).itemsize
    )
    if sizes[-1] * row_bytes > limit:
        biggest, per_sample, at_least = sizes[-1] * row_bytes, row_bytes, "at least "
    else:

        def size(batch: int) -> int:
            inputs = samples.feeders(data, shape, batch, spec.seed)[0](0)
            query = Query(evaluation_id="ev-000000000000", index=0, inputs=inputs)
            return len(codec.encode_model(query))

        biggest, at_least = size(sizes[-1]), ""
        if biggest <= limit:
            return
        per_sample = size(1)
    fits = max(0, limit // max(1, per_sample))
    raise ConfigError(
        f"a query of batch size {sizes[-1]} is {at_least}{biggest} bytes, over the bus's max "
        f"payload of {max_payload} bytes; the largest batch size that fits is about {fits}",
        field="batch_size",
        batch_size=sizes[-1],
        bytes=biggest,
        max_payload=max_payload,
    )
