"""The server process: job intake, agent resolution, evaluations, ingest, DB queries.

One task group: the trace ingester, the job consumer (a durable pull consumer on the
JOBS work-queue stream, shared by every server replica), and the database
responder. While chDB is in use this process is the one that owns it; every other
process reaches the evaluation database through ``mlscope.db.*`` requests here.

A job is acknowledged only when its evaluation has finished (or failed for good); a
server that dies mid-job leaves it unacknowledged and JetStream redelivers it to the
next server after ``JOB_ACK_WAIT_S``. While a job runs, the server reports progress
to JetStream (``in_progress``) so that a long evaluation is not redelivered.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import nats.errors
from anyio.abc import TaskStatus
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from broker.agent_history import AgentHistory
from broker.db import Database
from broker.evaluate import RESOLVE_GRACE_S, Evaluator, recently_alive, resolve
from broker.ingest import Ingester
from broker.loadgen import RunRecord, running_p50_ms
from broker.readonly import ReadLimits, ReadOnlyDatabase
from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.catalog import Catalog, Entry, default_manifest_dirs
from mlscope.contracts import AgentDescription, JobEvent, JobRequest, new_id
from mlscope.errors import DatabaseError, MLScopeError, ResolutionError, WireError
from mlscope.model_registry import ManifestWatcher
from mlscope.registry import AgentCache, list_agents
from mlscope.settings import Settings

__all__ = ["Server"]

JOB_ACK_WAIT_S = 15.0
MAX_PARALLEL_JOBS = 4
DB_QUEUE = "mlscope-servers"
SQL_IN_FLIGHT = 16
"""Client SQL requests handled at once (they wait for the read pool's connections);
more stay queued in the subscription."""


@dataclass
class Server:
    settings: Settings
    server_id: str = field(default_factory=lambda: new_id("srv"))
    max_parallel_jobs: int = MAX_PARALLEL_JOBS
    read_limits: ReadLimits | None = None
    """What one client query on ``mlscope.db.sql`` may use (broker.readonly); default:
    the stock limits with the settings' ``sql_timeout_s``."""

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.catalog = Catalog.load(default_manifest_dirs(self.settings.manifests_dir))
        self.db = Database(self.settings.dsn)
        self.db.migrate()
        self.db.set_retention(self.settings.trace_retention_days)
        self.reader = ReadOnlyDatabase(self.settings.dsn, self.read_limits or ReadLimits(
            max_execution_time_s=self.settings.sql_timeout_s))
        try:
            async with busmod.connect(self.settings, name=f"server {self.server_id}",
                                      provision=True) as bus:
                self.bus = bus
                self.evaluator = Evaluator(bus, self.db, self.settings.zoo_dir)
                self.ingester = Ingester(bus, self.db)
                # Replicas share the database requests (a queue group): with a shared
                # ClickHouse server any of them answers; jobs come from one work queue.
                subs = [await bus.nc.subscribe(names.EVALUATION_SUBJECT, queue=DB_QUEUE,
                                               cb=self._on_eval)]
                jobs = await bus.js.pull_subscribe(
                    names.JOBS_SUBJECT, durable=names.JOBS_CONSUMER, stream=names.JOBS_STREAM,
                    config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT,
                                          ack_wait=JOB_ACK_WAIT_S, max_deliver=5))
                self.remote = ManifestWatcher(bus)
                self.agent_cache = AgentCache(bus)
                async with anyio.create_task_group() as tg:
                    await tg.start(self._serve_sql)
                    await tg.start(self.remote.run)
                    tg.start_soon(self.agent_cache.run)
                    tg.start_soon(self.ingester.run)
                    tg.start_soon(AgentHistory(bus, self.db).run)
                    tg.start_soon(self._take_jobs, jobs, tg)
                    task_status.started()
                for sub in subs:
                    await sub.unsubscribe()
        finally:
            self.reader.close()
            self.db.close()

    # ------------------------------------------------------------------ jobs

    async def _take_jobs(self, sub: Any, tg: anyio.abc.TaskGroup) -> None:
        slots = anyio.Semaphore(self.max_parallel_jobs)
        while True:
            await slots.acquire()
            try:
                msgs = await sub.fetch(1, timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                slots.release()
                continue
            except nats.errors.Error:
                slots.release()  # cluster failover: the consumer's leader moves
                await anyio.sleep(0.5)
                continue
            tg.start_soon(self._job, msgs[0], slots)

    async def _job(self, msg: Msg, slots: anyio.Semaphore) -> None:
        try:
            try:
                job = codec.decode_model(JobRequest, msg.data)
            except WireError:
                await msg.term()  # cannot be answered (no job id) nor ever run
                return
            async with anyio.create_task_group() as tg:
                tg.start_soon(_keep_alive, msg)
                await self._run_job(job)
                tg.cancel_scope.cancel()
            await msg.ack()
        finally:
            slots.release()

    async def _run_job(self, job: JobRequest) -> None:
        subject = names.job_events(job.job_id)
        await self._emit(subject, JobEvent(job_id=job.job_id, event="accepted",
                                           server_id=self.server_id))
        try:
            agent, entry = await self._resolve(job)

            async def progress(eval_id: str, rec: RunRecord, elapsed: float) -> None:
                await self._emit(subject, JobEvent(
                    job_id=job.job_id, event="progress", server_id=self.server_id,
                    evaluation_id=eval_id, queries_done=rec.done, elapsed_s=elapsed,
                    p50_ms=running_p50_ms(rec)))

            summary = await self.evaluator.run(job, agent, entry, progress)
        except MLScopeError as exc:
            await self._emit(subject, JobEvent(job_id=job.job_id, event="failed",
                                               server_id=self.server_id, error=exc.to_wire()))
            return
        await self._emit(subject, JobEvent(job_id=job.job_id, event="done",
                                           server_id=self.server_id,
                                           evaluation_id=summary.evaluation_id,
                                           summary=summary))

    async def _resolve(self, job: JobRequest) -> tuple[AgentDescription, Entry]:
        """From the watched registry (no round trip); a miss is checked against a
        fresh read of the bucket, and waited out for up to ``RESOLVE_GRACE_S`` while a
        matching agent heartbeated moments ago (a failover delays heartbeats)."""
        catalog = self.remote.catalog(self.catalog)
        deadline = time.monotonic() + RESOLVE_GRACE_S
        while True:
            if self.agent_cache.ready.is_set():
                try:
                    return resolve(job, self.agent_cache.agents(), catalog)
                except ResolutionError:
                    pass
            try:
                return resolve(job, await list_agents(self.bus), catalog)
            except ResolutionError:
                seen = self.agent_cache.agents(include_stale=True)
                if time.monotonic() >= deadline or not recently_alive(
                        job, seen, catalog, now=time.time()):
                    raise
            await anyio.sleep(0.5)

    async def _emit(self, subject: str, event: JobEvent) -> None:
        await self.bus.nc.publish(subject, codec.encode_model(event))

    # ------------------------------------------------------------------ database

    async def _serve_sql(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                         ) -> None:
        """Answer client SQL concurrently: a subscription callback runs one message at
        a time, and one slow query would make every other client wait for it."""
        sub = await self.bus.nc.subscribe(names.SQL_SUBJECT, queue=DB_QUEUE)
        slots = anyio.Semaphore(SQL_IN_FLIGHT)
        try:
            async with anyio.create_task_group() as tg:
                task_status.started()
                async for msg in sub.messages:
                    await slots.acquire()
                    tg.start_soon(self._answer_sql, msg, slots)
        finally:
            with anyio.CancelScope(shield=True):
                await sub.unsubscribe()

    async def _answer_sql(self, msg: Msg, slots: anyio.Semaphore) -> None:
        try:
            await self._on_sql(msg)
        finally:
            slots.release()

    async def _on_sql(self, msg: Msg) -> None:
        """Client SQL for other processes: {sql, parameters} -> {columns, rows}, run on
        the read-only, limited connections (broker.readonly), never the writer's."""
        try:
            req = codec.decode(msg.data)
            if not isinstance(req, dict):
                raise WireError("a SQL request is a mapping {sql, parameters}")
            frame = await anyio.to_thread.run_sync(self.reader.frame, req.get("sql"),
                                                   req.get("parameters"))
            rows = [[_plain(v) for v in row] for row in frame.itertuples(index=False)]
            await msg.respond(codec.encode({"columns": list(frame.columns), "rows": rows}))
        except MLScopeError as exc:
            await msg.respond(busmod.error_reply(exc))

    async def _on_eval(self, msg: Msg) -> None:
        try:
            req = codec.decode(msg.data)
            eval_id = str(req.get("evaluation_id")) if isinstance(req, dict) else ""
            rows = await anyio.to_thread.run_sync(
                self.db.rows, "SELECT spec, summary FROM evaluations FINAL "
                "WHERE evaluation_id = {id:String}", {"id": eval_id})
            if not rows:
                raise DatabaseError(f"no evaluation {eval_id!r}", evaluation_id=eval_id)
            await msg.respond(codec.encode({"spec": rows[0][0], "summary": rows[0][1]}))
        except MLScopeError as exc:
            await msg.respond(busmod.error_reply(exc))


async def _keep_alive(msg: Msg) -> None:
    while True:
        await anyio.sleep(JOB_ACK_WAIT_S / 3)
        await msg.in_progress()


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)

