"""Processes killed outright leave no child running: ``mlscope up``'s nats-server,
server and agents, and the LoadGen process of an MLPerf test in the server or in the
agent, end with the process that started them, and the stack starts again where the
killed one ran."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cli.stack import Stack
from mlscope.natsserver import free_port
from mlscope.settings import Settings
from tests.conftest import LOOSE_FLAGS, child_env, make_data_dir, running_stack

BIN = Path(sys.executable).parent
MLSCOPE, SUBMIT = BIN / "mlscope", BIN / "mlscope-submit"

LONG_CONF = "digits_cnn.SingleStream.min_duration = 120000\n"
"""An MLPerf test that runs long past the moment its parent is killed."""


def children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``, with their command lines."""
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # ended meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out[int(entry.name)] = cmd
    return out


def alive(pid: int) -> bool:
    """Running (a zombie has ended: it waits only for its parent to read its code)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def left_running(pids: list[int], within: float = 30.0) -> list[int]:
    """Those of ``pids`` still running after ``within`` s (a generous deadline)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def child_of(pid: int, marker: str, within: float = 90.0) -> int:
    """The child of ``pid`` whose command line has ``marker``, once it runs."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = [c for c, cmd in children(pid).items() if marker in cmd]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no child of {pid} runs {marker} within {within} s")


SHORT = ("--qps", "500", "--duration", "2", *LOOSE_FLAGS)
"""A short job under loose rules (what is tested is not speed): 1,000 queries, enough
for a p99 estimate by early stopping."""
NOOP = ("--frameworks", "noop")
READY = ("ready: taking jobs", "ready: noop")
"""What the server and the noop agent log once they serve."""


@contextmanager
def up(data: Path, port: int, log: Path, *flags: str) -> Iterator[subprocess.Popen[bytes]]:
    """``mlscope up`` (a noop agent, and ``flags``) as an operator runs it, until its
    agent and server are ready; killed at the end if the test left it running."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [str(MLSCOPE), "up", "--nats-port", str(port), "--data-dir", str(data), *NOOP, *flags],
            env=child_env(Settings(data_dir=data)),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 90.0
        while not all(line in log.read_text() for line in READY):  # what it says
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        yield proc
    finally:
        kids = list(children(proc.pid))
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
        for pid in left_running(kids, 30.0):  # only ever after a failed assertion
            os.kill(pid, signal.SIGKILL)


def test_a_killed_mlscope_up_leaves_no_process_and_starts_again(
    tmp_path: Path, zoo_dir: Path
) -> None:
    data, port = make_data_dir(tmp_path / "data", zoo_dir), free_port()
    log = tmp_path / "up.log"
    with up(data, port, log) as first:
        kids = children(first.pid)
        assert len(kids) == 3, kids  # nats-server, the server, the agent
        first.kill()
        first.wait()
        assert left_running(list(kids)) == [], log.read_text()[-3000:]
    log = tmp_path / "up-again.log"
    with up(data, port, log) as second:  # the same port and data dir: nothing held them
        kids = children(second.pid)
        job = subprocess.run(
            [str(SUBMIT), "noop", "--framework", "noop", "--json", *SHORT],
            env=child_env(Settings(nats_url=f"nats://127.0.0.1:{port}", data_dir=data)),
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert job.returncode == 0, job.stderr
        summary = json.loads(job.stdout)
        assert summary["valid"] is True, (summary["invalid_reasons"], log.read_text()[-3000:])
        assert summary["queries"] > 0 and summary["errors"] == summary["lost"] == 0, summary
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0
        assert left_running(list(kids)) == []


def mlperf_in_background(stack: Stack, tmp_path: Path, placement: str) -> subprocess.Popen[str]:
    tmp_path.mkdir(exist_ok=True)
    conf = tmp_path / "user.conf"
    conf.write_text(LONG_CONF)
    return subprocess.Popen(
        [
            *(str(MLSCOPE), "mlperf", "digits_cnn", "--framework", "onnxruntime"),
            *("--scenario", "SingleStream", "--user-conf", str(conf), "--placement", placement),
            *("--output", str(tmp_path / "out"), "--json"),
        ],
        env=child_env(stack.settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize(
    ("placement", "killed", "loadgen"),
    [
        ("server", "server", "broker.mlperf_sut"),
        ("agent", "agent:onnxruntime", "agent.mlperf_local"),
    ],
)
def test_the_loadgen_process_of_a_killed_parent_ends(
    tmp_path: Path, zoo_dir: Path, placement: str, killed: str, loadgen: str
) -> None:
    with running_stack(tmp_path / "stack", zoo_dir, ["onnxruntime"]) as stack:
        submitter = mlperf_in_background(stack, tmp_path, placement)
        try:
            parent = stack.children[killed]
            child = child_of(parent.pid, loadgen)
            parent.kill()
            parent.wait()
            assert left_running([child]) == []
        finally:
            submitter.kill()
            submitter.communicate()


def test_an_interrupted_mlperf_run_is_cancelled_on_the_server(
    tmp_path: Path, zoo_dir: Path
) -> None:
    """Ctrl-C (130) or SIGTERM (143) on ``mlscope mlperf`` cancels its job, as on
    ``mlscope-submit``: the LoadGen test ends instead of holding the agent for its run."""
    with running_stack(tmp_path / "stack", zoo_dir, ["onnxruntime"]) as stack:
        for signum, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
            submitter = mlperf_in_background(stack, tmp_path / signum.name, "server")
            try:
                child = child_of(stack.children["server"].pid, "broker.mlperf_sut")
                submitter.send_signal(signum)
                _, err = submitter.communicate(timeout=60)
                assert submitter.returncode == code, err
                assert "stored as cancelled" in err, err
                assert left_running([child]) == []
            finally:
                submitter.kill()
                submitter.communicate()
