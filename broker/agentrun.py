"""A run whose load is generated in the agent (``placement: agent``), seen from the server.

::

    server                                        agent (agent/localrun.py)
      ctl RunOp {scenario}, reply inbox ────────► schedule, sample order, pacer: local
      ◄──────────────────── RunStarted {t0_agent}
      on mlscope.agent.<id>.rows.<evaluation>:
      ◄── RunRows (columns, every 0.25 s) ─────── rows done so far
      ◄── RunRows final {queries, not_issued,  ─── the rest, and the totals
                        time_up, loadgen_cpu_s,
                        process_cpu_s}

Rows travel on the agent's own rows subject, not as answers to the run request: on a
bus with credentials a responder may answer only for a while after a request
(``allow_responses``), and a run lasts as long as it lasts. The server subscribes
before it sends the request, so no row is missed.

Each message's rows are checked and copied into the run's record by
:class:`broker.agentrows.RowCollector`. The server fills the same
:class:`mlscope.record.RunRecord` a server-placed run fills:
the agent's times are ns from its ``t0``, and ``t0`` is mapped onto the server's clock
with the offset measured by ping (``rec.t0_ns = t0_agent - offset``), so stored rows,
spans and the trace timeline line up as for any run. The server scores each query's
top-1 against its own labels (the same seeded order, :mod:`mlscope.samples`) and judges
the run with the same code (:func:`broker.summary.judge`). The final rows' CPU times
go into the record as well: the load generator's own threads' as ``cpu_s`` (what a
server-placed run's load generator reports, read by the summary's ``loadgen_cost`` the
same way) and the agent process's as ``process_cpu_s`` (:mod:`agent.localcpu`).

An agent that goes silent is pinged; if it does not answer, or another process now
answers under its id (:func:`gone`), the rows it shipped are kept and the run gets the
reason "agent <id> lost after N of M queries" ("(it restarted)" for the latter); rows
it had not shipped are not stored (their times never left the agent).

A cancelled job (:mod:`broker.cancel`) releases the agent's evaluation at once, which
stops the run there; the agent then ships its final rows, every query it issued (one
still in flight without its completion), and those are what the cancelled run stores.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import anyio
from nats.aio.msg import Msg

from broker import lgclock
from broker.agentrows import START_TIMEOUT_S, Labels, RowCollector
from mlscope import codec, names
from mlscope.bus import Bus, answerable, bus_errors, next_msg, request
from mlscope.contracts import (
    MAX_SCHEDULED_QUERIES,
    AgentDescription,
    PingOp,
    ReleaseOp,
    RunOp,
    RunRows,
    RunStarted,
    ScenarioSpec,
    TraceLevel,
)
from mlscope.errors import BusError, MLScopeError, error_from_wire
from mlscope.record import RunRecord
from mlscope.registry import list_agents

__all__ = ["IDLE_S", "Absence", "drive", "gone"]

log = logging.getLogger("mlscope.server")

IDLE_S = 3.0
"""Silence (no rows) after which the server pings the agent: it ships every
:data:`~mlscope.contracts.ROWS_EVERY_S`."""
CANCEL_ROWS_WAIT_S = 5.0
"""How long a cancelled run waits for the agent's final rows."""
ROWS_PENDING_BYTES = 512 << 20
"""Rows messages the server may hold unread for one run: a fast run ships tens of MB
each :data:`~mlscope.contracts.ROWS_EVERY_S`, and nats-py drops what comes past a
subscription's limit (64 MB by default); a message lost so shows as a gap in ``seq``."""
DRAIN_S = 10.0
"""How long a run's queries may take to drain once its load has ended (the agent's own
drain timeout)."""
END_SLACK_S = 60.0
"""Beyond the run's load and drain, how long a live agent is awaited."""


async def drive(
    bus: Bus,
    *,
    agent: AgentDescription,
    evaluation_id: str,
    spec: ScenarioSpec,
    load_s: float,
    trace_level: TraceLevel,
    offset_ns: int,
    labels: Labels,
    on_progress: Callable[[RunRecord, float], Awaitable[Any]] | None = None,
    run_id: str | None = None,
) -> tuple[RunRecord, tuple[str, ...]]:
    """Have the agent run ``spec`` for ``evaluation_id`` (``run_id``: which of its
    runs, when it makes several: the agent keeps the run's spans under it); the filled
    record and any reasons it is INVALID. ``load_s``: how long the run's load lasts
    (an open loop's schedule window: a replay's or a ramp's own, not ``duration_s``),
    after which, with its drain and :data:`END_SLACK_S`, the agent is given up."""
    agent_id = agent.agent_id
    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox)
    rows_sub = await bus.nc.subscribe(
        names.agent_rows(agent_id, evaluation_id), pending_bytes_limit=ROWS_PENDING_BYTES
    )
    try:
        op = RunOp(
            evaluation_id=evaluation_id,
            run_id=run_id,
            scenario=spec,
            trace_level=trace_level.name.lower(),
            max_bytes=bus.payload_budget(),
        )
        asked = lgclock.now()
        await bus.nc.publish(names.agent_ctl(agent_id), codec.encode_model(op), reply=inbox)
        started = await _started(sub, agent_id)
        rec = RunRecord(n=max(started.queries, 1), batch_size=spec.batch_size)
        rec.t0_ns = _t0(started, offset_ns, asked, agent_id)
        rec.preprocessed = started.preprocess == "ahead"
        rec.streamed = started.streamed
        most = started.queries or spec.max_queries or MAX_SCHEDULED_QUERIES
        collector = RowCollector(
            rec, labels, agent, max_bytes=op.max_bytes, most=min(most, MAX_SCHEDULED_QUERIES)
        )
        limit = load_s + DRAIN_S + END_SLACK_S
        try:
            reasons = await _collect(collector, bus, rows_sub, limit, on_progress)
        except anyio.get_cancelled_exc_class():  # the job is cancelled: keep what ran
            with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_ROWS_WAIT_S):
                await _stopped(collector, bus, evaluation_id, rows_sub, on_progress)
            raise
    finally:
        for s in (sub, rows_sub):
            await s.unsubscribe()
    return collector.rec, reasons


async def _started(sub: Any, agent_id: str) -> RunStarted:
    """The agent's answer to the run request (its typed error raised)."""
    msg = await next_msg(sub, START_TIMEOUT_S)
    if msg is None:
        raise BusError(
            f"agent {agent_id} did not start the local run within {START_TIMEOUT_S:.0f} s",
            agent_id=agent_id,
        )
    data = codec.decode(msg.data)
    if isinstance(data, dict) and data.get("kind") == "error":
        raise error_from_wire(data["error"])
    return codec.validate(RunStarted, data)


def _t0(started: RunStarted, offset_ns: int, asked_ns: int, agent_id: str) -> int:
    """The run's offset 0 on our clock. The agent starts its run as it answers (50 ms
    ahead), so its ``t0_agent`` falls between the request and the answer, give or take
    the start timeout (a WireError naming the agent otherwise)."""
    return lgclock.on_our_clock(
        started.t0_agent,
        offset_ns,
        since_ns=asked_ns,
        slack_s=START_TIMEOUT_S,
        what=f"agent {agent_id} started its run",
        agent_id=agent_id,
    )


async def _collect(
    c: RowCollector,
    bus: Bus,
    sub: Any,
    limit_s: float,
    on_progress: Callable[[RunRecord, float], Awaitable[Any]] | None,
) -> tuple[str, ...]:
    """Add the run's row messages from ``sub`` to ``c`` until the final one (reporting
    progress every 0.5 s); the reasons the run is INVALID: its own, the agent's loss
    (silent, or restarted under its id), or ``limit_s`` passed without a final one."""
    began = time.monotonic()
    shown = 0.0
    while True:
        # The deadline holds whether the agent is silent or not: one that keeps
        # sending rows and never a final one is given up all the same.
        if time.monotonic() - began > limit_s:
            c.end(c.rows)
            return (
                f"agent {c.agent_id} did not finish its local run within "
                f"{limit_s:.0f} s (answered {c.answered()} of {c.issued} queries)",
            )
        msg = await next_msg(sub, IDLE_S)
        if msg is None:
            if absence := await gone(bus, c.agent):
                return (c.lost(restarted=absence == "restarted"),)
            continue
        rows = codec.decode_model(RunRows, msg.data)
        c.add(rows)
        await _read(bus, msg)
        if on_progress is not None and time.monotonic() - shown > 0.5:
            shown = time.monotonic()
            await on_progress(c.rec, shown - began)
        if rows.final:
            return c.finish(rows)


async def _stopped(
    c: RowCollector,
    bus: Bus,
    evaluation_id: str,
    sub: Any,
    on_progress: Callable[[RunRecord, float], Awaitable[Any]] | None,
) -> None:
    """The run is cancelled here: release the agent's evaluation, which stops its
    run and ships its final rows (every query it issued, those still in flight
    included), and add them; then report the record (what a cancelled job
    stores). Only the rows shipped so far when the agent does not answer. The
    rows are the answer, so the release asks for no reply; the evaluator's own
    release on its way out then finds the session ended."""
    began = time.monotonic()
    release = codec.encode_model(ReleaseOp(evaluation_id=evaluation_id))
    await bus.nc.publish(names.agent_ctl(c.agent_id), release)
    try:
        while (msg := await next_msg(sub, CANCEL_ROWS_WAIT_S)) is not None:
            rows = codec.decode_model(RunRows, msg.data)
            c.add(rows)
            await _read(bus, msg)
            if rows.final:
                c.finish(rows)
                break
    except MLScopeError as exc:  # bad rows: the cancel goes on with those added
        log.warning("agent %s: cancelled run's final rows: %s", c.agent_id, exc)
    if on_progress is not None:
        with contextlib.suppress(MLScopeError):
            await on_progress(c.rec, time.monotonic() - began)


async def _read(bus: Bus, msg: Msg) -> None:
    """Tell the agent that a rows message that asks (a reply subject) is read: it waits
    for that before it sends more (``agent.runrows.ACK_EVERY_BYTES``), so its rows
    never pile up unread past nats-server's max pending for this connection."""
    if answerable(msg.reply):  # an agent's rows asking for an answer elsewhere get none
        with contextlib.suppress(BusError), bus_errors("rows read, not said"):
            await bus.nc.publish(msg.reply, b"")


Absence = Literal["", "silent", "restarted"]
"""Why the agent process given a run is gone (:func:`gone`); "" while it is there."""


async def gone(bus: Bus, agent: AgentDescription) -> Absence:
    """Whether the agent process that was given a run is gone: ``"silent"`` when its id
    answers no ping within 2 s; ``"restarted"`` when it answers but its registry entry
    names another process (pid or start time differ: an agent restarted under its id
    knows nothing of the lost one's run, and would answer pings until a deadline);
    ``""`` while it is there, or while the registry cannot tell."""
    try:
        await request(
            bus, names.agent_ctl(agent.agent_id), codec.encode_model(PingOp()), timeout=2.0
        )
    except MLScopeError:
        return "silent"
    try:
        now = {a.agent_id: a for a in await list_agents(bus)}.get(agent.agent_id)
    except MLScopeError:
        return ""
    if now is not None and (now.pid, now.started_at) != (agent.pid, agent.started_at):
        return "restarted"
    return ""
