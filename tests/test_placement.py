"""Placement agent: the agent generates the load itself; the server stores the same run.

Real nats-server, server and agent processes (onnxruntime with digits_cnn, noop).
Timing is never asserted (the machine is shared): counts, stored rows, their order,
verdicts and accuracy are.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from pydantic import ValidationError

from cli.stack import Stack
from cli.submit_flags import make_job, parser
from cli.summary_text import format_summary
from mlscope import bus as busmod
from mlscope import codec, remote
from mlscope.contracts import EvaluationSummary, JobEvent, JobRequest, Preprocess, ScenarioSpec
from mlscope.errors import ConfigError, ResolutionError
from mlscope.jobs import submit
from mlscope.registry import list_agents
from mlscope.schedule import build_schedule
from mlscope.settings import Settings
from tests.conftest import LOOSE, agent_and_server, agent_description, running_stack

pytestmark = pytest.mark.timeout(300)

QUERY_ROWS = (
    "SELECT query_index, scheduled_ns, issued_ns, agent_received_ns, predict_start_ns, "
    "predict_end_ns, completed_ns, ok, outcome FROM queries FINAL "
    "WHERE evaluation_id = {e:String} ORDER BY query_index"
)


@pytest.fixture(scope="module")
def placement_stack(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("placement"), zoo_dir, ["onnxruntime", "noop"]) as s:
        yield s


def run(settings: Settings, job: JobRequest) -> EvaluationSummary:
    return anyio.run(lambda: submit(settings, job, timeout=240), backend="asyncio")


def sql(settings: Settings, query: str, evaluation_id: str) -> list[list[Any]]:
    async def go() -> list[list[Any]]:
        async with busmod.connect(settings, name="test") as bus:
            return (await remote.sql(bus, query, {"e": evaluation_id}))[1]

    return anyio.run(go, backend="asyncio")


def digits(placement: str, n: int) -> JobRequest:
    spec = ScenarioSpec(name="batched", batch_size=32, max_queries=n, duration_s=60, **LOOSE)
    return JobRequest(
        model="digits_cnn",
        framework="onnxruntime",
        scenario=spec,
        trace_level="none",
        placement=placement,  # type: ignore[arg-type]
    )


def test_batched_in_the_agent_stores_every_query_in_order_and_is_valid(
    placement_stack: Stack,
) -> None:
    settings = placement_stack.settings
    n = 40
    agent = run(settings, digits("agent", n))
    server = run(settings, digits("server", n))
    assert agent.valid, agent.invalid_reasons
    assert (agent.placement, server.placement) == ("agent", "server")
    assert agent.queries == n and agent.samples == 32 * n
    assert (agent.errors, agent.failed, agent.refused, agent.lost, agent.not_issued) == (
        0,
        0,
        0,
        0,
        0,
    )
    assert agent.throughput_ips and agent.throughput_ips > 0
    assert "placement" in format_summary(agent) and "in the agent" in format_summary(agent)
    # The agent held its samples pre-processed (the default): not inside any query's time.
    assert (agent.preprocess, server.preprocess) == ("ahead", "timed")
    assert "pre-processed ahead" in format_summary(agent)
    # Answered as one stream, in blocks: its latencies say they include a block's wait.
    blocks = [w for w in agent.warnings if w.startswith("answered in blocks")]
    assert len(blocks) == 1 and blocks[0] in format_summary(agent), agent.warnings
    assert not any(w.startswith("answered in blocks") for w in server.warnings)
    # The same seeded samples in the same order through the same model: the same top-1.
    assert agent.accuracy is not None and server.accuracy is not None
    assert agent.accuracy["top1"] > 0.9
    assert abs(agent.accuracy["top1"] - server.accuracy["top1"]) <= 0.01

    rows = np.asarray(sql(settings, QUERY_ROWS, agent.evaluation_id), dtype=np.int64)
    assert rows.shape == (n, 9)
    assert (rows[:, 0] == np.arange(n)).all()
    times = rows[:, 1:7]  # scheduled, issued, received, predict start/end, completed
    assert (times > 0).all()
    assert (np.diff(times, axis=1) >= 0).all(), times[:3]
    assert (rows[:, 7] == 1).all()
    # A closed loop: each query is scheduled when it is issued, in index order.
    assert (np.diff(rows[:, 1]) >= 0).all()
    stored = sql(
        settings,
        "SELECT valid, summary FROM evaluations FINAL WHERE evaluation_id = {e:String}",
        agent.evaluation_id,
    )
    assert stored[0][0] == 1 and '"placement":"agent"' in stored[0][1].replace(" ", "")


def test_online_in_the_agent_issues_the_servers_schedule(placement_stack: Stack) -> None:
    spec = ScenarioSpec(name="online", qps=500, duration_s=2, seed=3, **LOOSE)
    job = JobRequest(
        model="noop", framework="noop", scenario=spec, trace_level="none", placement="agent"
    )
    s = run(placement_stack.settings, job)
    expected, _ = build_schedule(spec)
    assert s.valid, s.invalid_reasons
    assert s.queries == len(expected) and s.errors == 0 and s.not_issued == 0
    assert not any(w.startswith("answered in blocks") for w in s.warnings)  # one at a time
    lag = s.issue_lag_us
    assert lag["min"] is not None and lag["min"] >= 0
    rows = np.asarray(sql(placement_stack.settings, QUERY_ROWS, s.evaluation_id), np.int64)
    np.testing.assert_array_equal(rows[:, 1], expected.offsets_ns)  # scheduled = the schedule
    assert (rows[:, 2] >= rows[:, 1]).all()  # never issued early


def agent_cpu_s(settings: Settings, framework: str) -> tuple[float, float]:
    """CPU time (utime + stime, s) the kernel counted for the process of the agent that
    serves ``framework`` (``/proc/<pid>/stat``), and that clock's resolution (s)."""

    async def pid() -> int:
        async with busmod.connect(settings, name="test") as bus:
            agents = await list_agents(bus)
        return next(a.pid for a in agents if any(f.name == framework for f in a.frameworks))

    fields = Path(f"/proc/{anyio.run(pid, backend='asyncio')}/stat").read_text()
    utime, stime = fields.rsplit(")", 1)[1].split()[11:13]  # fields 14 and 15
    tick = os.sysconf("SC_CLK_TCK")
    return (int(utime) + int(stime)) / tick, 1 / tick


def test_online_in_the_agent_reports_its_load_generators_cpu(placement_stack: Stack) -> None:
    """The in-agent load generator's CPU time (its pacer's thread) is in the summary's
    ``loadgen_cost`` as a server-placed run's is, beside the agent process's; the kernel,
    asked apart, counted at least that much for the agent process over the run."""
    settings = placement_stack.settings
    spec = ScenarioSpec(name="online", qps=100, duration_s=2, seed=5, **LOOSE)
    job = JobRequest(
        model="noop", framework="noop", scenario=spec, trace_level="none", placement="agent"
    )
    before, tick = agent_cpu_s(settings, "noop")
    s = run(settings, job)
    after, _ = agent_cpu_s(settings, "noop")
    cost = s.loadgen_cost
    assert cost is not None and cost["placement"] == "agent" and cost["shared_host"], cost
    sent = s.queries - s.not_issued
    assert cost["cpu_s"] > 0, cost
    assert cost["cpu_us_per_query"] == pytest.approx(cost["cpu_s"] / sent * 1e6), cost
    assert cost["process_cpu_s"] >= cost["cpu_s"], cost
    # /proc counts in clock ticks: each reading's utime and stime are each up to one
    # tick short.
    assert after - before + 2 * tick >= cost["process_cpu_s"], (before, after, cost)
    assert "µs CPU per query on" in (text := format_summary(s)) and "in the agent's process" in text


def test_single_stream_in_the_agent_keeps_one_query_in_flight(placement_stack: Stack) -> None:
    spec = ScenarioSpec(name="single-stream", duration_s=30, max_queries=200, **LOOSE)
    job = JobRequest(
        model="noop", framework="noop", scenario=spec, trace_level="model", placement="agent"
    )
    s = run(placement_stack.settings, job)
    assert s.valid, s.invalid_reasons
    assert s.queries == 200 and s.errors == 0
    rows = np.asarray(sql(placement_stack.settings, QUERY_ROWS, s.evaluation_id), np.int64)
    assert (rows[1:, 2] >= rows[:-1, 6]).all()  # each issued after the previous completed


def test_a_closed_loop_in_the_agent_that_outgrows_its_record_loses_no_answer(
    placement_stack: Stack,
) -> None:
    """A thousand streams in the agent: its record grows (on the run's thread while the
    first queries go out, on the predict thread after) while answers are written into
    it, and every query it issued is stored answered or refused, none lost."""
    spec = ScenarioSpec(name="concurrency", concurrency=1024, duration_s=2, **LOOSE)
    job = JobRequest(
        model="noop", framework="noop", scenario=spec, trace_level="none", placement="agent"
    )
    s = run(placement_stack.settings, job)
    assert s.queries > 1024 and s.lost == 0, s.invalid_reasons
    counted = (  # counted in the database: a fast run's rows are over one reply's payload
        "SELECT count(), countIf(completed_ns > 0) FROM queries FINAL "
        "WHERE evaluation_id = {e:String}"
    )
    [[stored, completed]] = sql(placement_stack.settings, counted, s.evaluation_id)
    assert stored == completed == s.queries  # every one stored, every one completed


def test_an_agent_without_the_feature_is_refused_with_the_fix(settings: Settings) -> None:
    with agent_and_server(settings, "--framework", "noop", "--no-local-runs"):
        job = JobRequest(
            model="noop",
            framework="noop",
            scenario=ScenarioSpec(name="online", qps=50, duration_s=1),
            placement="agent",
        )
        with pytest.raises(ResolutionError, match="cannot run load themselves") as info:
            run(settings, job)
        assert "--placement server" in info.value.message


def test_agent_killed_mid_local_run_is_invalid_with_the_reason(settings: Settings) -> None:
    agent_args = ("--framework", "noop", "--agent-id", "doomed")
    with agent_and_server(settings, *agent_args) as (agent, server):
        job = JobRequest(
            model="noop",
            framework="noop",
            scenario=ScenarioSpec(name="online", qps=200, duration_s=6),
            placement="agent",
        )

        def on_event(e: JobEvent) -> None:
            if e.event == "progress" and e.queries_done >= 150 and agent.poll() is None:
                agent.send_signal(signal.SIGKILL)

        summary = anyio.run(
            lambda: submit(settings, job, on_event=on_event, timeout=120), backend="asyncio"
        )
        assert agent.poll() is not None and not summary.valid
        lost = [r for r in summary.invalid_reasons if r.startswith("agent doomed lost after")]
        assert lost, summary.invalid_reasons
        answered = int(lost[0].split(" after ")[1].split(" of ")[0])
        assert 150 <= answered < len(build_schedule(job.scenario)[0])
        rows = sql(
            settings,
            "SELECT countIf(ok = 1), count() FROM queries FINAL WHERE evaluation_id = {e:String}",
            summary.evaluation_id,
        )
        assert rows[0] == [answered, summary.queries]
        assert server.poll() is None


@pytest.mark.parametrize(
    "extra",
    [
        {"scenario": ScenarioSpec(name="cold-start")},
        {"scenario": ScenarioSpec(name="online", loadgens=2)},
        {"scenario": ScenarioSpec(name="online", loadgen_hosts=("lg-a",))},
    ],
    ids=["cold-start", "loadgens", "loadgen-hosts"],
)
def test_what_a_local_run_cannot_do_is_refused_at_intake(extra: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="placement agent"):
        JobRequest(model="noop", framework="noop", placement="agent", **extra)


def efficientnet(preprocess: Preprocess | None) -> JobRequest:
    spec = ScenarioSpec(
        name="batched", batch_size=2, max_queries=4, duration_s=60, preprocess=preprocess, **LOOSE
    )
    return JobRequest(
        model="efficientnet_lite0",
        framework="onnxruntime",
        scenario=spec,
        trace_level="none",
        placement="agent",
    )


def test_held_samples_are_given_back_after_each_run(settings: Settings) -> None:
    """efficientnet_lite0's six samples pre-processed take 3.6 MB: with 5 MiB of sample
    memory, a second run holds them only if the first gave them back."""
    with agent_and_server(settings, "--framework", "onnxruntime", "--sample-memory", "5"):
        for _ in range(2):
            s = run(settings, efficientnet("ahead"))
            assert (s.preprocess, s.queries, s.errors) == ("ahead", 4, 0), s.invalid_reasons


def test_samples_over_the_sample_memory_are_pre_processed_timed(settings: Settings) -> None:
    """With 3 MiB the six samples do not fit: by default the run pre-processes them in
    each query's time and says so; asked to hold them ahead, it is refused with the fix."""
    with agent_and_server(settings, "--framework", "onnxruntime", "--sample-memory", "3"):
        s = run(settings, efficientnet(None))
        assert (s.preprocess, s.queries, s.errors) == ("timed", 4, 0), s.invalid_reasons
        assert "pre-processing timed" in format_summary(s)
        with pytest.raises(ConfigError, match="--sample-memory"):
            run(settings, efficientnet("ahead"))


def test_preprocess_ahead_needs_placement_agent() -> None:
    with pytest.raises(ValidationError, match="needs placement agent"):
        JobRequest(
            model="noop",
            framework="noop",
            scenario=ScenarioSpec(name="online", preprocess="ahead"),
        )
    with pytest.raises(ValidationError, match="needs placement agent"):
        JobRequest(
            model="noop",
            framework="noop",
            scenario=ScenarioSpec(name="batched", preprocess="ahead"),
            placement="server",
        )


def test_a_job_without_placement_gets_its_scenarios() -> None:
    """Batched measures the model's own throughput: in the agent unless the job says
    otherwise; the rest, and what cannot run in the agent, on the server. Through the
    contract, a decoded message and the CLI alike."""

    def job(**kw: object) -> JobRequest:
        return JobRequest.model_validate({"model": "noop", "framework": "noop", **kw})

    assert job(scenario={"name": "batched"}).placement == "agent"
    assert job(scenario={"name": "batched"}, placement=None).placement == "agent"
    assert job(scenario={"name": "batched"}, placement="server").placement == "server"
    assert job().placement == "server"  # online
    for name in ("single-stream", "online", "peak", "cold-start"):
        assert job(scenario={"name": name}).placement == "server", name
    dealt = {"name": "batched", "loadgens": 2}
    assert job(scenario=dealt).placement == "server"
    wire = codec.decode(codec.encode_model(job(scenario={"name": "batched"})))
    assert JobRequest.model_validate(wire).placement == "agent"  # stored as it ran
    cli = ["noop", "--framework", "noop", "--scenario", "batched"]
    assert make_job(parser().parse_args(cli)).placement == "agent"
    assert make_job(parser().parse_args([*cli, "--placement", "server"])).placement == "server"
    assert make_job(parser().parse_args(cli[:3])).placement == "server"
    args = parser().parse_args(
        ["noop", "--framework", "noop", "--placement", "agent", "--preprocess", "timed"]
    )
    assert make_job(args).scenario.preprocess == "timed"


def test_submit_takes_placement() -> None:
    args = parser().parse_args(["noop", "--framework", "noop", "--placement", "agent"])
    assert make_job(args).placement == "agent"
    args = parser().parse_args(["noop", "--framework", "noop"])
    assert make_job(args).placement == "server"


def test_rows_are_split_under_the_payload_and_arrive_whole() -> None:
    from agent.runrows import rows_messages
    from broker.agentrows import AGENT_TIMES, RowCollector
    from mlscope import codec, samples
    from mlscope.contracts import RunRows
    from mlscope.record import ARRAYS, RunRecord

    n, batch = 5000, 4
    src = RunRecord(n=n, batch_size=batch)
    happen = ("scheduled", "paced", "issued", *AGENT_TIMES, "completed")  # in their order
    for k, name in enumerate(ARRAYS):
        getattr(src, name)[:] = (
            (np.arange(n) + k) % 2
            if name in ("ok", "refused")
            else happen.index(name) + 1
            if name in happen
            else k + 1
        )
    cols = {name: getattr(src, name) for name in ARRAYS}
    _, labels = samples.feed(np.zeros((10, 1), np.float32), np.arange(10) * 3, batch, seed=1)
    assert labels is not None
    # every query's labels, its first sample predicted wrong
    top1 = np.array([labels(i) for i in range(n)], np.int32)
    top1[:, 0] += 1
    cols["top1"] = top1
    errors = {7: "boom", 4999: "late"}
    msgs = rows_messages("ev-x", 0, cols, errors, seq=0, max_bytes=64 << 10, final=True, queries=n)
    assert len(msgs) > 5 and all(len(m) <= 64 << 10 for m in msgs)
    got = RowCollector(
        RunRecord(n=1, batch_size=batch), labels, agent_description("a"), max_bytes=64 << 10
    )
    for m in msgs:
        got.add(codec.decode_model(RunRows, m))
    last = codec.decode_model(RunRows, msgs[-1])
    assert last.final and not codec.decode_model(RunRows, msgs[0]).final
    assert got.finish(last) == ()
    rec = got.rec
    assert rec.n == n and rec.errors == errors
    for name in ARRAYS[:-2]:  # correct and prediction are the server's own scoring
        np.testing.assert_array_equal(getattr(rec, name), getattr(src, name), err_msg=name)
    np.testing.assert_array_equal(rec.correct, np.where(src.ok == 1, batch - 1, 0))
    np.testing.assert_array_equal(rec.prediction, np.where(src.ok == 1, top1[:, 0], -1))


def test_rows_of_an_overloaded_run_ship_in_few_messages_each_under_the_payload() -> None:
    """An overloaded run refuses most of its queries, each with its error: its rows
    still ship in about as many messages as their bytes need, each under the payload
    (a row's error counted with its row, long and non-ASCII ones too), every row and
    error once. Budgeting every error into every message made one message per row,
    each looking through all the errors: hours for a million rows."""
    from agent.runrows import rows_messages
    from mlscope import codec
    from mlscope.contracts import RunRows
    from mlscope.record import ARRAYS, RunRecord

    n, limit = 120_000, 256 << 10
    cols = {name: getattr(RunRecord(n=n, batch_size=1), name) for name in ARRAYS}
    cols["top1"] = np.zeros((n, 1), np.int32)
    errors = {i: "overloaded" for i in range(0, n, 1) if i % 7}
    errors |= {5: "é" * 3000, n - 1: "x" * 5000}
    msgs = rows_messages(
        "ev-x",
        1000,
        cols,
        {i + 1000: e for i, e in errors.items()},
        seq=3,
        max_bytes=limit,
        final=True,
        queries=n,
    )
    total = sum(len(m) for m in msgs)
    assert all(len(m) <= limit for m in msgs)
    assert len(msgs) <= total / (0.75 * limit) + 1, (len(msgs), total)  # most are full
    got = [codec.decode_model(RunRows, m) for m in msgs]
    assert [m.seq for m in got] == list(range(3, 3 + len(got)))
    assert [m.start for m in got] == [1000, *(m.start + len(m.columns["ok"]) for m in got[:-1])]
    assert sum(len(m.columns["ok"]) for m in got) == n and got[-1].final
    shipped = {i - 1000: e for m in got for i, e in m.errors.items()}
    assert shipped == errors


def test_an_overloaded_run_in_the_agent_ships_its_refusals_and_the_agent_stays(
    placement_stack: Stack,
) -> None:
    """An open loop far past what the model answers: most of its queries are refused,
    each with its error. Its rows reach the server and the agent goes on answering:
    its event loop was held shipping them (its registry entry expired, and it was
    'lost' to every later job)."""
    spec = ScenarioSpec(name="online", qps=60_000, duration_s=1.5, **LOOSE)
    job = JobRequest(
        model="digits_cnn",
        framework="onnxruntime",
        scenario=spec,
        trace_level="none",
        placement="agent",
    )
    s = run(placement_stack.settings, job)
    assert s.status == "completed" and s.lost == 0, s.invalid_reasons
    assert s.refused > s.queries // 2 and s.queries + s.not_issued > 80_000, s
    assert any(r.startswith("refused") or "refused" in r for r in s.invalid_reasons)
    again = run(placement_stack.settings, digits("agent", 5))  # the agent still serves
    assert again.queries == 5 and again.errors == 0, again.invalid_reasons


def test_a_batch_over_the_bus_payload_runs_in_the_agent(placement_stack: Stack) -> None:
    """efficientnet_lite0 at batch 8 is ~4.8 MB a query: refused through the bus (1 MiB
    max payload), measured in the agent, where no query crosses it."""
    spec = ScenarioSpec(name="batched", batch_size=8, max_queries=3, duration_s=60, **LOOSE)

    def job(placement: str) -> JobRequest:
        return JobRequest(
            model="efficientnet_lite0",
            framework="onnxruntime",
            scenario=spec,
            trace_level="none",
            placement=placement,  # type: ignore[arg-type]
        )

    with pytest.raises(ConfigError, match="over the bus's max payload"):
        run(placement_stack.settings, job("server"))
    s = run(placement_stack.settings, job("agent"))
    assert s.placement == "agent" and s.queries == 3 and s.samples == 24 and s.errors == 0


@pytest.mark.parametrize(
    "fields",
    [
        {"scenario": "batched"},
        {"scenario": {"name": ["batched"]}},
        {"scenario": {"name": "x" * 100_000}},
        {"scenario": {"name": "batched", "loadgens": "many"}},
        {"scenario": {"name": "batched", "loadgen_hosts": {"a": 1}}},
        {"scenario": {"name": "batched"}, "placement": 7},
        {"scenario": {"name": "batched"}, "mlperf": [1, 2]},
        {"scenario": None},
    ],
)
def test_hostile_jobs_meet_the_default_placement_as_validation_errors(
    fields: dict[str, Any],
) -> None:
    """Whatever a decoded job carries, choosing its default placement never raises
    anything but the contract's own ValidationError."""
    with pytest.raises(ValidationError):
        JobRequest.model_validate({"model": "noop", "framework": "noop", **fields})
