"""``mlscope`` facing what it did not write and values nobody should type: a stored
evaluation whose ``spec`` (or ``summary``) cannot be read, and flags out of range. Every
time the answer is one line and an exit code, never a traceback: ``mlscope runs``
still lists every evaluation, ``rerun``/``export``/``report`` of the bad one name it
and what is wrong with it, and a bad flag is refused before anything connects.

The stored rows are written into a chDB the way the server's own inserts write them,
before a server (nats-server and ``mlscope server``, no agent) opens that database."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from pydantic import ValidationError

from cli.main import main as mlscope_main
from cli.stack import Stack
from mlscope.contracts import CancelReply, JobRequest, ScenarioSpec
from mlscope.settings import Settings
from tests.conftest import REPO, wait_server

pytestmark = pytest.mark.timeout(180)

NOWHERE = Settings(nats_url="nats://127.0.0.1:9")
"""No server listens there: a refused flag must be refused before any connection."""

GOOD_JOB = JobRequest(model="noop", framework="noop", scenario=ScenarioSpec(name="online"))
AGENT = {"host": "h1", "cpu_model": "Test CPU", "cpu_cores": 2, "frameworks": []}
MANIFEST = {"name": "noop", "version": "1"}


def _spec(**fields: object) -> str:
    return json.dumps(
        {"job": GOOD_JOB.model_dump(mode="json", by_alias=True), "manifest": MANIFEST, **fields}
    )


def _without_job() -> str:
    return json.dumps({"manifest": MANIFEST, "agent": AGENT})


def _job(**changes: object) -> str:
    job = GOOD_JOB.model_dump(mode="json", by_alias=True)
    job.update(changes)
    return json.dumps({"job": job, "manifest": MANIFEST, "agent": AGENT})


GOOD = ("ev-good-one", "ev-good-two")
SUMMARY = json.dumps(
    {"scenario": {"name": "online", "batch_size": 1}, "queries": 10, "throughput_ips": 99.5}
)
BAD_SPECS = {
    # evaluation id: (stored spec, what the one line says about it)
    "ev-no-job": (_without_job(), "its stored spec has no job to rerun"),
    "ev-job-five": (_spec(job=5), "its stored job cannot run again"),
    "ev-job-bad-field": (
        _job(scenario={"name": "online", "qps": -1}),
        "scenario.qps: must be greater than 0",
    ),
    "ev-job-extra-field": (_job(colour="blue"), "colour: Extra inputs are not permitted"),
    "ev-array": ("[]", "its stored spec is an array, not a JSON object"),
    "ev-not-json": ("{not json", "its stored spec is not JSON"),
}
UNREADABLE = ("ev-array", "ev-not-json")
"""Specs that are no JSON object at all: no reader of the row can use them."""
ODD_ROWS = {
    # evaluation id: (spec, summary): readable JSON with fields of the wrong shape, and
    # a summary that is no JSON
    "ev-agent-five": (_spec(agent=5), SUMMARY),
    "ev-summary-not-json": (_spec(agent=AGENT), "{not json"),
}

WRITE_ROWS = """
import json, sys
from datetime import UTC, datetime, timedelta
from broker.db import EVALUATION_COLUMNS, Database

dsn, rows = sys.argv[1], json.load(sys.stdin)
now = datetime.now(UTC).replace(tzinfo=None)
values = {
    "job_id": "job-x", "rerun_of": "", "model": "noop", "model_version": "1",
    "framework": "noop", "framework_version": "1", "agent_id": "agent-1", "host": "h1",
    "device": "cpu", "scenario": "online", "trace_level": "none", "status": "completed",
    "valid": 1, "t0_ns": 0, "clock_offset_ns": 0,
}
records = [
    {**values, "evaluation_id": e, "created_at": now - timedelta(seconds=i), "spec": spec,
     "summary": summary}
    for i, (e, spec, summary) in enumerate(rows)
]
with Database(dsn) as db:
    db.migrate()
    db.insert("evaluations", [[r[c] for r in records] for c in EVALUATION_COLUMNS],
              EVALUATION_COLUMNS)
"""


@dataclass(frozen=True)
class Store:
    settings: Settings
    """A server's settings, its database holding every row below."""

    @property
    def ids(self) -> set[str]:
        return {*GOOD, *BAD_SPECS, *ODD_ROWS}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    """nats-server and ``mlscope server`` (no agent) on a database holding the rows."""
    base = tmp_path_factory.mktemp("hostile-cli")
    settings = Settings(data_dir=base)
    rows = [
        *[(e, _spec(agent=AGENT), SUMMARY) for e in GOOD],
        *[(e, spec, SUMMARY) for e, (spec, _) in BAD_SPECS.items()],
        *[(e, spec, summary) for e, (spec, summary) in ODD_ROWS.items()],
    ]
    # In a process of its own: chDB opens one data directory per process.
    subprocess.run(
        [sys.executable, "-c", WRITE_ROWS, settings.dsn],
        input=json.dumps(rows),
        text=True,
        cwd=REPO,
        check=True,
        timeout=120,
    )
    stack = Stack(settings, nats_port=0, frameworks=[])
    live = stack.start()
    try:
        anyio.run(wait_server, live, backend="asyncio")
        yield Store(live)
    finally:
        stack.stop()


def _use(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in settings.as_env().items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def on_store(server: Store, monkeypatch: pytest.MonkeyPatch) -> Store:
    """The CLI run in this process, on that server."""
    _use(server.settings, monkeypatch)
    return server


@pytest.fixture
def nowhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The CLI run in this process, with no server to reach."""
    _use(NOWHERE.with_(data_dir=tmp_path / "data"), monkeypatch)


def mlscope(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``mlscope ARGV`` run as the program would run it."""
    try:
        code = mlscope_main(list(argv))
    except SystemExit as exit_:  # argparse's refusals
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def message(stderr: str) -> str:
    """The one line stderr says, argparse's usage block aside (none, or ``usage:`` and
    its indented continuation lines)."""
    assert "Traceback" not in stderr and "validation error" not in stderr, stderr
    lines = [
        line
        for line in stderr.strip().splitlines()
        if not line.startswith(("usage:", " ")) and line.strip()
    ]
    assert len(lines) == 1, stderr
    return lines[0]


# ---------------------------------------------------------------- stored rows


def test_runs_lists_every_evaluation_whatever_a_row_holds(
    on_store: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = mlscope(capsys, "runs", "--limit", "100", "--json")
    assert code == 0 and err == "", err
    rows = {r["evaluation_id"]: r for r in map(json.loads, out.splitlines())}
    assert set(rows) == on_store.ids
    for e in GOOD:
        assert rows[e]["throughput_ips"] == 99.5 and rows[e]["model"] == "noop", rows[e]
        assert isinstance(rows[e]["queries"], int), rows[e]  # not 10.0 for a row's sake
    odd = rows["ev-summary-not-json"]
    assert odd["model"] == "noop" and odd["throughput_ips"] is None, odd

    code, out, err = mlscope(capsys, "runs", "--limit", "100")
    assert code == 0 and err == "", err
    assert all(e in out for e in on_store.ids), out


def test_the_listing_shows_what_a_bad_row_holds_and_a_named_read_refuses_it(
    on_store: Store,
) -> None:
    """The library under ``runs`` and the dashboard's list, and under ``export`` and
    ``report``: a listing keeps the row's columns; a read by id names what is wrong."""
    from analysis.data import RunFilter, evaluations, find_evaluations
    from analysis.source import open_source
    from mlscope.errors import DatabaseError

    with open_source(on_store.settings) as source:
        listed = find_evaluations(source, RunFilter())
        assert set(listed["evaluation_id"]) == on_store.ids
        row = listed.set_index("evaluation_id").loc["ev-agent-five"]
        assert row["system"] == "cpu" and row["framework"] == "noop"
        assert len(evaluations(source)) == len(on_store.ids)
        with pytest.raises(DatabaseError, match="ev-not-json: its stored spec is not JSON"):
            evaluations(source, [GOOD[0], "ev-not-json"])


@pytest.mark.parametrize("evaluation", sorted(BAD_SPECS))
def test_rerun_of_a_bad_spec_names_the_evaluation_and_the_problem(
    on_store: Store, capsys: pytest.CaptureFixture[str], evaluation: str
) -> None:
    code, out, err = mlscope(capsys, "rerun", evaluation)
    assert code == 1 and out == "", out
    line = message(err)
    assert line.startswith(f"mlscope rerun: evaluation {evaluation}: "), line
    assert BAD_SPECS[evaluation][1] in line, line


@pytest.mark.parametrize("command", ["export", "report"])
@pytest.mark.parametrize("evaluation", UNREADABLE)
def test_export_and_report_of_an_unreadable_spec_say_so_in_one_line(
    on_store: Store,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    command: str,
    evaluation: str,
) -> None:
    output = tmp_path / ("out" if command == "export" else "report.json")
    code, _, err = mlscope(capsys, command, GOOD[0], evaluation, "-o", str(output))
    assert code == 1
    line = message(err)
    assert line.startswith(f"mlscope {command}: evaluation {evaluation}: its stored spec"), line
    assert BAD_SPECS[evaluation][1] in line, line
    assert not output.exists()


# ---------------------------------------------------------------------- flags

LONG_ID = "job-" + "x" * 296
SUITE = ("report", "--suite", "--run", "--models", "noop/noop")
MLPERF = ("mlperf", "noop", "--framework", "noop", "--scenario", "Offline", "--output", "o")


BAD_FLAGS = [
    # (argv, how the one line starts after "mlscope COMMAND: error: ")
    (("cancel", LONG_ID), "argument JOB_ID: 'job-xxxx"),
    (("cancel", "job-1", "--timeout", "inf"), "argument --timeout: 'inf' is not a finite"),
    (("cancel", "job-1", "--timeout", "nan"), "argument --timeout: 'nan' is not a finite"),
    (("cancel", "job-1", "--timeout", "-1"), "argument --timeout: '-1' is not a finite"),
    (("cancel", "job-1", "--timeout", "1e9"), "argument --timeout: '1e9' is longer than"),
    (("rerun", LONG_ID), "argument EVAL_ID: 'job-xxxx"),
    (("runs", "--since", "99999999999d"), "argument --since: further back than"),
    (("runs", "--limit", "100000000000000000000"), "argument --limit: '1000"),
    (("trace", "ev-1", "--max-spans", "0"), "argument --max-spans: '0' is not a whole number"),
    (("doctor", "--limit", "-5"), "argument --limit: '-5' is not a whole number above 0"),
    (("report", "--price", "x=abc", "ev-1"), "argument --price: 'x=abc': the price 'abc'"),
    (("report", "--price", "=", "ev-1"), "argument --price: '=' is not SYSTEM=USD_PER_HOUR"),
    (("report", "--price", "x=inf", "ev-1"), "argument --price: 'x=inf': the price"),
    ((*SUITE, "--qps", "-1"), "argument --qps: '-1' is not a finite number above 0"),
    ((*SUITE, "--duration", "nan"), "argument --duration: 'nan' is not a finite"),
    ((*SUITE, "--batch-sizes", "0,-1"), "argument --batch-sizes: '0' is not a whole number"),
    ((*SUITE, "--batch-sizes", "a"), "argument --batch-sizes: 'a' is not a whole number"),
    ((*MLPERF, "--window", "0"), "argument --window: '0' is not a whole number above 0"),
    ((*MLPERF, "--target-qps", "nan"), "argument --target-qps: 'nan' is not a finite"),
    ((*MLPERF, "--agent", LONG_ID), "argument --agent: 'job-xxxx"),
    ((*MLPERF, "--framework-version", "!!"), "argument --framework-version: invalid"),
    ((*MLPERF, "--target-qps", "1e9"), "argument --target-qps: must be less than or equal"),
    (("demo", "--qps", "-1"), "argument --qps: '-1' is not a finite number above 0"),
    (("demo", "--qps", "1e9"), "argument --qps: must be less than or equal to 1000000"),
]


@pytest.mark.parametrize(
    ("argv", "says"), BAD_FLAGS, ids=[f"{a[0]} {' '.join(a[-2:])[:40]}" for a, _ in BAD_FLAGS]
)
def test_a_bad_flag_is_one_line_and_exit_2_before_anything_connects(
    nowhere: None, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], says: str
) -> None:
    code, out, err = mlscope(capsys, *argv)
    assert code == 2, err
    line = message(err)
    assert line.startswith(f"mlscope {argv[0]}: error: {says}"), line
    assert out == ""


def test_a_refusal_the_flags_did_not_cause_keeps_its_traceback(
    nowhere: None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The boundary names a flag only for a contract a command built from its flags: a
    reply that fails its model is a bug, and is raised as such."""
    import cli.cancel_cmd

    def bad_reply(args: object) -> int:
        CancelReply.model_validate({"job_id": "job-1"})
        return 0

    code, _, err = mlscope(capsys, *MLPERF, "--framework-version", "!!")
    assert code == 2 and "--framework-version" in message(err)
    monkeypatch.setattr(cli.cancel_cmd, "run", bad_reply)
    with pytest.raises(ValidationError):
        mlscope_main(["cancel", "job-1"])
