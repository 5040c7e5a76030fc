"""An agent lost mid-run: killed, or restarted under its id, the run is one INVALID
evaluation with its queries, lost rather than overloaded."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading

import anyio
import pytest

from cli.summary_text import format_summary
from mlscope import bus as busmod
from mlscope import remote
from mlscope.contracts import EvaluationSummary, JobEvent, JobRequest, ScenarioSpec
from mlscope.jobs import submit
from mlscope.registry import list_agents
from mlscope.settings import Settings
from tests.conftest import (
    agent_and_server,
    child_env,
    evaluations_of,
    python,
)

pytestmark = pytest.mark.timeout(240)


def signalled_mid_run(
    settings: Settings, agent: subprocess.Popen[bytes], sig: signal.Signals
) -> tuple[JobRequest, EvaluationSummary]:
    """A 4 s Poisson run of the noop agent, which gets ``sig`` once 150 queries are
    answered: the job and its summary."""
    job = JobRequest(
        model="noop",
        framework="noop",
        scenario=ScenarioSpec(name="online", qps=200, duration_s=4),
    )

    def on_event(e: JobEvent) -> None:
        if e.event == "progress" and e.queries_done >= 150 and agent.poll() is None:
            agent.send_signal(sig)

    summary = anyio.run(
        lambda: submit(settings, job, on_event=on_event, timeout=120), backend="asyncio"
    )
    return job, summary


def paused_for_3_s(
    settings: Settings, agent: subprocess.Popen[bytes], job: JobRequest, after: int
) -> EvaluationSummary:
    """``job``'s summary, its agent stopped (SIGSTOP) for 3 s once ``after`` queries
    are answered, then continued."""
    woken = threading.Timer(3.0, agent.send_signal, (signal.SIGCONT,))

    def on_event(e: JobEvent) -> None:
        if e.event == "progress" and e.queries_done >= after and not woken.ident:
            agent.send_signal(signal.SIGSTOP)
            woken.start()

    try:
        summary = anyio.run(
            lambda: submit(settings, job, on_event=on_event, timeout=120), backend="asyncio"
        )
    finally:
        if woken.is_alive():
            woken.join(10)
        agent.send_signal(signal.SIGCONT)
    assert woken.finished.is_set(), "the agent was never paused"
    return summary


def test_agent_killed_mid_run_gives_one_invalid_evaluation_with_its_queries(
    settings: Settings,
) -> None:
    with agent_and_server(settings, "--framework", "noop", "--agent-id", "doomed") as (
        agent,
        server,
    ):
        job, summary = signalled_mid_run(settings, agent, signal.SIGKILL)
        assert not summary.valid and agent.poll() is not None
        lost = [r for r in summary.invalid_reasons if r.startswith("agent doomed lost after")]
        assert lost, summary.invalid_reasons
        answered = int(lost[0].split(" after ")[1].split(" of ")[0])
        total = int(lost[0].split(" of ")[1].split()[0])
        assert 150 <= answered < total
        # Its queries went unanswered because it was gone, not because it was slow.
        assert not any(r.startswith("overloaded") for r in summary.invalid_reasons)
        assert any(r.startswith("stopped answering at t=") for r in summary.invalid_reasons)

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
        assert anyio.run(evaluations_of, settings, job.job_id, backend="asyncio") == [
            summary.evaluation_id
        ]
        assert server.poll() is None


def test_a_paused_agent_is_said_to_have_stopped_answering_not_to_be_overloaded(
    settings: Settings,
) -> None:
    """SIGSTOP part way through a Poisson run: no answer comes after the pause. What the
    user reads (the summary printed by mlscope-submit, the stored run listed by
    ``mlscope runs``) says when the agent stopped answering and how many queries it
    left unanswered; "overloaded" would blame the speed of a system that was not there."""
    with agent_and_server(settings, "--framework", "noop", "--agent-id", "frozen") as (
        agent,
        _server,
    ):
        try:
            _, summary = signalled_mid_run(settings, agent, signal.SIGSTOP)
        finally:
            agent.kill()  # a stopped process dies of SIGKILL
            agent.wait(20)
        text = format_summary(summary)
        assert "INVALID" in text and "stopped answering at t=" in text, text
        assert "overloaded" not in text, text
        listed = subprocess.run(
            [python(), "-m", "cli.main", "runs", "--json"],
            env=child_env(settings),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        rows = [json.loads(line) for line in listed.stdout.splitlines()]
        (row,) = [r for r in rows if r["evaluation_id"] == summary.evaluation_id]
        reasons = row["invalid_reasons"]  # as listed: joined with "; "
        assert "overloaded" not in reasons, reasons
        stopped = re.search(
            r"stopped answering at t=([\d.]+) s \(its last answer\): (\d+) ", reasons
        )
        assert stopped is not None, reasons
        at_s, unanswered = float(stopped[1]), int(stopped[2])
        assert 0.5 < at_s < 4 and 0 < unanswered <= summary.lost, (stopped, summary.lost)


@pytest.mark.parametrize(
    ("duration_s", "stop_after"), [(8, 100), (4, 180)], ids=["mid-run", "across-the-end"]
)
def test_an_agent_paused_mid_run_is_said_to_have_paused_not_to_be_overloaded(
    settings: Settings, duration_s: float, stop_after: int
) -> None:
    """SIGSTOP for 3 s once ``stop_after`` queries of a 60 QPS Poisson run are answered,
    then SIGCONT: the agent answers every query, late (the ~180 sent in the pause fit
    its admission bound), mid-run or, across the end of the load, while the load
    generator waits. The verdict says when it did not answer and how many queries were
    sent then (look at the host or the link); "overloaded" would send the user to tune
    a model that kept up whenever it ran."""
    job = JobRequest(
        model="noop",
        framework="noop",
        scenario=ScenarioSpec(name="online", qps=60, duration_s=duration_s),
    )
    with agent_and_server(settings, "--framework", "noop", "--agent-id", "napping") as (
        agent,
        _server,
    ):
        summary = paused_for_3_s(settings, agent, job, stop_after)
        reasons = summary.invalid_reasons
        assert not summary.valid and summary.errors == 0, reasons
        paused = [r for r in reasons if r.startswith("did not answer from t=")]
        assert len(paused) == 1, reasons
        when = re.match(
            r"did not answer from t=([\d.]+) s to t=([\d.]+) s \((\d+) queries", paused[0]
        )
        assert when is not None, paused
        start, end, sent = float(when[1]), float(when[2]), int(when[3])
        # About 3 s; 60 QPS were sent in it up to the end of the load.
        assert 2.5 < end - start < 8 and 20 <= sent <= 100 * (end - start), paused
        assert not any("overloaded" in r for r in reasons), reasons
        assert not any(r.startswith("stopped answering") for r in reasons), reasons


def test_an_agent_paused_in_a_closed_loop_is_said_to_have_paused(settings: Settings) -> None:
    """Single-stream: SIGSTOP for 3 s once 500 queries are answered, then SIGCONT. The
    one query in flight waits out the pause and the loop goes on, so no percentile the
    verdict reads moves; the verdict says when the agent did not answer. (In placement
    agent the loop is frozen with the agent: a pause between two queries leaves none
    waiting, so only the pure tests pin that placement's rule.)"""
    job = JobRequest(
        model="noop",
        framework="noop",
        scenario=ScenarioSpec(name="single-stream", duration_s=6),
        placement="server",
    )
    with agent_and_server(settings, "--framework", "noop", "--agent-id", "dozing") as (
        agent,
        _server,
    ):
        summary = paused_for_3_s(settings, agent, job, 500)
        reasons = summary.invalid_reasons
        assert not summary.valid and summary.errors == 0, reasons
        (paused,) = [r for r in reasons if r.startswith("did not answer from t=")]
        when = re.match(r"did not answer from t=([\d.]+) s to t=([\d.]+) s \((\d+) queries", paused)
        assert when is not None, paused
        assert 2.5 < float(when[2]) - float(when[1]) < 8 and int(when[3]) <= 1, paused
        assert not any(r.startswith("stopped answering") for r in reasons), reasons


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
