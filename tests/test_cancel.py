"""Cancelling a job: Ctrl-C in ``mlscope-submit`` and ``mlscope cancel JOB_ID`` stop
the run on the server promptly; the run is stored as ``cancelled`` (never a VALID
run, absent from ``mlscope runs --valid``) and the CLI says so in one line.

Real stack (nats-server, server owning chDB, noop agent); the submitter is a child
process interrupted the way a terminal does it (SIGINT; and ^C through a pty).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from broker.cancel import IN_FLIGHT, Cancels, issued_part
from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import provision, remote
from mlscope.api import cancel_job
from mlscope.contracts import JobRequest, ScenarioSpec, evaluation_id_for
from mlscope.jobs import submit
from mlscope.outcomes import Outcome
from mlscope.provision import provisioned
from mlscope.record import RunRecord
from mlscope.settings import Settings
from tests.conftest import agent_and_server, child_env, python, wait_server

pytestmark = pytest.mark.timeout(180)

SUBMIT = Path(sys.executable).parent / "mlscope-submit"
LONG = ("noop", "--framework", "noop", "--qps", "50", "--duration", "20", "--trace-level", "none")


def stored(stack: Stack, evaluation_id: str) -> list[Any] | None:
    """(status, valid, summary) of the stored evaluation, or None."""

    async def go() -> list[list[Any]]:
        async with busmod.connect(stack.settings, name="test") as bus:
            return (
                await remote.sql(
                    bus,
                    "SELECT status, valid, summary FROM evaluations FINAL "
                    "WHERE evaluation_id = {e:String}",
                    {"e": evaluation_id},
                )
            )[1]

    rows = anyio.run(go, backend="asyncio")
    return rows[0] if rows else None


def wait_stored(stack: Stack, evaluation_id: str, timeout: float = 10.0) -> list[Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = stored(stack, evaluation_id)
        if row is not None:
            return row
        time.sleep(0.2)
    raise AssertionError(f"{evaluation_id} not stored within {timeout} s")


def query_rows(stack: Stack, evaluation_id: str) -> list[list[Any]]:
    """(ok, completed_ns, error) of the stored queries of an evaluation."""

    async def go() -> list[list[Any]]:
        async with busmod.connect(stack.settings, name="test") as bus:
            return (
                await remote.sql(
                    bus,
                    "SELECT ok, completed_ns, error FROM queries FINAL "
                    "WHERE evaluation_id = {e:String} ORDER BY query_index",
                    {"e": evaluation_id},
                )
            )[1]

    return anyio.run(go, backend="asyncio")


def assert_cancelled(stack: Stack, evaluation_id: str) -> None:
    status, valid, summary = wait_stored(stack, evaluation_id)
    assert status == "cancelled" and not valid
    doc = json.loads(summary)
    assert doc["status"] == "cancelled" and doc["invalid_reasons"][0].startswith("cancelled")
    assert doc["duration_s"] < 15  # stopped, not run to its 20 s
    # The partial run's issued queries are kept as measured: ~2-3 s at 50 QPS, not 1000.
    rows = query_rows(stack, evaluation_id)
    assert 20 < len(rows) == doc["queries"] < 500, (len(rows), doc["queries"])
    assert sum(1 for ok, _, _ in rows if ok) == doc["queries"] - doc["lost"]
    assert all(err == "cancelled before its reply" for ok, done, err in rows if not done)
    listed = subprocess.run(
        [sys.executable, "-m", "cli.main", "runs", "--valid", "--json"],
        env=child_env(stack.settings),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert evaluation_id not in listed.stdout


def job_of(line: str) -> str:
    m = re.search(r"job (job-[0-9a-f]+)", line)
    assert m, line
    return m.group(1)


def interrupted_line(err: str) -> str:
    """The one line Ctrl-C leaves on stderr, after the ``job JOB accepted by SERVER``
    note of each job sent (a piped submitter names its jobs too): the cancelled job is
    one of those."""
    *notes, last = err.strip().splitlines()
    assert "Traceback" not in err, err
    assert all(re.fullmatch(r"job job-[0-9a-f]+ accepted by \S+", n.strip()) for n in notes), err
    assert job_of(last) in {job_of(n) for n in notes}, err
    return last


def interrupt(
    stack: Stack, argv: list[str], signum: int, *, after_s: float = 3.0
) -> tuple[int, str]:
    """Run ``argv`` for ``after_s`` (its job runs by then), send it ``signum``: its exit
    code and stderr, once it exited within 2 s of the signal with nothing on stdout."""
    proc = subprocess.Popen(
        argv,
        env=child_env(stack.settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(after_s)
    assert proc.poll() is None, proc.communicate()
    sent = time.monotonic()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=10)
    assert time.monotonic() - sent < 2.0, err
    assert out == "" and "Traceback" not in err, err
    return proc.returncode, err


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_sigint_cancels_the_job_on_the_server(noop_stack: Stack, signum: int, code: int) -> None:
    """Ctrl-C, and SIGTERM (a supervisor's stop, `timeout`, a cancelled CI job), cancel
    the job on the server: it does not go on holding the agent for its whole run."""
    got, err = interrupt(noop_stack, [str(SUBMIT), *LONG, "--json"], signum)
    assert got == code, err
    line = interrupted_line(err)
    assert "cancelled" in line and "stored as cancelled" in line, line
    assert_cancelled(noop_stack, evaluation_id_for(job_of(line)))


def evaluations_stored(stack: Stack) -> int:
    async def go() -> list[list[Any]]:
        async with busmod.connect(stack.settings, name="test") as bus:
            return (await remote.sql(bus, "SELECT count() FROM evaluations FINAL"))[1]

    return int(anyio.run(go, backend="asyncio")[0][0])


@pytest.mark.parametrize("several", [("--repeat", "3"), ("--all-agents",)])
def test_sigint_cancels_the_running_job_of_several(
    noop_stack: Stack, several: tuple[str, ...]
) -> None:
    """With --repeat (or --all-agents) Ctrl-C cancels the job then running on the server
    and sends none of the rest: one more evaluation, stored as cancelled."""
    before = evaluations_stored(noop_stack)
    code, err = interrupt(noop_stack, [str(SUBMIT), *LONG, *several, "--json"], signal.SIGINT)
    assert code == 130, err
    line = interrupted_line(err)
    assert "stored as cancelled" in line, err
    assert_cancelled(noop_stack, evaluation_id_for(job_of(line)))
    assert evaluations_stored(noop_stack) == before + 1  # nothing else was stored


def test_a_stopped_rerun_or_suite_run_cancels_its_job(noop_stack: Stack) -> None:
    """``mlscope rerun`` and ``mlscope report --suite --run`` stopped by SIGTERM (or
    Ctrl-C) cancel the job they are running on the server, as the submitter does, and
    the suite sends none of the rest."""
    code, err = interrupt(noop_stack, [str(SUBMIT), *LONG, "--json"], signal.SIGINT)
    assert code == 130
    original = evaluation_id_for(job_of(interrupted_line(err)))  # a stored 20 s run
    cli = [sys.executable, "-m", "cli.main"]
    before = evaluations_stored(noop_stack)
    rerun = [*cli, "rerun", original, "--json"]
    code, err = interrupt(noop_stack, rerun, signal.SIGTERM, after_s=4.0)
    assert code == 143, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("mlscope rerun: interrupted; job job-"), err
    assert line.endswith("stored as cancelled"), err
    assert_cancelled(noop_stack, evaluation_id_for(job_of(line)))
    suite = ["report", "--suite", "--run", "--models", "noop/noop", "--qps", "50"]
    suite += ["--duration", "20", "--batch-sizes", "1,2"]  # three jobs: one runs
    code, err = interrupt(noop_stack, [*cli, *suite], signal.SIGINT, after_s=4.0)
    assert code == 130, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("mlscope report: interrupted; job job-"), err
    assert line.endswith("stored as cancelled"), err
    assert_cancelled(noop_stack, evaluation_id_for(job_of(line)))
    assert evaluations_stored(noop_stack) == before + 2  # the rerun's and the suite's first


def test_ctrl_c_on_a_terminal(noop_stack: Stack) -> None:
    """^C typed into the submitter's terminal: the progress line, then one line."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: mlscope-submit on the pty as its controlling terminal
        os.execve(str(SUBMIT), [str(SUBMIT), *LONG], child_env(noop_stack.settings))
    output = b""

    def read_for(seconds: float) -> None:
        nonlocal output
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                return
            if not chunk:
                return
            output += chunk

    try:
        read_for(3.0)
        assert b"accepted by" in output, output
        sent = time.monotonic()
        os.write(fd, b"\x03")
        read_for(4.0)
        _, status = os.waitpid(pid, 0)
        took = time.monotonic() - sent
    finally:
        os.close(fd)
    text = output.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 130, text
    assert took < 4.5 and "Traceback" not in text, text
    last = [x for x in re.split(r"[\r\n]+", text) if x.strip()][-1]
    assert last.startswith("mlscope-submit: interrupted; job "), text
    assert_cancelled(noop_stack, evaluation_id_for(job_of(last)))


def test_mlscope_cancel_stops_a_running_job(noop_stack: Stack) -> None:
    job = JobRequest(
        model="noop",
        framework="noop",
        trace_level="none",
        scenario=ScenarioSpec(name="online", qps=50, duration_s=20),
    )
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            lambda: anyio.run(lambda: submit(noop_stack.settings, job), backend="asyncio")
        )
        time.sleep(3.0)
        done = subprocess.run(
            [sys.executable, "-m", "cli.main", "cancel", job.job_id],
            env=child_env(noop_stack.settings),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert f"cancelled job {job.job_id}" in done.stdout
        summary = waiting.result(timeout=10)  # the submitter hears "cancelled"
    assert summary.status == "cancelled" and not summary.valid
    assert_cancelled(noop_stack, evaluation_id_for(job.job_id))


def test_cancel_of_no_running_job_says_so(noop_stack: Stack) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "cancel", "job-000000000000", "--timeout", "1"],
        env=child_env(noop_stack.settings),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "no server is running job job-000000000000" in done.stderr


def test_issued_part_keeps_what_was_sent() -> None:
    """The stored rows of a cancelled run end at its last issued query; one in flight
    is lost, saying it was cancelled; answered ones keep their times."""
    rec = RunRecord(n=10, batch_size=1, t0_ns=123, warmup=2)
    rec.scheduled[:] = np.arange(1, 11) * 1000
    rec.issued[:4] = rec.scheduled[:4]
    rec.completed[:3] = rec.issued[:3] + 50
    rec.ok[:3] = 1
    part = issued_part(rec)
    assert part.n == 4 and part.t0_ns == 123 and part.warmup == 2 and part.done == 3
    assert list(part.outcomes()) == [Outcome.OK] * 3 + [Outcome.LOST]
    assert part.errors == {3: IN_FLIGHT}
    assert issued_part(RunRecord(n=5, batch_size=1)).n == 0


def test_a_cancel_outlives_the_server_that_heard_it(settings: Settings, tmp_path: Path) -> None:
    """A job cancelled before any server took it is stored as cancelled, unrun, by a
    server started after the request (the first one, which heard it, is gone). The
    server says on its terminal when it takes jobs."""
    job = JobRequest(
        model="noop",
        framework="noop",
        trace_level="none",
        scenario=ScenarioSpec(name="online", qps=50, duration_s=20),
    )
    with agent_and_server(settings, "--framework", "noop") as (_agent, first):
        anyio.run(wait_server, settings)
        reply = anyio.run(
            lambda: cancel_job(settings, job.job_id, reason="not wanted", timeout=1.0),
            backend="asyncio",
        )
        assert reply is None  # nobody runs it: heard, remembered, unanswered
        first.terminate()
        first.wait(20)
        log = tmp_path / "server.log"
        with log.open("wb") as out:
            later = subprocess.Popen(
                [python(), "-m", "cli.main", "server"], env=child_env(settings), stderr=out
            )
        try:
            anyio.run(wait_server, settings)
            summary = anyio.run(lambda: submit(settings, job, timeout=60), backend="asyncio")
        finally:
            later.terminate()
            later.wait(20)
    assert summary.status == "cancelled" and not summary.valid
    assert summary.queries == 0 and "not wanted" in summary.invalid_reasons[0]
    assert re.search(r"server \S+ ready: taking jobs", log.read_text()), log.read_text()[-2000:]


def test_remembered_cancels_are_bounded_and_forget_the_oldest(tmp_path: Path) -> None:
    """Any submitter may cancel any id, and cancels of jobs no server runs are kept for
    a week: the bucket keeps at most CANCELS_MAX_BYTES, drops the oldest when full (a
    full key-value bucket would refuse the next real cancel instead), and refuses a
    value larger than any cancel; provisioning twice changes nothing."""
    from mlscope import names
    from mlscope.natsserver import NatsServer
    from mlscope.settings import Settings

    async def main() -> None:
        with NatsServer(store_dir=tmp_path / "nats") as ns:
            settings = Settings(nats_url=ns.url, data_dir=tmp_path / "data")
            for _ in range(2):
                async with provisioned(settings, name="t") as bus:
                    info = await bus.js.stream_info(f"KV_{names.CANCELS_BUCKET}")
                    cfg = info.config
                    assert cfg.max_bytes == provision.CANCELS_MAX_BYTES
                    assert cfg.discard == "old"  # DiscardPolicy.OLD, as the server reports it
                    assert cfg.max_msg_size == provision.CANCEL_MAX_MSG_BYTES
                    kv = await bus.kv(names.CANCELS_BUCKET)
                    await kv.put("job-1", b"x" * 1024)  # the longest reason a server writes
                    with pytest.raises(Exception, match="message size exceeds maximum"):
                        await kv.put("job-2", b"x" * 8192)

    anyio.run(main)


def test_a_cancel_of_a_job_taken_but_not_yet_running_waits_for_its_end() -> None:
    """A server takes a job, then checks for a stored result (or cleans up a lost
    attempt) before its run starts. A cancel heard then is answered once the job has
    ended, cancelled as its run starts, not with "no server runs it"."""
    cancels = Cancels()
    assert cancels.request("job-free", "stop") is None  # not taken here: not answered

    async def main() -> None:
        ended = cancels.request("job-1", "stop", taken=True)
        assert ended is not None and not ended.is_set()
        with cancels.running("job-1") as scope:
            await anyio.sleep(5)  # a run: cancelled at once
        assert scope.cancelled_caught
        cancels.finish("job-1")
        assert ended.is_set()

    anyio.run(main)
