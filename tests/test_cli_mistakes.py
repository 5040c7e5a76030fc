"""Plausible user mistakes that each command must refuse in one line: a misspelt
framework for `mlscope agent` / `mlscope up`, an agent on a device its runtime cannot
use here, flags that `mlscope report --suite`
would silently ignore, a manifest `mlscope models publish` accepts although every
agent refuses it; default run lengths too short for any run to be VALID; and
`mlscope dashboard` must not leave its Streamlit process serving the port when it is
stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli.main import _parse as parse
from cli.main import main as mlscope_main
from cli.models_cmd import publishable
from mlscope.errors import ManifestError
from mlscope.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
NOWHERE = Settings(nats_url="nats://127.0.0.1:9")
"""No server listens there: nothing in these tests may connect."""


@pytest.fixture
def nowhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key, value in NOWHERE.with_(data_dir=tmp_path / "data").as_env().items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize(
    "argv",
    [
        ["agent", "--framework", "pytroch"],
        ["up", "--frameworks", "onnxruntime,pytroch"],
        ["edge", "up", "--framework", "pytroch"],
        ["auth", "add-agent", "a1", "--out", "creds", "--framework", "pytroch"],
        ["models", "remove", "m", "--version", "1", "--framework", "pytroch"],
    ],
)
def test_a_misspelt_framework_is_a_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused by the parser, before anything starts (parsed only: a build without the
    check must not start a stack here)."""
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown framework 'pytroch'; known: onnxruntime" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["report", "--suite", "--run"], ["demo"]])
def test_default_run_lengths_are_long_enough_to_be_valid(argv: list[str]) -> None:
    """The runs `mlscope report --suite --run` and `mlscope demo` submit by default last
    at least the validity rules' minimum: a shorter default makes every run INVALID (and
    Table 2 then shows older valid runs in place of the ones just made)."""
    from cli.report_cmd import suite_jobs
    from mlscope.validity import ValidityPolicy

    args = parse(argv)
    assert args.duration >= ValidityPolicy().min_duration_s
    if argv[0] == "report":
        jobs = suite_jobs(
            [("noop", "noop")], batch_sizes=args.batch_sizes, qps=args.qps, duration_s=args.duration
        )
        assert all(j.scenario.duration_s >= ValidityPolicy().min_duration_s for j in jobs)


@pytest.mark.parametrize(
    ("framework", "device", "devices"),
    [
        ("noop", "cuda:99", "cpu"),  # no machine has a hundredth GPU
        ("onnxruntime", "cuda:99", "cpu"),
        ("noop", "fpga", "cpu"),
    ],
)
def test_an_agent_on_a_device_it_cannot_use_does_not_start(
    framework: str, device: str, devices: str, tmp_path: Path
) -> None:
    """Said in one line before it connects (no bus listens at NOWHERE): an agent that
    started would advertise itself and fail every job sent to it."""
    env = {
        **os.environ,
        **NOWHERE.with_(data_dir=tmp_path / "data").as_env(),
        "HOME": str(tmp_path),
        "PYTHONPATH": str(ROOT),
    }
    argv = ["agent", "--framework", framework, "--device", device]
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"mlscope agent: {framework} cannot run on {device} on this machine "
        f"(its devices here: {devices})"
    )
    assert "Traceback" not in done.stderr


def test_which_devices_a_framework_can_use() -> None:
    from agent.predictors import unusable_device
    from mlscope.contracts import FrameworkInfo

    gpu = FrameworkInfo(name="pytorch", version="2", devices=("cpu", "cuda:0"))
    fpga = FrameworkInfo(name="xrt", version="2", devices=("fpga:0",))
    for device in ("cpu", "cuda", "cuda:0", "gpu", "tensorrt:0"):
        assert unusable_device(device, gpu) is None, device
    assert unusable_device("cuda:1", gpu) == (
        "pytorch cannot run on cuda:1 on this machine (its devices here: cpu, cuda:0)"
    )
    assert unusable_device("fpga:0", fpga) is None
    assert unusable_device("cpu", fpga) is not None  # XRT runs on its FPGAs only
    assert unusable_device("fpga:1", fpga) is not None


def test_known_frameworks_parse() -> None:
    assert parse(["up", "--frameworks", "onnxruntime, noop"]).frameworks == "onnxruntime,noop"
    assert parse(["agent", "--framework", "noop"]).framework == "noop"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["report", "--suite", "-o", "suite.md"], "takes no -o"),
        (["report", "--suite", "--json"], "takes no --json"),
        (["report", "--suite", "ev-1"], "takes no EVAL_ID"),
        (["report", "--suite", "--price", "X=1"], "takes no --price"),
        (["report", "ev-1", "--run"], "--run: only with --suite"),
    ],
)
def test_report_refuses_flags_it_would_ignore(
    argv: list[str],
    message: str,
    nowhere: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    assert mlscope_main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "suite.md").exists()


MANIFEST = """kind: model
name: my_model
version: 1.0.0
task: unknown
framework: {{name: onnxruntime, version: '*'}}
inputs:
- {{type: tensor, layer_name: input, element_type: float32, shape: [1, 28, 28]}}
outputs:
- {{type: tensor, layer_name: logits}}
assets: {{base_url: '{base}', graph_path: my_model.onnx, sha256: '{sha}'}}
latency_only: true
"""


@pytest.mark.parametrize("base", ["file:///srv/models/", "pkg://mlscope/zoo/"])
def test_publish_refuses_locations_that_agents_refuse(base: str, tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(MANIFEST.format(base=base, sha="0" * 64))
    with pytest.raises(ManifestError, match="agents never fetch"):
        publishable(path)


@pytest.mark.parametrize("base", ["zoo://my_model/1.0.0/", "https://models.example/m/"])
def test_publish_takes_locations_agents_may_fetch(base: str, tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(MANIFEST.format(base=base, sha="0" * 64))
    assert publishable(path).name == "my_model"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_dashboard_stopped_or_killed_stops_its_server(tmp_path: Path, signum: int) -> None:
    """`kill PID` of `mlscope dashboard` (a supervisor's stop), or `kill -9`, must stop
    Streamlit too, else the orphan keeps the port and the next start says "Port ... is
    not available"."""
    pid_file = tmp_path / "child.pid"
    child = (
        "import os, pathlib, time; "
        f"pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid())); time.sleep(60)"
    )
    parent = (
        "import os, sys; from cli.dashboard_cmd import serve; "
        f"sys.exit(serve([sys.executable, '-c', {child!r}], dict(os.environ)))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", parent], env=env)
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
        proc.send_signal(signum)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(grandchild), "the server outlived `mlscope dashboard`"
    finally:
        if proc.poll() is None:
            proc.kill()
        if pid_file.exists() and pid_file.read_text() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
