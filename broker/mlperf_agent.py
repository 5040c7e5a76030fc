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
does not answer fails the run, as does one that has not ended it within
:data:`RUN_LIMIT_S` (whatever else it sends meanwhile). What the agent says it left is
bounded by :class:`~mlscope.contracts.MLPerfDone` (known names, bytes a file and in
all) before anything is fetched, no part may run past the size it claimed, and
``sut-timing.npz`` is read only once its arrays' headers are what a run writes
(:func:`mlscope.mlperf.load_timing`). The agent drops the files when the evaluation is
released.
"""

from __future__ import annotations

import io
import time
from typing import Any

from broker.agentrun import gone
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
from mlscope.mlperf import TIMING, load_timing

__all__ = ["FETCH_LIMIT_S", "IDLE_S", "RUN_LIMIT_S", "run_in_agent"]

IDLE_S = 3.0
"""Silence after which the server pings the agent (the run sends nothing until it ends)."""
RUN_LIMIT_S = 6 * 3600.0
"""The longest an agent's LoadGen run is awaited (an official run lasts >= 10 min)."""
FETCH_LIMIT_S = 1800.0
"""The longest the files of one run may take to arrive (their 3 GiB limit at ~2 MB/s):
an agent answering each part in tiny pieces must not hold the evaluation forever."""
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
        done = await _wait_done(bus, sub, agent)
    finally:
        await sub.unsubscribe()
    if done.error is not None:
        raise error_from_wire(done.error)
    if TIMING not in done.files:
        raise EvaluationError(f"the agent's LoadGen run left no {TIMING}")
    deadline = time.monotonic() + FETCH_LIMIT_S
    got = {
        name: await _fetch(bus, ctl, evaluation_id, (name, size), deadline)
        for name, size in done.files.items()
    }
    timing = load_timing(io.BytesIO(got.pop(TIMING)))
    files = {name: data.decode(errors="replace") for name, data in got.items()}
    return timing, files


async def _fetch(
    bus: Bus, ctl: str, evaluation_id: str, file: tuple[str, int], deadline: float
) -> bytes:
    """One file of the agent's run (its name and claimed size), part by part (each part
    one request); a part that is not the one asked for, or runs past the claimed
    size, fails the run."""
    name, size = file
    chunks: list[bytes] = []
    offset = 0
    limit = bus.payload_budget()
    while offset < size:
        if time.monotonic() > deadline:
            raise EvaluationError(
                f"the agent's files did not arrive within {FETCH_LIMIT_S:.0f} s",
                evaluation_id=evaluation_id,
            )
        op = MLPerfFetchOp(evaluation_id=evaluation_id, name=name, offset=offset, max_bytes=limit)
        reply = await request(bus, ctl, codec.encode_model(op), timeout=FETCH_TIMEOUT_S)
        part = codec.validate(MLPerfFile, reply)
        if not part.data or part.name != name or part.offset != offset:
            raise EvaluationError(
                f"the agent's {name} ended at {offset} of {size} bytes", evaluation_id=evaluation_id
            )
        if offset + len(part.data) > size:
            raise EvaluationError(
                f"the agent's {name} runs past the {size} bytes it claimed",
                evaluation_id=evaluation_id,
            )
        chunks.append(part.data)
        offset += len(part.data)
    return b"".join(chunks)


async def _wait_done(bus: Bus, sub: Any, agent: AgentDescription) -> MLPerfDone:
    """The run's end, pinging the agent while it is silent (given up when it is gone:
    :func:`broker.agentrun.gone`); given up after :data:`RUN_LIMIT_S`, checked on every
    message (an agent that sends anything but the end must not be awaited forever)."""
    agent_id = agent.agent_id
    deadline = time.monotonic() + RUN_LIMIT_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise EvaluationError(
                f"agent {agent_id} did not finish its LoadGen run within {RUN_LIMIT_S:.0f} s",
                agent_id=agent_id,
            )
        msg = await next_msg(sub, min(IDLE_S, left))
        if msg is None:
            if absence := await gone(bus, agent):
                restarted = " (it restarted)" if absence == "restarted" else ""
                raise EvaluationError(
                    f"agent {agent_id} was lost during its MLPerf LoadGen run{restarted}",
                    agent_id=agent_id,
                )
            continue
        data = codec.decode(msg.data)
        if isinstance(data, dict) and data.get("kind") == "mlperf_done":
            return codec.validate(MLPerfDone, data)
