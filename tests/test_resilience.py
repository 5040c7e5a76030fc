"""Failure behaviour: ingester restarts, server death mid-job, malformed messages."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from nats.aio.msg import Msg

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
    SpanBatch,
    evaluation_id_for,
    new_id,
)
from mlscope.errors import BusError, EvaluationError, MLScopeError, WireError, error_from_wire
from mlscope.jobs import submit, submit_on
from mlscope.natsserver import NatsServer, free_port
from mlscope.registry import list_agents
from mlscope.serving import dead_letters
from mlscope.settings import Settings
from tests.conftest import (
    agent_and_server,
    child_env,
    make_data_dir,
    python,
    wait_agents,
    wait_server,
)

pytestmark = pytest.mark.timeout(240)


def span_batch(eval_id: str, start: int, n: int) -> SpanBatch:
    ids = list(range(start, start + n))
    return SpanBatch(
        evaluation_id=eval_id,
        agent_id="a1",
        host="h",
        batch_id=new_id("sb"),
        columns={
            "span_id": ids,
            "parent_id": [0] * n,
            "query_index": ids,
            "level": [1] * n,
            "kind": ["step"] * n,
            "name": ["predict"] * n,
            "start_ns": ids,
            "end_ns": ids,
            "attrs": [""] * n,
        },
    )


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
        async with busmod.connect(settings, name="test", provision=True) as bus:

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


def test_ingested_batches_leave_the_stream_and_poison_is_dead_lettered(
    settings: Settings, tmp_path: Path
) -> None:
    with Database(f"chdb:///{tmp_path / 'db'}") as db:
        db.migrate()
        ingested_batches_leave_the_stream(settings, db)


def ingested_batches_leave_the_stream(settings: Settings, db: Database) -> None:
    eval_id = "ev-trim"

    async def main() -> tuple[int, int, list[str]]:
        async with busmod.connect(settings, name="test", provision=True) as bus:
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


def test_job_of_a_dead_server_is_run_by_the_next(settings: Settings) -> None:
    env = child_env(settings)
    agent = subprocess.Popen(
        [python(), "-m", "cli.main", "agent", "--framework", "onnxruntime"], env=env
    )
    first = subprocess.Popen([python(), "-m", "cli.main", "server"], env=env)
    second = None
    try:
        anyio.run(wait_agents, settings, 1)
        job = JobRequest(
            model="digits_cnn",
            framework="onnxruntime",
            scenario=ScenarioSpec(name="online", qps=100, duration_s=4),
        )
        events: list[str] = []

        def on_event(e: JobEvent) -> None:
            events.append(f"{e.event}:{e.server_id}")
            nonlocal second
            if e.event == "progress" and second is None:
                first.send_signal(signal.SIGKILL)  # dies mid-job, without acknowledging
                first.wait(20)
                _rows_of_a_lost_attempt(settings, evaluation_id_for(job.job_id))
                second = subprocess.Popen([python(), "-m", "cli.main", "server"], env=env)

        summary = anyio.run(
            lambda: submit(settings, job, on_event=on_event, timeout=150), backend="asyncio"
        )
        servers = {e.split(":")[1] for e in events if e.startswith("accepted")}
        assert len(servers) == 2, events  # taken by the first, run again by the second
        assert any(e.startswith("restarted") for e in events), events  # and said so
        assert summary.status == "completed" and summary.queries > 100
        # Exactly one evaluation, under the id the job determines.
        assert summary.evaluation_id == evaluation_id_for(job.job_id)
        stored = anyio.run(_evaluations_of, settings, job.job_id, backend="asyncio")
        assert stored == [summary.evaluation_id]
        # What the lost attempt stored is gone: the rows are the new attempt's only.
        left = anyio.run(_attempt_rows, settings, summary.evaluation_id, backend="asyncio")
        assert left == {"queries": summary.queries + summary.not_issued, "lost": 0, "runs": 0}
    finally:
        for p in (agent, first, second):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(20)


def test_a_restarted_placement_agent_job_keeps_no_span_of_its_lost_run(
    settings: Settings,
) -> None:
    """A placement-agent run goes on in the agent after its server dies. The next
    server stops it before it deletes what the lost attempt stored, so none of the
    lost run's spans lands under the evaluation afterwards: one root span per query,
    the new run's."""
    job = JobRequest(
        model="noop",
        framework="noop",
        placement="agent",
        # Longer than the job's redelivery (its ack wait): the lost run still runs.
        scenario=ScenarioSpec(name="online", qps=50, duration_s=24),
    )
    agent = ["agent", "--framework", "noop", "--agent-id", "keeper"]
    _across_a_server_loss(settings, job, [agent])


def test_a_restarted_jobs_lost_load_generator_slice_is_stopped(settings: Settings) -> None:
    """A load-generator service's slice goes on after its server dies, sending the
    lost attempt's queries to the agent. The next server stops every run of the
    evaluation on every service before it runs the job again, so the new attempt
    is not measured beside them: one root span per query, the new run's."""
    job = JobRequest(
        model="noop",
        framework="noop",
        # Longer than the job's redelivery (its ack wait): the lost slice still runs.
        scenario=ScenarioSpec(name="online", qps=50, duration_s=24, loadgen_hosts=("lg-held",)),
    )
    services = [
        ["agent", "--framework", "noop", "--agent-id", "held"],
        ["loadgen", "--id", "lg-held"],
    ]
    _across_a_server_loss(settings, job, services)


def _across_a_server_loss(settings: Settings, job: JobRequest, services: list[list[str]]) -> None:
    """``job`` on ``services`` (``mlscope`` argument lists) and a server SIGKILLed at
    the job's first progress, a second server started then: the job is restarted and
    completed, and its evaluation holds one root span per query, the new attempt's."""
    env = child_env(settings)
    procs = [subprocess.Popen([python(), "-m", "cli.main", *args], env=env) for args in services]
    first = subprocess.Popen([python(), "-m", "cli.main", "server"], env=env)
    second: subprocess.Popen[bytes] | None = None
    try:
        anyio.run(wait_agents, settings, 1)
        events: list[str] = []

        def on_event(e: JobEvent) -> None:
            events.append(e.event)
            nonlocal second
            if e.event == "progress" and second is None:
                first.send_signal(signal.SIGKILL)
                first.wait(20)
                second = subprocess.Popen([python(), "-m", "cli.main", "server"], env=env)

        summary = anyio.run(
            lambda: submit(settings, job, on_event=on_event, timeout=200), backend="asyncio"
        )
        assert "restarted" in events and summary.status == "completed", events
        count, queries, last = anyio.run(
            _query_roots, settings, summary.evaluation_id, backend="asyncio"
        )
        assert count == queries, (count, queries)  # no query answered twice
        assert queries > 0 and last < summary.queries + summary.not_issued
    finally:
        for p in (*procs, first, second):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(20)


async def _query_roots(settings: Settings, eval_id: str) -> list[int]:
    """The evaluation's query spans: how many, over how many indices, the last index."""
    async with busmod.connect(settings, name="test") as bus:
        _, rows = await remote.sql(
            bus,
            "SELECT count(), uniqExact(query_index), max(query_index) FROM spans FINAL "
            "WHERE evaluation_id = {e:String} AND kind = 'query'",
            {"e": eval_id},
        )
    return [int(x) for x in rows[0]]


def _rows_of_a_lost_attempt(settings: Settings, eval_id: str) -> None:
    """What a server that died while storing leaves: query rows past any index the
    next attempt reaches, a lost attempt's spans, a stored run of its sweep."""
    with Database(settings.dsn) as db:
        db.command(
            "INSERT INTO queries (evaluation_id, query_index) "
            "SELECT {e:String}, 100000 + number FROM numbers(50)",
            {"e": eval_id},
        )
        db.command(
            "INSERT INTO spans (evaluation_id, agent_id, span_id) "
            "SELECT {e:String}, 'lost-attempt', number FROM numbers(20)",
            {"e": eval_id},
        )
        db.command(
            "INSERT INTO evaluations (evaluation_id, job_id) VALUES ({p:String}, 'lost')",
            {"p": f"{eval_id}-0"},
        )


async def _attempt_rows(settings: Settings, eval_id: str) -> dict[str, int]:
    async with busmod.connect(settings, name="test") as bus:
        _, rows = await remote.sql(
            bus,
            "SELECT (SELECT count() FROM queries FINAL WHERE evaluation_id = {e:String}), "
            "(SELECT count() FROM spans FINAL WHERE evaluation_id = {e:String} "
            "AND agent_id = 'lost-attempt'), "
            "(SELECT count() FROM evaluations FINAL WHERE evaluation_id = {p:String})",
            {"e": eval_id, "p": f"{eval_id}-0"},
        )
    queries, lost, runs = rows[0]
    return {"queries": int(queries), "lost": int(lost), "runs": int(runs)}


async def _evaluations_of(settings: Settings, job_id: str) -> list[str]:
    async with busmod.connect(settings, name="test") as bus:
        _, rows = await remote.sql(
            bus,
            "SELECT evaluation_id FROM evaluations FINAL WHERE job_id = {j:String}",
            {"j": job_id},
        )
    return [r[0] for r in rows]


def test_agent_killed_mid_run_gives_one_invalid_evaluation_with_its_queries(
    settings: Settings,
) -> None:
    with agent_and_server(settings, "--framework", "noop", "--agent-id", "doomed") as (
        agent,
        server,
    ):
        job = JobRequest(
            model="noop",
            framework="noop",
            scenario=ScenarioSpec(name="online", qps=200, duration_s=4),
        )

        def on_event(e: JobEvent) -> None:
            if e.event == "progress" and e.queries_done >= 150 and agent.poll() is None:
                agent.send_signal(signal.SIGKILL)

        summary = anyio.run(
            lambda: submit(settings, job, on_event=on_event, timeout=120), backend="asyncio"
        )
        assert not summary.valid and agent.poll() is not None
        lost = [r for r in summary.invalid_reasons if r.startswith("agent doomed lost after")]
        assert lost, summary.invalid_reasons
        answered = int(lost[0].split(" after ")[1].split(" of ")[0])
        total = int(lost[0].split(" of ")[1].split()[0])
        assert 150 <= answered < total

        async def stored() -> tuple[list[str], list[list[object]]]:
            async with busmod.connect(settings, name="test") as bus:
                return await remote.sql(
                    bus,
                    "SELECT countIf(ok = 1), countIf(ok = 0 AND error LIKE 'lost: %'), "
                    "count() FROM queries FINAL WHERE evaluation_id = {e:String}",
                    {"e": summary.evaluation_id},
                )

        _, rows = anyio.run(stored, backend="asyncio")
        assert rows[0] == [answered, total - answered, total]  # every query, each explained
        assert anyio.run(_evaluations_of, settings, job.job_id, backend="asyncio") == [
            summary.evaluation_id
        ]
        assert server.poll() is None


def test_an_agent_restarted_under_its_id_mid_run_is_lost_not_overloaded(
    settings: Settings,
) -> None:
    """Another process answering under the agent's id is not the agent that ran the
    queries: the run says it lost that agent (which restarted), and the queries the
    new process refused fail with its reason instead of counting as lost in transit."""
    env = child_env(settings)
    cmd = [python(), "-m", "cli.main", "agent", "--framework", "noop", "--agent-id", "phoenix"]
    with agent_and_server(settings, "--framework", "noop", "--agent-id", "phoenix") as (
        agent,
        _server,
    ):
        job = JobRequest(
            model="noop",
            framework="noop",
            scenario=ScenarioSpec(name="online", qps=100, duration_s=20),  # time to restart
        )
        reborn: list[subprocess.Popen[bytes]] = []

        def on_event(e: JobEvent) -> None:
            if e.event == "progress" and e.queries_done >= 100 and not reborn:
                agent.send_signal(signal.SIGKILL)
                agent.wait(20)
                reborn.append(subprocess.Popen(cmd, env=env))

        try:
            summary = anyio.run(
                lambda: submit(settings, job, on_event=on_event, timeout=120), backend="asyncio"
            )
        finally:
            for p in reborn:
                p.terminate()
                p.wait(20)
        assert not summary.valid
        lost = [r for r in summary.invalid_reasons if r.startswith("agent phoenix lost after")]
        assert lost and lost[0].endswith("(it restarted)"), summary.invalid_reasons


def test_a_local_run_whose_agent_restarted_under_its_id_is_lost_at_once(
    settings: Settings,
) -> None:
    """Placement agent: a new process under the run's agent id answers pings but knows
    nothing of the run. The server says it lost the agent that ran it (which
    restarted) once that agent goes silent, not after the run's deadline as a run that
    "did not finish"."""
    env = child_env(settings)
    cmd = [python(), "-m", "cli.main", "agent", "--framework", "noop", "--agent-id", "phoenix"]
    with agent_and_server(settings, "--framework", "noop", "--agent-id", "phoenix") as (
        agent,
        _server,
    ):
        first = agent.pid
        job = JobRequest(
            model="noop",
            framework="noop",
            placement="agent",
            scenario=ScenarioSpec(name="online", qps=50, duration_s=60),
        )
        twin: list[subprocess.Popen[bytes]] = []

        def restart() -> None:
            """The twin registers under the id, then the first process falls silent."""
            twin.append(subprocess.Popen(cmd, env=env))

            async def registered() -> None:
                async with busmod.connect(settings, name="test") as bus:
                    while True:
                        now = {a.agent_id: a for a in await list_agents(bus)}.get("phoenix")
                        if now is not None and now.pid != first:
                            return
                        await anyio.sleep(0.2)

            anyio.run(registered, backend="asyncio")
            agent.send_signal(signal.SIGSTOP)

        def on_event(e: JobEvent) -> None:
            if e.event == "progress" and e.queries_done >= 50 and not twin:
                threading.Thread(target=restart, daemon=True).start()

        try:
            summary = anyio.run(
                lambda: submit(settings, job, on_event=on_event, timeout=120), backend="asyncio"
            )
        finally:
            agent.kill()
            agent.wait(20)
            for p in twin:
                p.terminate()
                p.wait(20)
        assert not summary.valid
        lost = [r for r in summary.invalid_reasons if r.startswith("agent phoenix lost after")]
        assert lost and "(it restarted)" in lost[0], summary.invalid_reasons
        assert summary.queries < 50 * 60 // 2, summary.queries  # the run ended with the agent


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


def test_a_bus_outage_longer_than_the_ack_wait_gives_one_evaluation(
    tmp_path: Path, zoo_dir: Path
) -> None:
    nats = NatsServer(store_dir=tmp_path / "nats", port=free_port()).start()
    settings = Settings(nats_url=nats.url, data_dir=make_data_dir(tmp_path / "data", zoo_dir))
    env = child_env(settings)
    procs = [
        subprocess.Popen([python(), "-m", "cli.main", "server"], env=env),
        subprocess.Popen([python(), "-m", "cli.main", "agent", "--framework", "noop"], env=env),
    ]
    outage: list[threading.Thread] = []

    def down_and_up() -> None:
        nats.kill()
        time.sleep(20)  # longer than the job's ack wait (15 s)
        nats.start()

    def on_event(e: JobEvent) -> None:
        if e.event == "progress" and e.queries_done >= 200 and not outage:
            outage.append(threading.Thread(target=down_and_up))
            outage[0].start()

    try:
        anyio.run(wait_agents, settings, 1)
        job = JobRequest(
            model="noop",
            framework="noop",
            scenario=ScenarioSpec(name="online", qps=100, duration_s=30),
        )
        summary = anyio.run(
            lambda: submit(settings, job, on_event=on_event, timeout=170), backend="asyncio"
        )
        assert outage and not outage[0].is_alive()
        assert summary.evaluation_id == evaluation_id_for(job.job_id)
        assert anyio.run(_evaluations_of, settings, job.job_id, backend="asyncio") == [
            summary.evaluation_id
        ]
        assert [p.poll() for p in procs] == [None, None]
    finally:
        for t in outage:
            t.join(30)
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(20)
        nats.stop()


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
