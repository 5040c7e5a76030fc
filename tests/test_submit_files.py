"""The files a submission reads (a scenario file, its replay schedule, a system file):
each refused as the file's own error, with its path and line (exit 1), never blamed
on a flag, never a traceback, read once. No server: every refusal comes before a
connection, and the one test that gets past them fails at a stand-in for the bus."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import cli.submit
import cli.submit_flags
from broker.scenarios import read_arrivals, scenario_spec
from mlscope.errors import BusError, ManifestError
from mlscope.manifest_files import load_manifest

pytestmark = pytest.mark.timeout(30)

FLAGS: dict[str, Any] = {"qps": None, "duration_s": None}
"""What ``make_job`` passes for flags the user did not give."""


@pytest.fixture(autouse=True)
def _nowhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLSCOPE_NATS_URL", "nats://127.0.0.1:9")
    monkeypatch.setenv("MLSCOPE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("MLSCOPE_MANIFESTS", raising=False)


def _scenario(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "sc.yaml"
    path.write_text(f"kind: scenario\n{body}")
    return path


OVER_THE_SPEC = {
    "qps": ("name: online\nqps: .inf\n", 3, "qps"),
    "duration": ("name: online\nqps: 1\nduration_s: 1e999\n", 4, "duration_s"),
    "segments": ("name: piecewise\nsegments: [[1e308, 1e308, 1e5]]\n", 3, "segments"),
    "loadgens": ("name: online\nqps: 1\nloadgens: 100000\n", 4, "loadgens"),
    "repetitions": ("name: cold-start\nrepetitions: 5000\n", 3, "repetitions"),
    "batch_sizes": ("name: batched\nbatch_sizes: [1, 100000]\n", 3, "batch_sizes"),
}
"""Values past a ScenarioSpec's bounds, with the line and field that hold them."""


@pytest.mark.parametrize("case", list(OVER_THE_SPEC))
def test_validate_refuses_what_a_submission_would(tmp_path: Path, case: str) -> None:
    body, line, field = OVER_THE_SPEC[case]
    path = _scenario(tmp_path, body)
    with pytest.raises(ManifestError) as err:
        load_manifest(path)
    assert (err.value.file, err.value.line, err.value.field) == (str(path), line, field)


@pytest.mark.parametrize("case", list(OVER_THE_SPEC))
def test_a_file_value_is_the_files_error_on_its_line(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    body, line, _ = OVER_THE_SPEC[case]
    path = _scenario(tmp_path, body)
    code = cli.submit.main(["m", "--framework", "onnxruntime", "--scenario-file", str(path)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.startswith(f"mlscope-submit: {path}:{line}: "), err
    assert "argument --" not in err and "Traceback" not in err


def test_a_spec_the_files_values_cannot_make_is_the_files_error(tmp_path: Path) -> None:
    """Each value within its bounds, together too many queries: the file's doing."""
    path = _scenario(tmp_path, "name: online\nqps: 1000000\nduration_s: 600000\n")
    with pytest.raises(ManifestError, match="qps x duration_s") as err:
        scenario_spec(path, FLAGS)
    assert str(err.value).startswith(f"{path}:")


def test_flags_still_override_the_file_and_are_blamed_as_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _scenario(tmp_path, "name: online\nqps: 10\nduration_s: 2\n")
    assert scenario_spec(path, {**FLAGS, "qps": 5.0}).qps == 5.0
    with pytest.raises(SystemExit) as done:  # usage: argparse's exit
        cli.submit.main(
            ["m", "--framework", "onnxruntime", "--scenario-file", str(path), "--qps", "2e6"]
        )
    assert done.value.code == 2
    assert "error: argument --qps: must be less than" in capsys.readouterr().err


def test_a_system_file_yaml_cannot_build_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sys.yaml"
    path.write_text("kind: system\nname: x\narch: !!int abc\n")
    code = cli.submit.main(["m", "--framework", "onnxruntime", "--system", str(path)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"{path}:3: not a valid int: 'abc'" in err and "Traceback" not in err


@pytest.mark.timeout(15)  # the old reader blocked in open() until a writer came
@pytest.mark.parametrize("how", ["--schedule", "--scenario-file"])
def test_a_fifo_schedule_is_refused_not_waited_on(
    tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "arrivals.txt"
    os.mkfifo(fifo)
    if how == "--schedule":
        argv = ["--scenario", "replay", "--schedule", str(fifo)]
    else:
        argv = [
            "--scenario-file",
            str(_scenario(tmp_path, "name: replay\nschedule_file: arrivals.txt\n")),
        ]
    assert cli.submit.main(["m", "--framework", "onnxruntime", *argv]) == 1
    assert f"{fifo}: cannot read replay file: not a regular file" in capsys.readouterr().err


def test_read_arrivals_keeps_the_contracts_type(tmp_path: Path) -> None:
    path = tmp_path / "arrivals.txt"
    path.write_text("0.5\n0.25\n0\n")
    gaps = read_arrivals(path)
    assert gaps == (0.5, 0.25, 0.0) and all(type(g) is float for g in gaps)


def test_the_job_is_built_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its schedule read once: the preflight's job is the one submitted."""
    path = tmp_path / "arrivals.txt"
    path.write_text("0.1\n" * 10)
    reads: list[Path] = []
    sent: list[Any] = []

    def counted(p: Path) -> tuple[float, ...]:
        reads.append(p)
        return read_arrivals(p)

    async def no_bus(settings: Any, job: Any, **_: Any) -> Any:
        sent.append(job)
        raise BusError("no bus here")

    monkeypatch.setattr(cli.submit_flags, "read_arrivals", counted)
    monkeypatch.setattr(cli.submit, "submit", no_bus)
    argv = ["m", "--framework", "onnxruntime", "--scenario", "replay", "--schedule", str(path)]
    assert cli.submit.main(argv) == 1
    assert reads == [path] and len(sent) == 1
    assert sent[0].scenario.arrivals_s == (0.1,) * 10
