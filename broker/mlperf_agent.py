"""An MLPerf LoadGen run in the agent's host (``mlscope mlperf --placement agent``),
seen from the server.

::

    server                                         agent (agent/mlperf_ops.py)
      ctl MLPerfRunOp {spec} ────────────────────► LoadGen in a child process, the model
      ◄─────────────────────── MLPerfStarted {pid}  in that process (agent/mlperf_local.py)
      ◄── MLPerfDone {files: sizes, error} ─────── the end, on the agent's own subject
                                                    mlscope.agent.<id>.rows.<eval_id> (a
                                                    run may outlast the reply window);
                                                    logs + sut-timing.npz kept
      ctl MLPerfFetchOp {name, offset} ──────────► (request/reply, part by part)
      ◄──────────────────── MLPerfFile {data}

The files are what the server's own LoadGen process leaves (:mod:`broker.mlperf_sut`),
so :mod:`broker.mlperf` parses and stores them with the same code; only the clock
differs: the SUT's times are on the agent's clock (see :func:`broker.mlperf.run`).
They are fetched by request/reply, one part at a time, because a trace log can be
hundreds of MB (an Offline run of ~330 bytes per sample): pushed in a burst, a
subscriber falls behind and nats-server drops messages (measured: 114 of 220 lost).
While the run is silent the server pings the agent every :data:`IDLE_S`: an agent that
does not answer fails the run. The agent drops the files when the evaluation is
released.
"""

from __future__ import annotations

import io
import time
from typing import Any

import numpy as np

from broker.agentrun import alive
from mlscope import codec, names
from mlscope.bus import Bus, next_msg, request
from mlscope.contracts import (
    AgentDescription,
    MLPerfDone,
    MLPerfFetchOp,
    MLPerfFile,
    MLPerfRunOp,
    MLPerfSpec,
)
from mlscope.errors import EvaluationError, error_from_wire
from mlscope.mlperf import TIMING

__all__ = ["IDLE_S", "RUN_LIMIT_S", "run_in_agent"]

IDLE_S = 3.0
"""Silence after which the server pings the agent (the run sends nothing until it ends)."""
RUN_LIMIT_S = 6 * 3600.0
"""The longest an agent's LoadGen run is awaited (an official run lasts >= 10 min)."""
START_TIMEOUT_S = 30.0
FETCH_TIMEOUT_S = 30.0


async def run_in_agent(
    bus: Bus, spec: MLPerfSpec, conf_model: str, evaluation_id: str, agent: AgentDescription
) -> tuple[dict[str, Any], dict[str, str]]:
    """Have the agent run the test; what its SUT saw and LoadGen's log files."""
    ctl = names.agent_ctl(agent.agent_id)
    sub = await bus.nc.subscribe(names.agent_rows(agent.agent_id, evaluation_id))
    try:
        op = MLPerfRunOp(evaluation_id=evaluation_id, spec=spec, conf_model=conf_model)
        await request(bus, ctl, codec.encode_model(op), timeout=START_TIMEOUT_S)
        done = await _wait_done(bus, sub, agent.agent_id)
    finally:
        await sub.unsubscribe()
    if done.error is not None:
        raise error_from_wire(done.error)
    if TIMING not in done.files:
        raise EvaluationError(f"the agent's LoadGen run left no {TIMING}")
    got = {
        name: await _fetch(bus, ctl, evaluation_id, name, size) for name, size in done.files.items()
    }
    with np.load(io.BytesIO(got.pop(TIMING))) as z:
        timing = {k: z[k] for k in z.files}
    files = {name: data.decode(errors="replace") for name, data in got.items()}
    return timing, files


async def _fetch(bus: Bus, ctl: str, evaluation_id: str, name: str, size: int) -> bytes:
    """One file of the agent's run, part by part (each part one request)."""
    chunks: list[bytes] = []
    offset = 0
    limit = bus.payload_budget()
    while offset < size:
        op = MLPerfFetchOp(evaluation_id=evaluation_id, name=name, offset=offset, max_bytes=limit)
        part = MLPerfFile.model_validate(
            await request(bus, ctl, codec.encode_model(op), timeout=FETCH_TIMEOUT_S)
        )
        if not part.data:
            raise EvaluationError(
                f"the agent's {name} ended at {offset} of {size} bytes", evaluation_id=evaluation_id
            )
        chunks.append(part.data)
        offset += len(part.data)
    return b"".join(chunks)


async def _wait_done(bus: Bus, sub: Any, agent_id: str) -> MLPerfDone:
    """The run's end, pinging the agent while it is silent."""
    began = time.monotonic()
    while True:
        msg = await next_msg(sub, IDLE_S)
        if msg is None:
            if not await alive(bus, agent_id):
                raise EvaluationError(
                    f"agent {agent_id} was lost during its MLPerf LoadGen run", agent_id=agent_id
                )
            if time.monotonic() - began > RUN_LIMIT_S:
                raise EvaluationError(
                    f"agent {agent_id} did not finish its LoadGen run within {RUN_LIMIT_S:.0f} s",
                    agent_id=agent_id,
                )
            continue
        data = codec.decode(msg.data)
        if isinstance(data, dict) and data.get("kind") == "mlperf_done":
            return MLPerfDone.model_validate(data)
