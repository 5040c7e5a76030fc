"""The server process: job intake, agent resolution, evaluations, ingest, DB queries.

One task group: the trace ingester, the job consumer (a durable pull consumer on the
JOBS work-queue stream, shared by every server replica), and the database
responder. While chDB is in use this process is the one that owns it; every other
process reaches the evaluation database through ``mlscope.db.*`` requests here.

A job is acknowledged only when its evaluation has finished (or failed for good); a
server that dies mid-job leaves it unacknowledged and JetStream redelivers it to the
next server after the job ack wait (``Settings.job_ack_wait_s``, 15 s by default).
While a job runs, the server reports progress to JetStream (``in_progress``, five
times per ack wait, kept up across reconnects) so that a long evaluation is not
redelivered. Exactly one evaluation per job: its id is derived from the job id; a
redelivered job whose evaluation is stored gets that stored result, one that this
server is still running is only held (acknowledged with the run), and one whose
first server was lost is run again with a ``restarted`` event to the submitter.

Cancelling: every server hears ``mlscope.job.*.cancel``. The one running the job
cancels the job's own cancel scope (the agent is released, shielded), stores the
evaluation with status ``cancelled`` (never VALID; its summary says after how many
queries; a sweep or search keeps each run it finished and the one in progress under
their own ids, :mod:`broker.cancel`) and replies; a job cancelled before any server
took it is remembered and, when taken, stored as cancelled without running.

What is done with a job once taken (an agent that answers, the run under its cancel
scope, a lost attempt forgotten, a stored result found) is :class:`Server`'s base,
:class:`broker.jobeval.JobEvaluation`.

Everything goes through the serving boundary (:mod:`mlscope.serving`): database
requests, the job consumer, and every long-lived loop (watches, ingester, history).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import TaskStatus
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from broker.agent_history import AgentHistory
from broker.cancel import Cancels
from broker.cursors import CursorLimits, Cursors
from broker.db import Database
from broker.dbresponder import DatabaseResponder
from broker.evaluate import Evaluator
from broker.ingest import Ingester
from broker.jobeval import JobEvaluation
from broker.lgwork import work_bucket
from broker.readonly import ReadLimits, ReadOnlyDatabase
from mlscope import bus as busmod
from mlscope import codec, names, scratch
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.consumers import durable_pull, keep_holding
from mlscope.contracts import (
    MAX_ID_CHARS,
    CancelReply,
    CancelRequest,
    JobEvent,
    JobRequest,
    evaluation_id_for,
    new_id,
)
from mlscope.errors import BusError, WireError
from mlscope.model_registry import ManifestWatcher
from mlscope.provision import provisioned
from mlscope.registry import AgentCache
from mlscope.serving import Boundary, delivered
from mlscope.settings import Settings
from mlscope.tuning import ProcessTuning

__all__ = ["Server"]

JOB_MAX_DELIVER = 5
log = logging.getLogger("mlscope.server")
MAX_PARALLEL_JOBS = 4


@dataclass
class Server(JobEvaluation):
    settings: Settings
    server_id: str = field(default_factory=lambda: new_id("srv"))
    max_parallel_jobs: int = MAX_PARALLEL_JOBS
    running: dict[str, list[Msg]] = field(default_factory=dict)
    """Job id -> every delivery of it while this server runs it (all acked at the end)."""
    cancels: Cancels = field(default_factory=Cancels)
    """Jobs running here under their cancel scopes, and the cancels heard."""
    read_limits: ReadLimits | None = None
    """What one client query on ``mlscope.db.sql`` may use (broker.readonly); default:
    the stock limits with the settings' ``sql_timeout_s``."""
    cursor_limits: CursorLimits = field(default_factory=CursorLimits)
    """How many results read in pages this server holds, and how long unread."""

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.catalog = Catalog.load(default_manifest_dirs(self.settings.manifests_dir))
        self.db = Database(self.settings.dsn)
        self.db.migrate()
        self.db.set_retention(self.settings.trace_retention_days)
        scratch.sweep()  # what killed processes left (an MLPerf test's logs)
        limits = self.read_limits or ReadLimits(max_execution_time_s=self.settings.sql_timeout_s)
        self.reader = ReadOnlyDatabase(
            self.settings.clickhouse_read_dsn or self.settings.dsn, limits
        )
        try:
            async with provisioned(self.settings, name=f"server {self.server_id}") as bus:
                self.bus = bus
                # Slices of distributed load outlive a node on a cluster as jobs do.
                await work_bucket(bus, replicas=self.settings.js_replicas)
                self.boundary = Boundary(bus, service=f"server {self.server_id}", logger=log)
                # One owner of what a run tunes process-wide (GC, switch interval, the
                # loop's priority): runs overlap, and the ingester waits out each load.
                tuning = ProcessTuning()
                self.evaluator = Evaluator(
                    bus,
                    self.db,
                    self.settings.zoo_dir,
                    tuning,
                    loadgen_ready_s=self.settings.loadgen_ready_s,
                )
                self.ingester = Ingester(bus, self.db, boundary=self.boundary, tuning=tuning)
                # Replicas share the database requests (a queue group): with a shared
                # ClickHouse server any of them answers; jobs come from one work queue.
                self.cursors = Cursors(self.cursor_limits)
                responder = DatabaseResponder(
                    bus, self.boundary, self.db, self.reader, self.cursors, self.server_id
                )
                subs = [
                    *await responder.subscribe(),
                    # No queue group: the replica running the job must hear it.
                    await self.boundary.subscribe(
                        names.job_cancel_wildcard(), CancelRequest, self._on_cancel
                    ),
                ]
                jobs = await self._job_consumer(bus)
                self.remote = ManifestWatcher(bus)
                self.agent_cache = AgentCache(bus)
                keep = self.boundary.keep_running
                async with anyio.create_task_group() as tg:
                    await tg.start(keep, "sql responder", responder.serve_sql)
                    await tg.start(keep, "models watch", self.remote.run)
                    tg.start_soon(keep, "agents watch", self.agent_cache.run)
                    tg.start_soon(keep, "trace ingester", self.ingester.run)
                    tg.start_soon(keep, "agent history", AgentHistory(bus, self.db).run)
                    tg.start_soon(keep, "cursor expiry", self.cursors.run)
                    tg.start_soon(
                        keep, "job consumer", functools.partial(self._take_jobs, jobs, tg)
                    )
                    log.info("server %s ready: taking jobs", self.server_id)
                    task_status.started()
                for sub in subs:
                    await sub.unsubscribe()
        finally:
            self.reader.close()
            self.db.close()

    # ------------------------------------------------------------------ jobs

    async def _job_consumer(self, bus: busmod.Bus) -> Any:
        """The servers' shared durable consumer of the job stream, set to this server's
        ack wait, and a pull subscription bound to it."""
        config = ConsumerConfig(
            filter_subject=names.JOBS_SUBJECT,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.settings.job_ack_wait_s,
            max_deliver=JOB_MAX_DELIVER,
        )
        return await durable_pull(bus, names.JOBS_STREAM, names.JOBS_CONSUMER, config)

    async def _take_jobs(self, sub: Any, tg: anyio.abc.TaskGroup) -> None:
        slots = anyio.Semaphore(self.max_parallel_jobs)
        while True:
            await slots.acquire()
            try:
                msg = await busmod.fetch_one(sub, 1.0)
            except BusError:
                msg = None  # cluster failover: the consumer's leader moves
                await anyio.sleep(0.5)
            if msg is None:
                slots.release()
                continue
            tg.start_soon(self._job, msg, slots)

    async def _job(self, msg: Msg, slots: anyio.Semaphore) -> None:
        try:
            await self.boundary.settle(
                msg, names.JOBS_STREAM, self._handle_job, max_deliver=JOB_MAX_DELIVER
            )
        finally:
            slots.release()

    async def _handle_job(self, msg: Msg) -> None:
        """One delivery of a job: run it once, whatever the deliveries."""
        try:
            job = codec.decode_model(JobRequest, msg.data)
        except WireError as exc:  # never runnable: tell a submitter we can name
            await self._refuse_undecodable(msg.data, exc)
            raise
        if job.job_id in self.running:  # redelivered while still running here
            log.info("job %s redelivered while it runs here: held, acked with the run", job.job_id)
            self.running[job.job_id].append(msg)
            return
        self.running[job.job_id] = [msg]
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._keep_alive, job.job_id)
                await self._run_job(job, restarted=delivered(msg) > 1)
                tg.cancel_scope.cancel()
        finally:
            msgs = self.running.pop(job.job_id, [])
            self.cancels.finish(job.job_id)  # a cancel waits for this
        for m in msgs:
            with anyio.move_on_after(5):
                try:
                    with busmod.bus_errors("ack"):
                        await m.ack()
                except BusError as exc:
                    log.warning(
                        "job %s: ack lost (%r); its evaluation is stored, a "
                        "redelivery gets the stored result",
                        job.job_id,
                        exc,
                    )

    async def _refuse_undecodable(self, data: bytes, exc: WireError) -> None:
        try:
            raw = codec.decode(data)
        except WireError:
            return
        job_id = raw.get("job_id") if isinstance(raw, dict) else None
        if isinstance(job_id, str) and 0 < len(job_id) <= MAX_ID_CHARS:
            await self._emit(
                names.job_events(job_id),
                JobEvent(
                    job_id=job_id, event="failed", server_id=self.server_id, error=exc.to_wire()
                ),
            )

    async def _keep_alive(self, job_id: str) -> None:
        """The job's lease on every delivery of it."""
        await keep_holding(lambda: self.running.get(job_id, []), self.settings.job_ack_wait_s)

    async def _run_job(self, job: JobRequest, *, restarted: bool = False) -> None:
        subject = names.job_events(job.job_id)
        await self._emit(
            subject, JobEvent(job_id=job.job_id, event="accepted", server_id=self.server_id)
        )
        try:
            # (An MLPerf import finds an earlier import of its logs itself: broker.mlperf.)
            stored = await self._stored(evaluation_id_for(job.job_id))
            if stored is not None:  # its first run finished; only the ack was lost
                await self._emit(
                    subject, JobEvent.ended(stored, server_id=self.server_id, job_id=job.job_id)
                )
                return
            if restarted:
                await self._emit(
                    subject,
                    JobEvent(
                        job_id=job.job_id,
                        event="restarted",
                        server_id=self.server_id,
                        note="job was restarted after server loss",
                    ),
                )
                await self._forget_attempt(evaluation_id_for(job.job_id))
            summary = await self._evaluate_cancellable(job, subject)
        except Exception as exc:  # every failure ends the job with its reason
            err = self.boundary.failed(exc, job.job_id, what="job")  # "job ID refused: why"
            await self._emit(
                subject,
                JobEvent(
                    job_id=job.job_id, event="failed", server_id=self.server_id, error=err.to_wire()
                ),
            )
            return
        # An import of logs stored before answers with that evaluation (another job's).
        await self._emit(
            subject, JobEvent.ended(summary, server_id=self.server_id, job_id=job.job_id)
        )

    # ------------------------------------------------------------------ cancel

    async def _on_cancel(self, req: CancelRequest, msg: Msg) -> CancelReply | None:
        """Cancel the job if it runs here (reply once its cancelled run is stored);
        otherwise remember it, unanswered, for a server that takes it later."""
        ended = self.cancels.request(req.job_id, req.reason, taken=req.job_id in self.running)
        if ended is None:
            await self._remember_cancel(req)
            return None
        log.info("job %s: cancel requested (%s)", req.job_id, req.reason)
        with anyio.move_on_after(10):
            await ended.wait()
        return CancelReply(
            job_id=req.job_id,
            evaluation_id=evaluation_id_for(req.job_id),
            server_id=self.server_id,
        )
