"""Values a command cannot use are usage errors (exit 2, one line that names the flag and
what it takes), whichever command is given them: a negative seed, a misspelt framework,
device or scenario, a count below 1. And what ``mlscope-submit`` says on stderr while a
job runs reaches a script too: the job's id, for ``mlscope cancel``.

Nothing here connects to a server: a refusal comes before any connection, and
``mlscope runs`` reads a chDB of this module's own."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

import cli.submit
import cli.submit_flags
from analysis.source import DirectSource
from broker.db import Database
from cli.main import _parse as parse
from cli.main import main as mlscope_main
from mlscope.contracts import JobEvent
from mlscope.errors import BusError
from mlscope.settings import Settings
from tests.stored_rows import evaluation_row, insert_evaluation

NOWHERE = Settings(nats_url="nats://127.0.0.1:9")
"""No server listens there: nothing in these tests may connect."""


@pytest.fixture
def nowhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key, value in NOWHERE.with_(data_dir=tmp_path / "data").as_env().items():
        monkeypatch.setenv(key, value)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``argv`` is refused with (exit 2, no traceback)."""
    try:
        code = mlscope_main(argv)
    except SystemExit as exc:  # refused by the parser
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


# ------------------------------------------------------------ mlscope-submit's notes


def test_submit_names_the_job_on_stderr_without_a_terminal(
    nowhere: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Piped (stderr no terminal), with or without ``--json``: the job's id as soon as a
    server accepts it, on stderr; stdout keeps the result alone."""
    seen: list[str] = []

    async def accepted_then_lost(settings: Settings, job: Any, *, on_event: Any) -> Any:
        seen.append(job.job_id)
        on_event(JobEvent(job_id=job.job_id, event="accepted", server_id="srv-1"))
        on_event(JobEvent(job_id=job.job_id, event="queued", note="waiting for a server"))
        raise BusError("the bus went away")

    monkeypatch.setattr(cli.submit, "submit", accepted_then_lost)
    for extra in ([], ["--json"]):
        assert cli.submit.main(["noop", "--framework", "noop", *extra]) == 1
        out, err = capsys.readouterr()
        assert out == ""
        assert f"  job {seen[-1]} accepted by srv-1\n" in err, err
        assert f"  job {seen[-1]}: waiting for a server\n" in err, err


# ------------------------------------------------------------ seeds


@pytest.mark.parametrize(
    "argv",
    [
        ["noop", "--framework", "noop", "--seed", "-1"],
        ["noop", "--framework", "noop", "--seed", str(2**64)],
    ],
)
def test_submit_refuses_a_seed_out_of_range_as_usage(
    argv: list[str], nowhere: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.submit.main(argv)
    assert info.value.code == 2
    assert "argument --seed: must be" in capsys.readouterr().err


def test_submit_takes_seed_zero(nowhere: None) -> None:
    args = cli.submit_flags.parser().parse_args(["noop", "--framework", "noop", "--seed", "0"])
    assert cli.submit_flags.make_job(args).scenario.seed == 0


# ------------------------------------------------------------ mlscope mlperf

MLPERF = ["mlperf", "digits_cnn", "--scenario", "Offline", "--output", "out"]


def test_mlperf_refuses_a_misspelt_framework_as_usage(
    nowhere: None, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused([*MLPERF, "--framework", "pytroch"], capsys)
    assert "argument --framework: unknown framework 'pytroch'; known: onnxruntime" in line


def test_mlperf_refuses_a_negative_seed_as_usage(
    nowhere: None, capsys: pytest.CaptureFixture[str]
) -> None:
    line = refused([*MLPERF, "--framework", "onnxruntime", "--seed", "-1"], capsys)
    assert line.startswith("mlscope mlperf: error: argument --seed: must be greater than"), line


# ------------------------------------------------------------ mlscope agent


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--threads", "0", "argument --threads: '0' is not a whole number above 0"),
        ("--threads", "-4", "argument --threads: '-4' is not a whole number above 0"),
        ("--sample-memory", "-1", "argument --sample-memory: '-1' is not a whole number above 0"),
        ("--device", "gpu0", "argument --device: unknown device 'gpu0'; known: cpu, cuda"),
        ("--device", "cuda:x", "argument --device: unknown device 'cuda:x'"),
        ("--device", "cuda:-1", "argument --device: unknown device 'cuda:-1'"),
    ],
)
def test_agent_refuses_values_it_cannot_use(
    flag: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused by the parser (parsed only: nothing starts)."""
    with pytest.raises(SystemExit) as info:
        parse(["agent", "--framework", "noop", flag, value])
    assert info.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", "tensorrt:0", "fpga:0", "gpu"])
def test_agent_takes_every_device_a_predictor_opens(device: str) -> None:
    args = parse(["agent", "--framework", "noop", "--device", device, "--threads", "2"])
    assert (args.device, args.threads, args.sample_memory) == (device, 2, 1024)


# ------------------------------------------------------------ mlscope runs


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DirectSource]:
    """A chDB holding one imported MLPerf run: its framework and scenario are names only
    a stored run has."""
    database = Database(f"chdb:///{tmp_path_factory.mktemp('runs-names') / 'chdb'}")
    database.migrate()
    row = evaluation_row(
        "ev-imported",
        job_id="job-imported",
        created_at=datetime(2026, 1, 2, 3, 4, 5),
        model="resnet50",
        model_version="",
        framework="mlperf",
        framework_version="",
        agent_id="imported",
        host="",
        scenario="mlperf-offline",
        summary=json.dumps({"scenario": {"name": "mlperf-offline", "batch_size": 1}}),
    )
    insert_evaluation(database, row)
    try:
        yield DirectSource(database)
    finally:
        database.close()


@pytest.fixture
def runs_db(db: DirectSource, nowhere: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("analysis.source.open_source", lambda settings: db)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (
            ["runs", "--framework", "pytroch"],
            "mlscope runs: error: argument --framework: unknown framework 'pytroch' (no run "
            "has it); known: onnxruntime, pytorch, tensorflow, tflite, xrt, noop",
        ),
        (
            ["ls", "--scenario", "onlne"],
            "mlscope ls: error: argument --scenario: unknown scenario 'onlne' (no run has it); "
            "known: online",
        ),
    ],
)
def test_runs_refuses_a_misspelt_name(
    argv: list[str], says: str, runs_db: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert refused(argv, capsys).startswith(says)


def test_runs_takes_names_a_stored_run_has(
    runs_db: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """An MLPerf run's scenario and an import's framework are no registered names, yet
    they find that run; a known name that no run has lists nothing, as before."""
    argv = ["runs", "--framework", "mlperf", "--scenario", "mlperf-offline", "--json"]
    assert mlscope_main(argv) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert [json.loads(line)["evaluation_id"] for line in out.splitlines()] == ["ev-imported"]
    # stored in UTC, and its JSON says so
    assert json.loads(out)["created_at"] == "2026-01-02T03:04:05.000+00:00"
    assert mlscope_main(["runs", "--framework", "pytorch", "--scenario", "online"]) == 0
    assert capsys.readouterr().err == "no evaluations match\n"


# ------------------------------------------------------------ mlscope report --price


def test_report_says_a_price_it_cannot_use(
    runs_db: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The report is written; the price it could not use is said on stderr."""
    out = tmp_path / "r.md"
    assert (
        mlscope_main(["report", "ev-imported", "--price", "NoSuchSystem=0.10", "-o", str(out)]) == 0
    )
    err = capsys.readouterr().err
    assert (
        "mlscope report: warning: prices ignored: a cost per million inferences comes from "
        "batched (throughput) runs, and none of these runs is batched\n"
    ) in err, err
    assert out.exists()
