"""The zoo on any machine: other bytes served, tampered bytes refused, models fetched
from the bus, and commands that need the bus failing fast without one.

"Another CPU" is made here the way it happens: the zoo build runs with other numeric
kernels (PyTorch's AVX-512/AVX2 dispatch, oneDNN unrestricted, two threads), which
gives other bytes for the same model. Everything runs through what a user runs: the
zoo build, ``mlscope up``'s processes, ``mlscope agent``, ``mlscope-submit``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from analysis import report, report_render
from analysis.compare import compare_runs
from analysis.source import BusSource
from cli.artifacts_cmd import push_zoo
from cli.stack import Stack
from mlscope import bus as busmod
from mlscope.buildlock import BuildLock
from mlscope.contracts import AgentDescription
from mlscope.errors import BusError
from mlscope.registry import list_agents
from mlscope.settings import Settings
from mlscope.zoo.build import build
from tests.conftest import child_env, running_stack

pytestmark = pytest.mark.timeout(300)

BIN = Path(sys.executable).parent


def other_cpu() -> dict[str, str]:
    """Numeric settings of another machine: the fastest kernels this CPU runs
    (PyTorch's own dispatch, AVX2 or AVX-512, unrestricted oneDNN, two threads)
    instead of the zoo build's portable ones, which gives other bytes for the same
    model. Forcing AVX-512 would kill the build on a CPU without it (SIGILL)."""
    import torch

    return {
        "ATEN_CPU_CAPABILITY": torch.backends.cpu.get_cpu_capability().lower(),
        "ONEDNN_MAX_CPU_ISA": "ALL",
        "MKL_CBWR": "AUTO",
        "OMP_NUM_THREADS": "2",
    }


@pytest.fixture(scope="module")
def other_zoo(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Path:
    """digits_cnn built as another CPU builds it: other bytes, the pinned behaviour."""
    zoo = tmp_path_factory.mktemp("other-cpu-zoo")
    build(zoo, only=["digits_cnn"], env=other_cpu(), log=lambda _m: None)
    ours = BuildLock.read(zoo_dir / "digits_cnn" / "1.0.0")
    theirs = BuildLock.read(zoo / "digits_cnn" / "1.0.0")
    assert ours is not None and theirs is not None
    assert ours.artifacts["digits_cnn.onnx"] != theirs.artifacts["digits_cnn.onnx"], (
        "the other numeric settings gave the same bytes: the test would prove nothing"
    )
    return zoo


def submit(settings: Settings, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            str(BIN / "mlscope-submit"),
            "digits_cnn",
            "--framework",
            "onnxruntime",
            "--scenario",
            "online",
            "--qps",
            "50",
            "--duration",
            "1",
            "--min-duration",
            "0",
            "--min-queries",
            "1",
            "--trace-level",
            "none",
            "--json",
            *flags,
        ],
        env=child_env(settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


async def agents(settings: Settings) -> list[AgentDescription]:
    async with busmod.connect(settings, name="test") as bus:
        return await list_agents(bus)


def test_a_model_built_with_other_bytes_is_served(tmp_path: Path, other_zoo: Path) -> None:
    with running_stack(tmp_path / "stack", other_zoo, ["onnxruntime"]) as stack:
        out = submit(stack.settings)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert doc["status"] == "completed" and doc["queries"] > 10
        [agent] = anyio.run(agents, stack.settings, backend="asyncio")
        offer = next(o for o in agent.models if o.name == "digits_cnn")
        lock = BuildLock.read(other_zoo / "digits_cnn" / "1.0.0")
        assert lock is not None and offer.sha256 == lock.artifacts["digits_cnn.onnx"]


def tampered_copy(src: Path, dest: Path) -> Path:
    """A copy of a built zoo whose digits_cnn.onnx changed after its lock was written."""
    shutil.copytree(src, dest, symlinks=True)
    onnx = dest / "digits_cnn" / "1.0.0" / "digits_cnn.onnx"
    data = bytearray(onnx.read_bytes())
    data[-1] ^= 0xFF
    onnx.write_bytes(bytes(data))
    return onnx


def test_a_file_changed_after_the_lock_is_refused_with_both_hashes_and_the_fix(
    tmp_path: Path, other_zoo: Path
) -> None:
    onnx = tampered_copy(other_zoo, tmp_path / "zoo")
    lock = BuildLock.read(onnx.parent)
    assert lock is not None
    with running_stack(tmp_path / "stack", tmp_path / "zoo", ["onnxruntime"]) as stack:
        [agent] = anyio.run(agents, stack.settings, backend="asyncio")
        assert "digits_cnn" not in {o.name for o in agent.models}
        refused = [r for r in agent.refused if r.name == "digits_cnn"]
        assert refused and refused[0].reason == "checksum"
        assert refused[0].fix == "mlscope zoo build --only digits_cnn --force"
        out = submit(stack.settings)
    assert out.returncode != 0
    message = out.stderr
    assert str(onnx) in message and lock.artifacts["digits_cnn.onnx"] in message
    assert "mlscope zoo build --only digits_cnn --force" in message
    assert "Traceback" not in message


def test_a_file_changed_while_the_agent_runs_is_refused_at_load(
    tmp_path: Path, other_zoo: Path
) -> None:
    zoo = tmp_path / "zoo"
    shutil.copytree(other_zoo, zoo, symlinks=True)
    with running_stack(tmp_path / "stack", zoo, ["onnxruntime"]) as stack:
        onnx = zoo / "digits_cnn" / "1.0.0" / "digits_cnn.onnx"
        onnx.write_bytes(onnx.read_bytes()[:-16])  # half-written
        out = submit(stack.settings)
    assert out.returncode != 0
    assert str(onnx) in out.stderr and "does not match the build lock" in out.stderr
    assert "mlscope zoo build --only digits_cnn --force" in out.stderr


@pytest.fixture
def fresh_agent(tmp_path: Path) -> Iterator[tuple[Settings, Path, list[Any]]]:
    procs: list[Any] = []
    yield Settings(data_dir=tmp_path / "empty"), tmp_path / "empty", procs
    for p in procs:
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()


def test_an_agent_with_an_empty_data_dir_fetches_the_models_from_the_bus(
    tmp_path: Path, zoo_dir: Path, fresh_agent: tuple[Settings, Path, list[Any]]
) -> None:
    _, empty, procs = fresh_agent
    with running_stack(tmp_path / "stack", zoo_dir, ["onnxruntime"]) as stack:
        sent = anyio.run(
            lambda: push_zoo(stack.settings, zoo_dir, log=lambda _m: None), backend="asyncio"
        )
        assert sent >= 2  # digits_cnn and efficientnet_lite0 at least
        procs.append(start_agent(stack.settings.with_(data_dir=empty), "fresh-agent"))
        fresh = wait_for_agent(stack, "fresh-agent")
        served = {o.name: o.sha256 for o in fresh.models}
        for name, graph in (
            ("digits_cnn", "digits_cnn.onnx"),
            ("efficientnet_lite0", "efficientnet_lite0.onnx"),
        ):
            ours = BuildLock.read(zoo_dir / name / "1.0.0")
            fetched = BuildLock.read(empty / "zoo" / name / "1.0.0")
            assert ours is not None and fetched is not None
            assert fetched.origin["by"] == "bus" and fetched.files == ours.files
            assert served[name] == ours.artifacts[graph]
        out = submit(stack.settings, "--agent", "fresh-agent")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["agent_id"] == "fresh-agent"


def test_a_comparison_says_when_the_runs_loaded_other_bytes(
    tmp_path: Path,
    zoo_dir: Path,
    other_zoo: Path,
    fresh_agent: tuple[Settings, Path, list[Any]],
) -> None:
    """The same model and framework on two agents whose builds differ in bytes: the
    comparison (API, report) says so and names both files' hashes."""
    _, elsewhere, procs = fresh_agent
    elsewhere.mkdir(parents=True)
    (elsewhere / "zoo").symlink_to(other_zoo)
    with running_stack(tmp_path / "stack", zoo_dir, ["onnxruntime"]) as stack:
        procs.append(start_agent(stack.settings.with_(data_dir=elsewhere), "other-cpu"))
        wait_for_agent(stack, "other-cpu")
        [ours_id] = [
            a.agent_id
            for a in anyio.run(agents, stack.settings, backend="asyncio")
            if a.agent_id != "other-cpu"
        ]
        ids = []
        for agent_id in (ours_id, "other-cpu"):
            out = submit(stack.settings, "--agent", agent_id)
            assert out.returncode == 0, out.stderr
            ids.append(json.loads(out.stdout)["evaluation_id"])
        table = compare_runs(BusSource(stack.settings), ids[0], ids[1], n_boot=200)
        ours = BuildLock.read(zoo_dir / "digits_cnn" / "1.0.0")
        theirs = BuildLock.read(other_zoo / "digits_cnn" / "1.0.0")
        assert ours is not None and theirs is not None
        [note] = set(table["note"])
        assert "digits_cnn@1.0.0 on onnxruntime ran different model files" in note
        for lock in (ours, theirs):
            assert lock.artifacts["digits_cnn.onnx"][:12] in note
        same = compare_runs(BusSource(stack.settings), ids[0], ids[0], n_boot=200)
        [same_note] = set(same["note"])  # may tell that the short run is INVALID, once
        assert "different model files" not in same_note
        assert same_note.count(ids[0]) <= 1
        text = report_render.to_markdown(report.build(BusSource(stack.settings), ids))
        assert "ran different model files" in text


def start_agent(settings: Settings, agent_id: str) -> subprocess.Popen[bytes]:
    """``mlscope agent`` for onnxruntime with its own data dir (``settings``)."""
    argv = ["agent", "--framework", "onnxruntime", "--agent-id", agent_id]
    return subprocess.Popen(
        [sys.executable, "-m", "cli.main", *argv],
        env=child_env(settings),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def wait_for_agent(stack: Stack, agent_id: str, timeout: float = 120) -> AgentDescription:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [
            a
            for a in anyio.run(agents, stack.settings, backend="asyncio")
            if a.agent_id == agent_id
        ]
        if found:
            return found[0]
        time.sleep(0.5)
    raise TimeoutError(f"agent {agent_id} did not register")


@pytest.mark.parametrize(
    "argv",
    [
        ["mlscope", "agents"],
        ["mlscope-submit", "digits_cnn", "--framework", "onnxruntime"],
        ["mlscope", "report", "ev-none"],
    ],
)
def test_commands_fail_fast_without_a_bus(tmp_path: Path, argv: list[str]) -> None:
    """One line and a non-zero exit from each command. How fast is checked in-process
    below: a child's interpreter start-up on a loaded machine is not the bus wait."""
    settings = Settings(nats_url="nats://127.0.0.1:9", data_dir=tmp_path)
    out = subprocess.run(
        [str(BIN / argv[0]), *argv[1:]],
        env=child_env(settings),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "no NATS server at nats://127.0.0.1:9 (is `mlscope up` running?)" in lines[0]


@pytest.mark.integration  # a real socket, and it waits out the client's timeout
def test_connecting_to_no_bus_gives_up_within_3_s(tmp_path: Path) -> None:
    settings = Settings(nats_url="nats://127.0.0.1:9", data_dir=tmp_path)

    async def attempt() -> None:
        async with busmod.connect(settings, name="test"):
            pass

    started = time.monotonic()
    with pytest.raises(BusError, match="no NATS server at"):
        anyio.run(attempt, backend="asyncio")
    assert time.monotonic() - started < 3.0


def test_a_rerun_on_other_bytes_says_so() -> None:
    from cli.rerun_cmd import artifact_note

    assert artifact_note({"artifact_sha256": "a" * 64}, {"artifact_sha256": "a" * 64}) is None
    assert artifact_note({}, {"artifact_sha256": "a" * 64}) is None
    note = artifact_note({"artifact_sha256": "a" * 64}, {"artifact_sha256": "b" * 64})
    assert note is not None and "a" * 64 in note and "b" * 64 in note
