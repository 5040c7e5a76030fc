"""A server lost mid-job: the next server runs the job again, once, and what the lost
attempt left (its rows, its spans, its load generators) is dropped or stopped; a bus
outage longer than the ack wait gives one evaluation."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import anyio
import pytest

from broker.db import Database
from mlscope import bus as busmod
from mlscope import names, remote
from mlscope.contracts import (
    JobEvent,
    JobRequest,
    ScenarioSpec,
    evaluation_id_for,
)
from mlscope.jobs import submit
from mlscope.natsserver import NatsServer, free_port
from mlscope.settings import Settings
from tests.conftest import (
    child_env,
    evaluations_of,
    make_data_dir,
    python,
    server_in_process,
    wait_agents,
)
from tests.trace_faults import freeze_holding_batches

pytestmark = pytest.mark.timeout(240)

FAILOVER_S = 4.0
"""The job ack wait of these tests' servers: how soon a lost server's job moves on."""


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.with_(job_ack_wait_s=FAILOVER_S)


def test_each_server_sets_its_job_ack_wait_on_the_shared_consumer(settings: Settings) -> None:
    """JetStream keeps an existing consumer's config as it is: a server started with
    another ack wait updates the shared job consumer, so the setting is the one in
    force, and a job's failover follows it."""

    async def ack_wait_after_a_server_with(ack_wait: float) -> float:
        async with server_in_process(settings.with_(job_ack_wait_s=ack_wait)):
            pass
        async with busmod.connect(settings, name="test") as bus:
            info = await bus.js.consumer_info(names.JOBS_STREAM, names.JOBS_CONSUMER)
        return float(info.config.ack_wait or 0)

    async def main() -> list[float]:
        return [await ack_wait_after_a_server_with(w) for w in (15.0, 2.5, 2.5, 15.0)]

    assert anyio.run(main, backend="asyncio") == [15.0, 2.5, 2.5, 15.0]


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
        stored = anyio.run(evaluations_of, settings, job.job_id, backend="asyncio")
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
        scenario=ScenarioSpec(name="online", qps=50, duration_s=3 * FAILOVER_S),
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
        scenario=ScenarioSpec(
            name="online", qps=50, duration_s=3 * FAILOVER_S, loadgen_hosts=("lg-held",)
        ),
    )
    services = [
        ["agent", "--framework", "noop", "--agent-id", "held"],
        ["loadgen", "--id", "lg-held"],
    ]
    _across_a_server_loss(settings, job, services)


def _across_a_server_loss(settings: Settings, job: JobRequest, services: list[list[str]]) -> None:
    """``job`` on ``services`` (``mlscope`` argument lists) and a server SIGKILLed at
    the job's first progress, holding trace batches it has not acknowledged (they come
    back only after the trace ack wait, later than the job), a second server started
    then: the job is restarted and completed, and its evaluation holds one root span
    per query, the new attempt's."""
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
                # Off this (running) event loop: the freeze asks the bus with its own.
                freeze = threading.Thread(target=freeze_holding_batches, args=(settings, first))
                freeze.start()
                freeze.join(60)
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
    next attempt reaches, a lost attempt's spans, a stored run of its sweep and that
    run's spans (a sweep's runs are traced under their own ids)."""
    with Database(settings.dsn) as db:
        db.command(
            "INSERT INTO queries (evaluation_id, query_index) "
            "SELECT {e:String}, 100000 + number FROM numbers(50)",
            {"e": eval_id},
        )
        for e in (eval_id, f"{eval_id}-0"):
            db.command(
                "INSERT INTO spans (evaluation_id, agent_id, span_id) "
                "SELECT {e:String}, 'lost-attempt', number FROM numbers(20)",
                {"e": e},
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
            "(SELECT count() FROM spans FINAL WHERE evaluation_id IN ({e:String}, "
            "{p:String}) AND agent_id = 'lost-attempt'), "
            "(SELECT count() FROM evaluations FINAL WHERE evaluation_id = {p:String})",
            {"e": eval_id, "p": f"{eval_id}-0"},
        )
    queries, lost, runs = rows[0]
    return {"queries": int(queries), "lost": int(lost), "runs": int(runs)}


def test_a_bus_outage_longer_than_the_ack_wait_gives_one_evaluation(
    tmp_path: Path, zoo_dir: Path
) -> None:
    nats = NatsServer(store_dir=tmp_path / "nats", port=free_port()).start()
    settings = Settings(
        nats_url=nats.url,
        data_dir=make_data_dir(tmp_path / "data", zoo_dir),
        job_ack_wait_s=FAILOVER_S,
    )
    env = child_env(settings)
    procs = [
        subprocess.Popen([python(), "-m", "cli.main", "server"], env=env),
        subprocess.Popen([python(), "-m", "cli.main", "agent", "--framework", "noop"], env=env),
    ]
    outage: list[threading.Thread] = []

    def down_and_up() -> None:
        nats.kill()
        time.sleep(2 * FAILOVER_S)  # longer than the job's ack wait
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
            scenario=ScenarioSpec(name="online", qps=100, duration_s=4 * FAILOVER_S),
        )
        summary = anyio.run(
            lambda: submit(settings, job, on_event=on_event, timeout=170), backend="asyncio"
        )
        assert outage and not outage[0].is_alive()
        assert summary.evaluation_id == evaluation_id_for(job.job_id)
        assert anyio.run(evaluations_of, settings, job.job_id, backend="asyncio") == [
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
