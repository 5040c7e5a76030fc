"""A benchmarker's day with the CLI against a real stack (nats-server, server owning
chDB, noop agent): find runs, export them, report them.

Two short noop runs are made once per module through ``mlscope-submit``; every
command then runs as a child process, as a user runs it, and reads the database
through the server (the bus), never directly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import anyio
import pandas as pd
import pytest

from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import remote
from tests.conftest import LOOSE_FLAGS, child_env

pytestmark = pytest.mark.timeout(240)

SUBMIT = Path(sys.executable).parent / "mlscope-submit"


def cli(stack: Stack, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        env=child_env(stack.settings),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def submit(stack: Stack, *flags: str) -> dict[str, Any]:
    done = subprocess.run(
        [str(SUBMIT), "noop", "--framework", "noop", *flags, "--json"],
        env=child_env(stack.settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def count(stack: Stack, table: str, ids: list[str]) -> int:
    async def go() -> int:
        async with busmod.connect(stack.settings, name="test") as bus:
            _, rows = await remote.sql(
                bus,
                f"SELECT count() FROM {table} FINAL WHERE evaluation_id IN {{ids:Array(String)}}",
                {"ids": ids},
            )
            return int(rows[0][0])

    return anyio.run(go, backend="asyncio")


@pytest.fixture(scope="module")
def two_runs(noop_stack: Stack) -> tuple[str, str]:
    """(a VALID batched run, an INVALID online run: too short for the default rules),
    their spans ingested."""
    valid = submit(
        noop_stack, "--scenario", "batched", "--batch-size", "2", "--duration", "1", *LOOSE_FLAGS
    )
    invalid = submit(noop_stack, "--scenario", "online", "--qps", "50", "--duration", "0.5")
    assert valid["valid"], valid["invalid_reasons"]
    assert not invalid["valid"]
    ids = [valid["evaluation_id"], invalid["evaluation_id"]]
    last, deadline = -1, time.monotonic() + 30
    while time.monotonic() < deadline:  # spans arrive asynchronously: wait until settled
        now = count(noop_stack, "spans", ids)
        if now == last and now > 0:
            break
        last = now
        time.sleep(1.0)
    return valid["evaluation_id"], invalid["evaluation_id"]


def runs_json(stack: Stack, *flags: str) -> list[dict[str, Any]]:
    done = cli(stack, "runs", "--json", *flags)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_runs_lists_newest_first_with_filters(noop_stack: Stack, two_runs: tuple[str, str]) -> None:
    valid, invalid = two_runs
    every = runs_json(noop_stack)
    ids = [r["evaluation_id"] for r in every]
    assert ids.index(invalid) < ids.index(valid)  # newest first
    assert [r["evaluation_id"] for r in runs_json(noop_stack, "--valid")] == [valid]
    assert invalid in [r["evaluation_id"] for r in runs_json(noop_stack, "--invalid")]
    assert valid not in [r["evaluation_id"] for r in runs_json(noop_stack, "--invalid")]
    assert [r["evaluation_id"] for r in runs_json(noop_stack, "--scenario", "online")] == [invalid]
    assert len(runs_json(noop_stack, "--limit", "1")) == 1
    assert runs_json(noop_stack, "--model", "digits_cnn") == []
    assert len(runs_json(noop_stack, "--framework", "noop", "--since", "1h")) == 2
    assert runs_json(noop_stack, "--since", "2100-01-01") == []
    table = cli(noop_stack, "ls", "--framework", "noop")  # the alias, a table
    assert table.returncode == 0, table.stderr
    assert valid in table.stdout and "VALID" in table.stdout and "INVALID" in table.stdout


def test_runs_refuses_a_bad_since(noop_stack: Stack) -> None:
    done = cli(noop_stack, "runs", "--since", "yesterday")
    assert done.returncode == 2
    assert "--since" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("fmt", ["csv", "parquet", "json"])
def test_export_reloads_with_the_databases_row_counts(
    noop_stack: Stack, two_runs: tuple[str, str], tmp_path: Path, fmt: str
) -> None:
    ids = list(two_runs)
    out = tmp_path / "export"
    done = cli(noop_stack, "export", *ids, "--format", fmt, "-o", str(out))
    assert done.returncode == 0, done.stderr
    read = {
        "csv": pd.read_csv,
        "parquet": pd.read_parquet,
        "json": lambda p: pd.read_json(p, lines=True),
    }[fmt]
    ext = {"csv": "csv", "parquet": "parquet", "json": "jsonl"}[fmt]
    ev = read(out / f"evaluations.{ext}")
    assert sorted(ev["evaluation_id"]) == sorted(ids)
    assert all(json.loads(s)["evaluation_id"] in ids for s in ev["summary"])
    for table in ("queries", "spans"):
        frame = read(out / f"{table}.{ext}")
        expected = count(noop_stack, table, ids)
        assert expected > 0 and len(frame) == expected, (table, len(frame), expected)
        assert set(frame["evaluation_id"]) == set(ids)
    # A query's correct samples are named so, not "label" (read as the expected class).
    queries = read(out / f"queries.{ext}")
    assert "correct" in queries.columns and "label" not in queries.columns


def test_export_of_an_unknown_evaluation_fails_in_one_line(
    noop_stack: Stack, tmp_path: Path
) -> None:
    done = cli(noop_stack, "export", "ev-nope", "-o", str(tmp_path / "x"))
    assert done.returncode == 1 and "ev-nope" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_report_json(noop_stack: Stack, two_runs: tuple[str, str]) -> None:
    done = cli(noop_stack, "report", *two_runs, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    summary = doc["sections"][0]["tables"][0]["rows"]
    assert sorted(r["evaluation_id"] for r in summary) == sorted(two_runs)


def test_report_chooses_the_format_by_extension(
    noop_stack: Stack, two_runs: tuple[str, str], tmp_path: Path
) -> None:
    for bad in ("r.pdf", "r.csv", "r"):
        done = cli(noop_stack, "report", *two_runs, "-o", str(tmp_path / bad))
        assert done.returncode == 2, (bad, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and ".md" in done.stderr
        assert not (tmp_path / bad).exists()
    out = tmp_path / "r.json"
    assert cli(noop_stack, "report", *two_runs, "-o", str(out)).returncode == 0
    assert json.loads(out.read_text())["sections"]


def test_markdown_figures_are_files_beside_it(
    noop_stack: Stack, two_runs: tuple[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "day.md"
    done = cli(noop_stack, "report", *two_runs, "-o", str(out))
    assert done.returncode == 0, done.stderr
    md = out.read_text()
    figures = sorted((tmp_path / "day_files").glob("*.svg"))
    assert figures and "base64" not in md
    for figure in figures:
        root = ElementTree.fromstring(figure.read_text())
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
        assert f"](day_files/{figure.name})" in md
    terminal = cli(noop_stack, "report", *two_runs)
    assert terminal.returncode == 0, terminal.stderr
    assert "base64" not in terminal.stdout and "figure 1:" in terminal.stdout
