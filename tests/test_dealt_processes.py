"""A run dealt to load-generator processes (``loadgens = K``) when one of them fails,
never starts, or hears a cancel later than the others: real nats-server, server, noop
agent and the server's own ``python -m broker.distributed`` children.

Timing is never asserted beyond "well before the schedule would have ended"."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest

from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import remote
from mlscope.api import cancel_job
from mlscope.contracts import EvaluationSummary, JobEvent, JobRequest, ScenarioSpec
from mlscope.errors import MLScopeError
from mlscope.jobs import submit
from mlscope.outcomes import Outcome
from mlscope.settings import Settings
from tests.conftest import LOOSE, running_stack

pytestmark = pytest.mark.timeout(300)

READY_S = 20.0
"""This module's readiness limit for load-generator processes (60 s by default), which
the test of a process that never starts waits out; one starts in a second or two."""


@pytest.fixture(scope="module")
def noop_stack(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[Stack]:
    """A noop stack whose server gives its load-generator processes ``READY_S``."""
    ready = Settings(loadgen_ready_s=READY_S)
    with running_stack(
        tmp_path_factory.mktemp("noopstack"), zoo_dir, ["noop"], settings=ready
    ) as s:
        yield s


def load_generators(stack: Stack, j: int) -> set[int]:
    """The pids of the server's running load-generator processes of slice ``j``."""
    server = stack.children["server"].pid
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if (
                ppid == server
                and b"broker.distributed" in cmd
                and any(c.endswith(f"/lg{j}.json".encode()) for c in cmd)
            ):
                found.add(int(entry.name))
    return found


def new_load_generator(stack: Stack, j: int, known: set[int], timeout: float = 60) -> int:
    """The pid of the first load-generator process of slice ``j`` not in ``known``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fresh := load_generators(stack, j) - known:
            return min(fresh)
        time.sleep(0.005)
    raise TimeoutError(f"no load-generator process of slice {j}")


@contextlib.contextmanager
def resumed(pid: int) -> Iterator[None]:
    """A process this test stopped is let go again, however the test ends."""
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def stored_outcomes(stack: Stack, evaluation_id: str) -> np.ndarray:
    """(query_index, outcome) of every stored query, in index order."""

    async def go() -> list[list[object]]:
        async with busmod.connect(stack.settings, name="test") as bus:
            sql = (
                "SELECT query_index, outcome FROM queries FINAL "
                "WHERE evaluation_id = {e:String} ORDER BY query_index"
            )
            return (await remote.sql(bus, sql, {"e": evaluation_id}))[1]

    return np.asarray(anyio.run(go, backend="asyncio"), dtype=np.int64).reshape(-1, 2)


def job_of(spec: ScenarioSpec) -> JobRequest:
    return JobRequest(model="noop", framework="noop", scenario=spec, trace_level="none")


@pytest.mark.parametrize("victim", [0, 1])
def test_a_process_killed_mid_run_ends_the_run_at_once_naming_it(
    noop_stack: Stack, victim: int
) -> None:
    """The others' slices are not run to the end of a 60 s schedule for a run that
    cannot be whole: the job fails within seconds, naming the slice."""
    job = job_of(ScenarioSpec(name="online", qps=100, duration_s=60, loadgens=2, **LOOSE))
    going = threading.Event()

    def seen(event: JobEvent) -> None:
        if event.event == "progress" and event.queries_done > 0:
            going.set()

    known = load_generators(noop_stack, victim)

    def kill() -> None:
        pid = new_load_generator(noop_stack, victim, known)
        going.wait(60)
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill)
    killer.start()
    began = time.monotonic()
    with pytest.raises(MLScopeError) as failed:
        anyio.run(
            lambda: submit(noop_stack.settings, job, on_event=seen, timeout=180),
            backend="asyncio",
        )
    killer.join()
    assert f"slice {victim}" in str(failed.value), failed.value
    assert "exit code -9" in str(failed.value), failed.value
    assert time.monotonic() - began < 45, "the other slice ran its 60 s schedule out"


def test_a_process_that_never_starts_fails_the_run_naming_it(noop_stack: Stack) -> None:
    """A load-generator process that never says ``ready`` (stopped as it starts) fails
    the run after the readiness limit the server was given, instead of holding the job
    for good."""
    job = job_of(ScenarioSpec(name="online", qps=50, duration_s=2, loadgens=2, **LOOSE))
    stopped: list[int] = []
    known = load_generators(noop_stack, 1)

    def stop() -> None:
        pid = new_load_generator(noop_stack, 1, known)
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    stopper = threading.Thread(target=stop)
    stopper.start()
    try:
        with pytest.raises(MLScopeError) as failed:
            anyio.run(lambda: submit(noop_stack.settings, job, timeout=150), backend="asyncio")
    finally:
        stopper.join()
        for pid in stopped:
            with resumed(pid):
                pass
    assert "slice 1" in str(failed.value) and "not ready" in str(failed.value), failed.value
    assert f"after {READY_S:g} s (MLSCOPE_LOADGEN_READY_S)" in str(failed.value), failed.value
    assert stopped and not load_generators(noop_stack, 1) & set(stopped)  # killed, not left


def test_a_cancel_heard_late_by_one_process_stores_no_query_as_not_issued(
    noop_stack: Stack,
) -> None:
    """Process 1 is stopped while the cancel reaches process 0, then let go: it sends
    the queries that fell due meanwhile before it hears the stop. The stored rows end
    where process 0 stopped, so none of its later queries (never due to it) is stored
    as not issued, and the summary's counts are its rows'."""
    job = job_of(ScenarioSpec(name="online", qps=100, duration_s=60, loadgens=2, **LOOSE))
    going = threading.Event()

    def seen(event: JobEvent) -> None:
        if event.event == "progress" and event.queries_done > 20:
            going.set()

    known = load_generators(noop_stack, 1)

    def cancel_while_one_is_stopped() -> None:
        pid = new_load_generator(noop_stack, 1, known)
        going.wait(60)
        with resumed(pid):
            os.kill(pid, signal.SIGSTOP)
            threading.Thread(
                target=lambda: anyio.run(
                    lambda: cancel_job(noop_stack.settings, job.job_id, timeout=60),
                    backend="asyncio",
                )
            ).start()
            time.sleep(1.0)  # process 0 stops; process 1's queries fall due

    canceller = threading.Thread(target=cancel_while_one_is_stopped)
    canceller.start()
    s: EvaluationSummary = anyio.run(
        lambda: submit(noop_stack.settings, job, on_event=seen, timeout=180), backend="asyncio"
    )
    canceller.join()
    assert s.status == "cancelled", s
    got = stored_outcomes(noop_stack, s.evaluation_id)
    assert got[:, 0].tolist() == list(range(s.queries)) and s.queries > 20, s
    kinds = np.bincount(got[:, 1], minlength=len(Outcome))
    assert kinds[Outcome.NOT_ISSUED] == 0 and s.not_issued == 0, kinds
    assert (s.lost, s.errors) == (kinds[Outcome.LOST], kinds[1:4].sum()), (s, kinds)
    sent = s.queries - s.not_issued
    assert f"{sent - s.lost} of {sent} issued queries answered" in s.invalid_reasons[0], s
    # The CPU time the processes used up to their stop, as each wrote it with its rows.
    cost = s.loadgen_cost
    assert cost is not None and cost["loadgens"] == 2 and cost["cpu_s"] > 0, cost
    assert cost["cpu_us_per_query"] == pytest.approx(cost["cpu_s"] / sent * 1e6), cost
