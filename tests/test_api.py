"""The Python API (:mod:`mlscope.api`) against a real stack (nats-server, server owning
chDB, noop agent): what can run, a job submitted with a progress callback, its results
as data frames matching its summary, and a cancel."""

from __future__ import annotations

import json

import anyio
import pytest
from nats.aio.msg import Msg

from cli.stack import Stack
from mlscope.api import Client
from mlscope.contracts import JobEvent, JobRequest, ScenarioSpec
from mlscope.errors import BusError, UnknownModelError, WireError
from mlscope.settings import Settings

pytestmark = pytest.mark.timeout(120)


def noop_job(**scenario: object) -> JobRequest:
    spec = ScenarioSpec.model_validate(scenario)
    return JobRequest(model="noop", framework="noop", trace_level="model", scenario=spec)


def test_agents_models_submit_and_frames(noop_stack: Stack) -> None:
    events: list[JobEvent] = []

    async def go() -> None:
        async with Client(noop_stack.settings) as client:
            agents = await client.agents()
            assert any(f.name == "noop" for a in agents for f in a.frameworks)
            models = await client.models()
            noop = next(m for m in models if (m["name"], m["framework"]) == ("noop", "noop"))
            assert noop["agents"] == sorted(a.agent_id for a in agents)

            job = noop_job(name="constant", qps=100, duration_s=1.0)
            summary = await client.submit(job, on_progress=events.append)
            assert summary.status == "completed" and summary.queries == 100

            queries = await client.queries(summary.evaluation_id)
            assert len(queries) == summary.queries
            assert (queries["completed_ns"] >= queries["scheduled_ns"]).all()
            ev = await client.evaluations([summary.evaluation_id])
            assert json.loads(ev["summary"].iloc[0])["queries"] == summary.queries
            stored = await client.stored(summary.evaluation_id)
            assert stored is not None and stored.evaluation_id == summary.evaluation_id
            spans = await client.spans(summary.evaluation_id)
            assert set(spans["evaluation_id"]) <= {summary.evaluation_id}

    anyio.run(go, backend="asyncio")
    kinds = [e.event for e in events]
    assert kinds[0] == "accepted" and kinds[-1] == "done", kinds
    done = events[-1]  # the run's final figures, as progress events give them
    assert done.summary is not None and done.evaluation_id == done.summary.evaluation_id
    assert done.queries_done == done.summary.queries == 100
    assert done.elapsed_s == done.summary.duration_s > 0.9
    assert done.p50_ms == done.summary.latency_ms.p50
    shown = [e.queries_done for e in events if e.event == "progress"]
    assert all(n <= done.queries_done for n in shown), shown


def test_a_frame_spans_several_pages(noop_stack: Stack) -> None:
    async def go() -> int:
        async with Client(noop_stack.settings) as client:
            got = await client.frame("SELECT number FROM system.numbers LIMIT 4500")
            return len(got)

    assert anyio.run(go, backend="asyncio") == 4500


def test_failures_are_typed(noop_stack: Stack) -> None:
    async def go() -> None:
        async with Client(noop_stack.settings) as client:
            with pytest.raises(UnknownModelError, match="did you mean 'noop'"):
                await client.submit(
                    JobRequest(model="nop", framework="noop", scenario=ScenarioSpec())
                )
            assert await client.cancel("job-nothing", timeout=0.5) is None
            assert await client.stored("ev-nothing") is None

    anyio.run(go, backend="asyncio")
    with pytest.raises(BusError, match="not connected"):
        _ = Client(noop_stack.settings).bus


def test_cancel_through_the_api(noop_stack: Stack) -> None:
    async def go() -> None:
        async with Client(noop_stack.settings) as client:
            job = noop_job(name="online", qps=50, duration_s=20)
            result: list[object] = []

            async def run() -> None:
                result.append(await client.submit(job))

            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await anyio.sleep(2.0)
                reply = await client.cancel(job.job_id)
                assert reply is not None and reply.job_id == job.job_id
            (summary,) = result
            assert getattr(summary, "status", None) == "cancelled"

    anyio.run(go, backend="asyncio")


def test_a_submit_given_up_cancels_its_job(noop_stack: Stack) -> None:
    """A caller that stops awaiting a job (here a timeout around the await) has it
    cancelled on the server: it is stored as cancelled after about the time waited, not
    run for its 20 s holding the agent."""

    async def go() -> None:
        async with Client(noop_stack.settings) as client:
            job = noop_job(name="online", qps=50, duration_s=20)
            with anyio.move_on_after(3.0) as waited:
                await client.submit(job)
            assert waited.cancelled_caught
            with anyio.fail_after(10):  # the cancel was heard: stored well before 20 s
                while (summary := await client.stored(job.evaluation_id())) is None:
                    await anyio.sleep(0.2)
            assert summary.status == "cancelled" and not summary.valid
            assert summary.duration_s is not None and summary.duration_s < 10

    anyio.run(go, backend="asyncio")


def test_a_job_cancelled_before_a_server_takes_it_is_not_run(noop_stack: Stack) -> None:
    async def go() -> None:
        async with Client(noop_stack.settings) as client:
            job = noop_job(name="online", qps=50, duration_s=20)
            assert await client.cancel(job.job_id, timeout=0.5) is None  # runs nowhere yet
            with anyio.fail_after(10):  # not run for its 20 s
                summary = await client.submit(job)
            assert summary.status == "cancelled" and not summary.valid
            assert summary.queries == 0
            assert len(await client.queries(summary.evaluation_id)) == 0

    anyio.run(go, backend="asyncio")


@pytest.mark.parametrize(
    "reply",
    [
        {"kind": "evaluation", "spec": "{}", "summary": '{"status": 5}'},
        {"kind": "evaluation", "spec": "{}", "summary": "{not json"},
        {"kind": "evaluation", "spec": "[]", "summary": "[]"},
        {"spec": 7},
        [1, 2, 3],
    ],
    ids=["not-a-summary", "not-json", "not-objects", "wrong-reply", "no-reply-object"],
)
def test_a_stored_summary_this_version_cannot_read_is_a_wire_error(
    settings: Settings, reply: object
) -> None:
    """A stored summary of another shape (written by another version, or a responder
    that is not a server) is a WireError naming the evaluation, from the API and from a
    submitter that looks for its result: not None ("not stored yet", waited on for
    ever), nor a pydantic traceback."""
    from mlscope import bus as busmod
    from mlscope import codec, names
    from mlscope.jobs import stored_result

    async def go() -> None:
        async with busmod.connect(settings, name="stand-in server") as bus:

            async def answer(msg: Msg) -> None:
                await msg.respond(codec.encode(reply))

            await bus.nc.subscribe(names.EVALUATION_SUBJECT, cb=answer)
            async with Client(settings) as client:
                with pytest.raises(WireError):
                    await client.stored("ev-odd")
            with pytest.raises(WireError):
                await stored_result(bus, "job-odd")

    anyio.run(go, backend="asyncio")
