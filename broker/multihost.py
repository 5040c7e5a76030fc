"""Distributed load over load-generator services on any host (``loadgen_hosts``).

The server side of ``mlscope-submit --loadgen-hosts a,b``: one seeded global schedule
dealt round-robin (query ``i`` to service ``i % K``, :func:`mlscope.schedule.deal`) to
registered load-generator services (``mlscope loadgen``, :mod:`broker.lgservice`),
which may run on other machines::

    server                                    load generator j (any host)
      │ registry: every named service live?
      │ ping ×9 on its ctl subject ─────────► PingReply (its monotonic clock)
      │   → offset_j = its clock − ours (min RTT, error ≤ RTT/2)
      │ slice j (offsets, global indices, encoded queries, labels)
      │   ─► object store mlscope_loadgen_work ──► fetched on "load"
      │ ctl load ───────────────────────────► LoadgenLoaded
      │ run start (start_ns + offset_j) ────► pacer + Driver, queries to the agent
      │ ◄──────── LoadgenProgress (every 0.5 s: queries completed, summed into events)
      │ ◄─────────────── LoadgenDone (result .npz in the work bucket)
      └ merge by global index (:func:`broker.lgresults.merge_results`) → one record

Clocks: processes on one host share CLOCK_MONOTONIC; across hosts they do not, so
each service's clock is tied to the server's by the NTP-style ping estimate (the same
one that ties the agent's), and the shared start is sent in each service's own
clock. The merged record is on the server's clock (t0 = the start), agent times on
each service's (its offset to the agent is the agent's offset minus its own).
Payloads are built by the server from the one sample order (:mod:`mlscope.samples`),
so a service needs no model, data set or catalog.

This module owns one run end to end: dealing, loading, the merged record, and what a
cancelled run keeps. The work bucket and the slice format are :mod:`broker.lgwork`'s;
the requests to the services (find, start and watch, stop) are :mod:`broker.lgcontrol`'s.
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
from nats.js.object_store import ObjectStore

from broker.distributed import START_LEAD_S
from broker.lgclock import estimate_offset
from broker.lgcontrol import STOP_ANSWER_S, live_services, start_all, stop_runs
from broker.lgresults import load_result, merge_results, until_first_stop
from broker.lgwork import pack_slice, result_name, work_bucket
from broker.loadgen import encode_query
from mlscope import codec, names, schedule
from mlscope.bus import bus_errors, request
from mlscope.contracts import (
    LoadgenDescription,
    LoadgenDone,
    LoadgenLoadOp,
    LoadgenStopOp,
    LoadgenStopped,
    ScenarioSpec,
    new_id,
)
from mlscope.errors import BusError, ConfigError, MLScopeError, WireError
from mlscope.record import RunRecord
from mlscope.schedule import Schedule

if TYPE_CHECKING:
    from broker.context import Context

__all__ = ["STOP_WAIT_S", "run_on_services"]

log = logging.getLogger("mlscope.multihost")

LOAD_TIMEOUT_S = 120.0
STOP_WAIT_S = STOP_ANSWER_S + 5.0
"""The most a stopped run's server spends on it: the stop, reading what its services
kept, deleting the run's objects."""


async def run_on_services(
    ctx: Context,
    spec: ScenarioSpec,
    sched: Schedule,
    inputs: Callable[[int], np.ndarray],
    labels: Callable[[int], np.ndarray] | None,
) -> RunRecord:
    """Run ``sched`` dealt to the services ``spec.loadgen_hosts``; the merged record,
    with ``record.sources`` saying which service ran which slice."""
    if not spec.loadgen_hosts:
        raise ConfigError("a run over load-generator services needs loadgen_hosts")
    bus = ctx.bus
    services = await live_services(bus, spec.loadgen_hosts)
    parts = schedule.deal(sched, len(services))
    run_id = new_id("lr")
    obs = await work_bucket(bus)
    offsets = [
        (await estimate_offset(bus, s.loadgen_id, subject=names.loadgen_ctl(s.loadgen_id)))[0]
        for s in services
    ]
    objects: list[str] = []
    finished = cancelled = False
    start: int | None = None
    try:
        for j, (svc, part) in enumerate(zip(services, parts, strict=True)):
            slice_ = _Slice(run_id, j, part, ctx.offset_ns - offsets[j])
            objects.append(await _load(ctx, spec, obs, svc, slice_, inputs, labels))
        start = time.perf_counter_ns() + int(START_LEAD_S * 1e9)
        done = await start_all(ctx, spec, services, offsets, run_id, start)
        objects += [d.result_object for d in done]
        read = [
            _as_reported(await _read_result(obs, d.result_object, len(p)), d, svc)
            for d, p, svc in zip(done, parts, services, strict=True)
        ]
        finished = True
    except anyio.get_cancelled_exc_class():
        cancelled = True
        raise
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(STOP_WAIT_S):
            if not finished:  # cancelled or failed: no service goes on sending queries
                stopped = await stop_runs(bus, services, LoadgenStopOp(run_id=run_id))
                results = [result_name(run_id, j) for j in range(len(parts))]
                if cancelled and start is not None:
                    where = _Where(services, offsets, start)
                    await _keep_stopped(ctx, spec, obs, parts, stopped, results, where)
                objects += results
            for name in objects:  # one left behind expires with the bucket's TTL
                with contextlib.suppress(BusError), bus_errors(f"cannot delete {name}"):
                    await obs.delete(name)
    rec = merge_results(parts, read)
    rec.t0_ns = start  # the shared start, on this server's clock
    rec.sources = _Where(services, offsets, start).sources(read)
    return rec


@dataclass(frozen=True)
class _Where:
    """Where a run's slices ran: the services, their clocks, the shared start."""

    services: list[LoadgenDescription]
    offsets: list[int]
    """Each service's clock minus this server's."""
    start: int
    """The shared start, on this server's clock."""

    def sources(self, read: list[tuple[RunRecord, dict[int, str]]]) -> tuple[dict[str, Any], ...]:
        """``RunRecord.sources``: which service ran which slice, with the counts and
        the CPU time its result holds."""
        return tuple(
            {
                "loadgen_id": svc.loadgen_id,
                "host": svc.host,
                "pid": svc.pid,
                "slice": j,
                "queries": rec.n,
                "completed": int(np.count_nonzero(rec.completed)),
                "cpu_s": rec.cpu_s,
                "clock_offset_ns": self.offsets[j],
            }
            for j, (svc, (rec, _)) in enumerate(zip(self.services, read, strict=True))
        )


def _as_reported(
    got: tuple[RunRecord, dict[int, str]], d: LoadgenDone, svc: LoadgenDescription
) -> tuple[RunRecord, dict[int, str]]:
    """A slice's result once the service's :class:`LoadgenDone` tells the same story:
    its queries, the queries completed and the CPU time are the result's own. A service
    whose answer and arrays disagree is a WireError naming it (which of the two is
    false cannot be told, and the summary would show the other)."""
    rec = got[0]
    held = (rec.n, int(np.count_nonzero(rec.completed)), rec.cpu_s)
    if (d.queries, d.completed, d.cpu_s) != held:
        raise WireError(
            f"load-generator service {svc.loadgen_id} reported {d.queries} queries, "
            f"{d.completed} completed, {d.cpu_s:.6g} s CPU; its result "
            f"{d.result_object} holds {held[0]}, {held[1]}, {held[2]:.6g} s",
            loadgen_id=svc.loadgen_id,
        )
    return got


@dataclass(frozen=True)
class _Slice:
    run_id: str
    j: int
    part: Schedule
    agent_offset_ns: int
    """The agent's clock minus the service's."""


async def _load(
    ctx: Context,
    spec: ScenarioSpec,
    obs: ObjectStore,
    svc: LoadgenDescription,
    sl: _Slice,
    inputs: Callable[[int], np.ndarray],
    labels: Callable[[int], np.ndarray] | None,
) -> str:
    """Build one slice's queries, put them in the work bucket and have ``svc`` load
    them; the object's name."""
    glob = sl.part.index.tolist()
    payloads = [encode_query(ctx.query_id, g, inputs(g), ctx.trace_level) for g in glob]
    lab = np.stack([labels(g) for g in glob]) if labels is not None and glob else None
    name = f"{sl.run_id}/slice-{sl.j}"
    with bus_errors(f"cannot put {name}"):
        await obs.put(name, pack_slice(sl.part, payloads, lab))
    load = LoadgenLoadOp(
        run_id=sl.run_id,
        evaluation_id=ctx.evaluation_id,
        subject=ctx.subject,
        spec=spec,
        offset_ns=sl.agent_offset_ns,
        trace_level=int(ctx.trace_level),
        has_labels=lab is not None,
        slice_object=name,
    )
    await request(
        ctx.bus, names.loadgen_ctl(svc.loadgen_id), codec.encode_model(load), timeout=LOAD_TIMEOUT_S
    )
    return name


async def _keep_stopped(
    ctx: Context,
    spec: ScenarioSpec,
    obs: ObjectStore,
    parts: list[Schedule],
    stopped: list[LoadgenStopped | None],
    results: list[str],
    where: _Where,
) -> None:
    """A cancelled run's merged record of what its services had issued, reported as its
    progress: the rows its evaluation stores (:func:`broker.cancel.issued_part`), with
    the CPU time each service's load used up to its stop (its result's ``cpu_s``) and
    ``sources`` as a finished run has them. Only when every service kept its slice's;
    else the run keeps none (no rows, no CPU time), as before a service kept any."""
    kept = {name for s in stopped if s is not None for name in s.kept}
    if ctx.on_progress is None or not set(results) <= kept:
        return
    try:
        got = [
            await _read_result(obs, name, len(part))
            for name, part in zip(results, parts, strict=True)
        ]
    except MLScopeError as exc:
        log.warning("%s: the stopped slices' rows not read: %s", ctx.evaluation_id, exc)
        return
    rec = until_first_stop(merge_results(parts, got), parts)
    rec.t0_ns = where.start
    rec.sources = where.sources(got)
    rec.warmup = min(spec.warmup_queries, rec.n)
    await ctx.on_progress(rec, (time.perf_counter_ns() - where.start) / 1e9)


async def _read_result(
    obs: ObjectStore, name: str, queries: int
) -> tuple[RunRecord, dict[int, str]]:
    """A slice's result as its service put it (shapes checked before anything is read)."""
    with bus_errors(f"cannot read {name}"):
        got = await obs.get(name)
    return await anyio.to_thread.run_sync(load_result, io.BytesIO(got.data or b""), queries)
