"""Failure behaviour: ingester restarts, poison span batches, malformed messages, no server,
busy servers, a failed job's agent session, SIGTERM during a load."""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from broker.db import Database
from broker.ingest import Ingester
from broker.server import MAX_PARALLEL_JOBS
from mlscope import bus as busmod
from mlscope import codec, names, remote
from mlscope.contracts import (
    JobEvent,
    JobRequest,
    Query,
    ReleaseOp,
    ScenarioSpec,
    evaluation_id_for,
)
from mlscope.errors import (
    BusError,
    EvaluationError,
    EvaluationNotFound,
    MLScopeError,
    WireError,
    error_from_wire,
)
from mlscope.jobs import stored_result, submit, submit_on
from mlscope.provision import provisioned
from mlscope.serving import dead_letters
from mlscope.settings import Settings
from tests.conftest import (
    agent_and_server,
    child_env,
    python,
    server_in_process,
    wait_agents,
    wait_server,
)
from tests.stored_rows import span_batch

pytestmark = pytest.mark.timeout(240)


def test_ingester_killed_mid_stream_loses_and_duplicates_nothing(
    settings: Settings, tmp_path: Path
) -> None:
    with Database(f"chdb:///{tmp_path / 'db'}") as db:
        db.migrate()
        # No background merge may fold the duplicates away: the raw count must show them.
        db.command("SYSTEM STOP MERGES spans")
        ingester_killed_mid_stream(settings, db)


def ingester_killed_mid_stream(settings: Settings, db: Database) -> None:
    eval_id = "ev-resilience"
    per, batches = 200, 60
    ingesters: list[Ingester] = []

    async def main() -> None:
        async with provisioned(settings, name="test") as bus:

            async def publish(first: int, last: int) -> None:
                for b in range(first, last):
                    await bus.js.publish(
                        names.traces(eval_id, "a1"),
                        codec.encode_model(span_batch(eval_id, b * per, per)),
                    )

            # 1) An ingester that inserts but dies before acknowledging (crash window).
            crashing = Ingester(bus, db, ack_wait_s=1.0)
            ingesters.append(crashing)

            async def no_ack(msgs: list[Msg]) -> None:  # insert, then "crash" before any ack
                original = [m.ack for m in msgs]
                for m in msgs:
                    m.ack = _noop  # type: ignore[method-assign]
                await Ingester._store(crashing, msgs)
                del original

            crashing._store = no_ack  # type: ignore[method-assign]
            await publish(0, 20)
            with anyio.move_on_after(1.5):
                await crashing.run()
            # 2) Spans published while no ingester runs wait in the stream.
            await publish(20, 40)
            # 3) A healthy ingester takes everything, redelivered batches included;
            #    it is cancelled mid-stream and a fresh one finishes the job.
            async with anyio.create_task_group() as tg:
                ingesters.append(Ingester(bus, db, ack_wait_s=1.0))
                tg.start_soon(ingesters[-1].run)
                await publish(40, 50)
                await anyio.sleep(0.5)
                tg.cancel_scope.cancel()
            await publish(50, batches)
            async with anyio.create_task_group() as tg:
                ingesters.append(Ingester(bus, db, ack_wait_s=1.0))
                tg.start_soon(ingesters[-1].run)
                # Every span stored, and the crashed ingester's 20 batches back: they
                # come after its ack wait, which may end after the last new batch.
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    back = sum(i.redelivered for i in ingesters[1:])
                    if _count(db, eval_id) >= per * batches and back >= 20:
                        break
                    await anyio.sleep(0.2)
                tg.cancel_scope.cancel()

    anyio.run(main, backend="asyncio")
    assert _count(db, eval_id) == per * batches
    distinct = db.rows(
        "SELECT uniqExact(span_id) FROM spans WHERE evaluation_id = {e:String}", {"e": eval_id}
    )[0][0]
    assert distinct == per * batches
    # The dedup path really ran: the crashed ingester's batches came back and were
    # stored a second time (raw rows, merges stopped), yet FINAL shows each span once.
    total = per * batches
    raw = int(
        db.rows("SELECT count() FROM spans WHERE evaluation_id = {e:String}", {"e": eval_id})[0][0]
    )
    stored = sum(i.ingested for i in ingesters)
    assert ingesters[0].ingested >= 20 * per  # inserted, never acknowledged
    assert raw == stored > total, (raw, stored, total)
    assert sum(i.redelivered for i in ingesters[1:]) >= 20  # the un-acked 20 batches
    assert _count(db, eval_id) == total


async def _noop() -> None:
    return None


def test_an_insert_longer_than_the_ack_wait_is_held_not_delivered_again(
    settings: Settings, tmp_path: Path
) -> None:
    """The ingester renews its hold on a fetch while it is inserted: a slow database
    gets each batch once, and the consumer an older bus made with another ack wait is
    set to the ingester's."""
    ack_wait, insert_s = 1.0, 3.5
    eval_id = "ev-slow-insert"

    class SlowDatabase(Ingester):
        def _insert_rows(self, table: str, rows: Any) -> None:
            time.sleep(insert_s)  # a database busy with merges
            super()._insert_rows(table, rows)

    async def main() -> tuple[float, int, int, int]:
        async with provisioned(settings, name="test") as bus:
            old = ConsumerConfig(  # as a bus of an older version has it
                name=names.TRACES_CONSUMER,
                durable_name=names.TRACES_CONSUMER,
                filter_subject=names.traces_wildcard(),
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=30.0,
                deliver_policy=DeliverPolicy.ALL,
                max_ack_pending=20_000,
            )
            await bus.js.add_consumer(names.TRACES_STREAM, config=old)
            for b in range(3):
                await bus.js.publish(
                    names.traces(eval_id, "a1"), codec.encode_model(span_batch(eval_id, b * 50, 50))
                )
            ingester = SlowDatabase(bus, db, ack_wait_s=ack_wait)
            async with anyio.create_task_group() as tg:
                tg.start_soon(ingester.run)
                with anyio.fail_after(60):
                    while _count(db, eval_id) < 150:
                        await anyio.sleep(0.1)
                await anyio.sleep(2 * ack_wait)  # a redelivery would be fetched now
                tg.cancel_scope.cancel()
            info = await bus.js.consumer_info(names.TRACES_STREAM, names.TRACES_CONSUMER)
            assert info.delivered is not None
            return (
                float(info.config.ack_wait or 0),
                ingester.redelivered,
                info.delivered.consumer_seq,
                info.delivered.stream_seq,
            )

    with Database(f"chdb:///{tmp_path / 'db'}") as db:
        db.migrate()
        set_to, redelivered, consumer_seq, stream_seq = anyio.run(main, backend="asyncio")
    assert set_to == ack_wait
    assert redelivered == 0 and consumer_seq == stream_seq == 3, (consumer_seq, stream_seq)


def test_ingested_batches_leave_the_stream_and_poison_is_dead_lettered(
    settings: Settings, tmp_path: Path
) -> None:
    with Database(f"chdb:///{tmp_path / 'db'}") as db:
        db.migrate()
        ingested_batches_leave_the_stream(settings, db)


def ingested_batches_leave_the_stream(settings: Settings, db: Database) -> None:
    eval_id = "ev-trim"

    async def main() -> tuple[int, int, list[str]]:
        async with provisioned(settings, name="test") as bus:
            for b in range(10):
                await bus.js.publish(
                    names.traces(eval_id, "a1"), codec.encode_model(span_batch(eval_id, b * 50, 50))
                )
            poison = span_batch(eval_id, 10_000, 2).dump()
            poison["columns"]["span_id"] = ["abc", "def"]  # a string in a UInt64 column
            await bus.js.publish(names.traces(eval_id, "a1"), codec.encode(poison))
            ingester = Ingester(bus, db, trim_s=0.2)
            async with anyio.create_task_group() as tg:
                tg.start_soon(ingester.run)
                with anyio.fail_after(30):
                    while _count(db, eval_id) < 500 or ingester.trimmed_below < 12:
                        await anyio.sleep(0.1)
                tg.cancel_scope.cancel()
            left = (await bus.js.stream_info(names.TRACES_STREAM)).state.messages
            _, dead = await dead_letters(bus)
            return left, ingester.rejected, [d.error for d in dead]

    left, rejected, dead = anyio.run(main, backend="asyncio")
    assert _count(db, eval_id) == 500  # the good batches, all of them
    assert left == 0 and rejected == 1
    assert len(dead) == 1 and "column span_id" in dead[0]


def _count(db: Database, eval_id: str) -> int:
    return int(
        db.rows("SELECT count() FROM spans FINAL WHERE evaluation_id = {e:String}", {"e": eval_id})[
            0
        ][0]
    )


def test_malformed_messages_get_error_replies_and_services_stay_up(settings: Settings) -> None:
    with agent_and_server(settings, "--framework", "onnxruntime", "--agent-id", "sturdy") as (
        agent,
        server,
    ):
        anyio.run(wait_server, settings)

        async def main() -> None:
            async with busmod.connect(settings, name="test") as bus:
                for subject in (names.agent_query("sturdy"), names.agent_ctl("sturdy")):
                    for payload in (
                        b"\xc1garbage",
                        codec.encode({"kind": "query"}),
                        codec.encode([1, 2]),
                    ):
                        reply = codec.decode(
                            (await bus.nc.request(subject, payload, timeout=5)).data
                        )
                        assert reply["kind"] == "error", reply
                        assert isinstance(
                            error_from_wire(reply["error"]), (WireError, EvaluationError)
                        )
                # A query for an evaluation the agent was never prepared for.
                q = Query(evaluation_id="ev-none", index=0, inputs=np.zeros((1, 8, 8)))
                reply = codec.decode(
                    (
                        await bus.nc.request(
                            names.agent_query("sturdy"), codec.encode_model(q), timeout=5
                        )
                    ).data
                )
                assert "not prepared" in reply["error"]["message"]
                # The server refuses anything but a read-only statement.
                bad = await bus.nc.request(
                    names.SQL_SUBJECT, codec.encode({"sql": "DROP TABLE spans"}), timeout=10
                )
                assert codec.decode(bad.data)["kind"] == "error"
                # A job that is not a job: the server terminates it and stays up.
                await bus.js.publish(names.JOBS_SUBJECT, b"not msgpack")

        anyio.run(main, backend="asyncio")
        summary = anyio.run(
            lambda: submit(
                settings,
                JobRequest(
                    model="digits_cnn",
                    framework="onnxruntime",
                    scenario=ScenarioSpec(name="online", qps=100, duration_s=1),
                ),
                timeout=60,
            ),
            backend="asyncio",
        )
        assert summary.status == "completed" and summary.errors == 0
        assert agent.poll() is None and server.poll() is None


def test_submit_without_a_server_fails_within_seconds(settings: Settings) -> None:
    t = time.monotonic()
    with pytest.raises(BusError, match="server"):
        anyio.run(
            lambda: submit(settings, JobRequest(model="digits_cnn", framework="onnxruntime")),
            backend="asyncio",
        )
    assert time.monotonic() - t < 15


def test_a_submitter_asking_for_a_result_not_stored_yet_is_answered_quietly(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """A submitter waiting on a long run asks now and then whether its evaluation is
    stored: the server answers a typed "not found" (the submitter reads it as "not
    yet"), and logs it below WARNING: routine asks fill no operator's log."""

    async def main() -> tuple[tuple[bool, Any], MLScopeError]:
        async with (
            server_in_process(settings),
            busmod.connect(settings, name="test submitter") as bus,
        ):
            polled = await stored_result(bus, "job-not-stored-yet")
            try:
                await remote.stored_summary(bus, "ev-000000000000")
            except MLScopeError as exc:
                refused = exc
        return polled, refused

    with caplog.at_level(logging.DEBUG, logger="mlscope.server"):
        polled, refused = anyio.run(main, backend="asyncio")
    assert polled == (True, None)
    assert isinstance(refused, EvaluationNotFound) and "ev-000000000000" in refused.message
    asked = [r for r in caplog.records if "no evaluation" in r.getMessage()]
    assert len(asked) == 2 and all(r.levelno < logging.WARNING for r in asked), asked


def test_a_job_behind_busy_servers_is_queued_not_failed(settings: Settings) -> None:
    """A server runs a few jobs at a time; one more waits on the job queue. Its
    submitter hears "queued" and gets the summary, instead of "no server took the
    job" while the server runs it later."""

    def job(duration_s: float) -> JobRequest:
        spec = ScenarioSpec(name="online", qps=20, duration_s=duration_s)
        return JobRequest(model="noop", framework="noop", scenario=spec)

    # The long job takes the host first; the others wait for it, holding their slots.
    long = [job(14.0), *(job(1.0) for _ in range(MAX_PARALLEL_JOBS - 1))]
    last = job(1.0)
    events: list[str] = []
    summaries: dict[str, Any] = {}

    async def main() -> None:
        async with busmod.connect(settings, name="test") as bus:

            async def one(j: JobRequest) -> None:
                summaries[j.job_id] = await submit_on(bus, j, on_event=on_event, timeout=120)

            def on_event(e: JobEvent) -> None:
                events.append(f"{e.job_id}:{e.event}")

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, long[0])
                with anyio.fail_after(30):  # the long job runs: it holds the host
                    while f"{long[0].job_id}:progress" not in events:
                        await anyio.sleep(0.1)
                for j in long[1:]:
                    tg.start_soon(one, j)
                with anyio.fail_after(30):  # every job slot taken
                    while sum(e.endswith(":accepted") for e in events) < len(long):
                        await anyio.sleep(0.1)
                tg.start_soon(one, last)

    with agent_and_server(settings, "--framework", "noop"):
        anyio.run(main, backend="asyncio")
    mine = [e.split(":")[1] for e in events if e.startswith(last.job_id)]
    assert mine[0] == "queued" and "accepted" in mine, mine
    assert summaries[last.job_id].status == "completed"
    assert len(summaries) == len(long) + 1


def test_a_job_that_fails_after_its_agent_was_prepared_ends_the_agents_session(
    settings: Settings,
) -> None:
    """The agent's session (its executor, memory watch) ends with the job however the
    job ends: here its scenario fails after the prepare (no such load generator)."""
    spec = ScenarioSpec(name="online", qps=20, duration_s=2, loadgen_hosts=("nobody",))
    job = JobRequest(model="noop", framework="noop", scenario=spec)

    async def main() -> dict[str, Any]:
        with pytest.raises(MLScopeError, match="nobody"):
            await submit(settings, job, timeout=60)
        async with busmod.connect(settings, name="test") as bus:
            release = ReleaseOp(evaluation_id=evaluation_id_for(job.job_id))
            reply: dict[str, Any] = await busmod.request(
                bus, names.agent_ctl("sess"), codec.encode_model(release), timeout=10
            )
            return reply

    with agent_and_server(settings, "--framework", "noop", "--agent-id", "sess"):
        again = anyio.run(main, backend="asyncio")
    assert again["rss_start_bytes"] is None, again  # nothing was left to release


def test_sigterm_stops_a_running_load_at_once(settings: Settings) -> None:
    env = child_env(settings)
    server = subprocess.Popen([python(), "-m", "cli.main", "server"], env=env)
    agent = subprocess.Popen([python(), "-m", "cli.main", "agent", "--framework", "noop"], env=env)
    stopped: dict[str, float] = {}

    def on_event(e: JobEvent) -> None:
        if e.event == "progress" and not stopped:
            stopped["at"] = time.monotonic()
            server.send_signal(signal.SIGTERM)
            server.wait(20)
            stopped["exit"] = time.monotonic()
            raise KeyboardInterrupt  # stop waiting: nobody will finish this job now

    try:
        anyio.run(wait_agents, settings, 1)
        job = JobRequest(
            model="noop",
            framework="noop",
            scenario=ScenarioSpec(name="online", qps=200, duration_s=60),
        )
        with pytest.raises(KeyboardInterrupt):
            anyio.run(
                lambda: submit(settings, job, on_event=on_event, timeout=90), backend="asyncio"
            )
        assert server.returncode == 0
        assert stopped["exit"] - stopped["at"] < 5.0  # not the 60 s the schedule had left
    finally:
        for p in (agent, server):
            if p.poll() is None:
                p.terminate()
                p.wait(20)
