"""Who else used the agent's host while an evaluation ran: the agent's counters checked
against a burner process's own CPU time (an independent measurement of the same
thing), its own work counted out, and what the summary says of them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.hostload import HostCpu, between, read_host_cpu
from agent.service import Agent, AgentConfig
from broker.evalsummary import host_warnings, release_figures
from mlscope import bus as busmod
from mlscope.catalog import Catalog
from mlscope.contracts import ReleaseReply
from mlscope.settings import Settings
from tests.agent_fixtures import Ask, run_agent
from tests.pipeline_fixtures import digits_entry

pytestmark = pytest.mark.timeout(120)

BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\n"


def test_the_host_counters_are_read_and_differenced(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 20 30 4000 50 6 7 8 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    got = read_host_cpu(stat)
    hz = os.sysconf("SC_CLK_TCK")
    assert got is not None and got.busy_s == pytest.approx(163 / hz)
    assert got.steal_s == pytest.approx(8 / hz)
    for bad in ("", "cpu 1 2\n", "intr 1 2 3 4 5 6 7 8 9\n", "cpu a b c d e f g h\n"):
        stat.write_text(bad)
        assert read_host_cpu(stat) is None, bad
    assert read_host_cpu(tmp_path / "missing") is None
    a = HostCpu(busy_s=10.0, steal_s=1.0, own_s=2.0, at_s=100.0)
    b = HostCpu(busy_s=13.0, steal_s=1.5, own_s=4.5, at_s=102.0)
    use = between(a, b)
    assert (use.other_cpu_s, use.steal_s, use.window_s) == (0.5, 0.5, 2.0)
    # Counters that tick at different moments never make a negative figure.
    assert between(a, HostCpu(busy_s=10.0, steal_s=1.0, own_s=3.0, at_s=101.0)).other_cpu_s == 0


def test_an_agent_counts_what_other_processes_used_and_not_its_own(
    settings: Settings, zoo_dir: Path
) -> None:
    """A burner process spins 1.5 s of CPU while the evaluation is prepared, and the
    agent's own process spins 4 s on a thread of its own: the release says the other
    processes used at least the burner's CPU time (the kernel's count for it), and
    about what the kernel counts for every other live process over the same window
    (summed from ``/proc/<pid>/stat``), not the agent's 4 s more."""
    agent = Agent(
        settings,
        AgentConfig(framework="onnxruntime", agent_id="hostload", threads=1),
        Catalog([digits_entry()]),
    )
    burned: dict[str, float] = {}
    procs: list[subprocess.Popen[bytes]] = []

    def own_spin() -> None:
        end = time.thread_time() + 4.0
        while time.thread_time() < end:
            pass

    def burner() -> None:
        """Its CPU time from the kernel once it exited, before it is reaped: a child
        reaped by the agent's process counts as the agent's own (as a LoadGen child's
        does), so it is reaped only after the release."""
        proc = subprocess.Popen([sys.executable, "-c", BURN.format(s=1.5)])
        stat = Path(f"/proc/{proc.pid}/stat")
        while (fields := stat.read_text().rsplit(")", 1)[1].split())[0] != "Z":
            time.sleep(0.02)
        burned["cpu_s"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        procs.append(proc)

    async def body(bus: busmod.Bus, ask: Ask) -> None:
        prepare = {"op": "prepare", "evaluation_id": "ev-host", "model": "digits_cnn"}
        got = await ask({**prepare, "model_version": "1.0.0", "trace_level": "none"})
        assert got["ok"], got
        before = _others_cpu_s()
        spinning = [threading.Thread(target=f) for f in (own_spin, burner)]
        for t in spinning:
            t.start()
        for t in spinning:
            await anyio.to_thread.run_sync(t.join)
        burned["others_s"] = _others_cpu_s() - before
        released = ReleaseReply.model_validate(
            await ask({"op": "release", "evaluation_id": "ev-host", "unload": False})
        )
        replies.append(released)

    replies: list[ReleaseReply] = []
    try:
        run_agent(settings, agent, body)
    finally:
        for proc in procs:
            proc.wait()
    (released,) = replies
    other = released.host_other_cpu_s
    assert other is not None and released.host_window_s is not None
    assert burned["cpu_s"] >= 1.4
    # The burner's at least; every other process's, give or take the counters' ticks
    # and the moments between the reads (the agent's own 4 s would be far above).
    assert 0.85 * burned["cpu_s"] <= other, (other, burned)
    assert other <= burned["others_s"] + 1.0, (other, burned)
    assert released.host_window_s >= 4.0


def _others_cpu_s() -> float:
    """The CPU seconds the kernel counts for every live process but this one, with
    their reaped children's (a zombie's included: it keeps its count until reaped), so
    a short-lived process of other work that ends inside the window still counts."""
    total, me = 0, os.getpid()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == me:
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        total += sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return total / os.sysconf("SC_CLK_TCK")


def test_the_summary_says_when_other_processes_or_the_hypervisor_took_cpu() -> None:
    released: dict[str, Any] = {
        "host_other_cpu_s": 8.0,
        "host_steal_s": 1.0,
        "host_window_s": 10.0,
    }
    figures = release_figures(released, samples=100)
    assert figures["host_other_cores"] == pytest.approx(0.8)
    assert figures["host_steal_cores"] == pytest.approx(0.1)
    alone, shared = host_warnings(figures, {})
    assert alone.startswith("other processes on the agent's host kept 0.80 cores busy"), alone
    assert shared.startswith("the hypervisor took 0.10 cores from the agent's host"), shared
    # A load generator sharing the host is counted out, and said to be.
    (besides, _) = host_warnings(figures, {"shared_host": True, "busy_cores": 0.3})
    assert "kept 0.50 cores busy on average besides the load generator" in besides
    quiet = release_figures({**released, "host_other_cpu_s": 0.5, "host_steal_s": 0.0}, 100)
    assert host_warnings(quiet, {}) == ()
    assert host_warnings(release_figures({}, 100), {}) == ()  # not reported: nothing said
    assert release_figures({}, 100)["host_other_cores"] is None
