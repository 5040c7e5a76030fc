"""What `mlscope report --json` and `mlscope export --format json` say of stored runs,
against a real stack (nats-server, server owning chDB, noop agent): every figure equals
one recomputed here, independently, from the raw per-query rows (nearest-rank
percentiles of completed - scheduled, warm-up left out), to the last digit, and every
count is a whole number, also beside a run that has no query rows; a cancelled run has
no latency to plot or compare; the API's ``stored`` tells "not stored" from "no
server"; an export into a file is refused before anything is read."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import anyio
import numpy as np
import pandas as pd
import pytest

from cli.stack import Stack
from mlscope.api import Client
from mlscope.contracts import EvaluationSummary, JobRequest, ScenarioSpec
from mlscope.natsserver import NatsServer
from tests.conftest import child_env, python

pytestmark = pytest.mark.timeout(180)


def _job(**scenario: object) -> JobRequest:
    spec = ScenarioSpec.model_validate(scenario)
    return JobRequest(model="noop", framework="noop", scenario=spec)


async def _runs(stack: Stack) -> tuple[EvaluationSummary, EvaluationSummary, pd.DataFrame]:
    """A run with warm-up queries, a run cancelled before any server took it (no query
    rows), and the raw rows of the first."""
    async with Client(stack.settings) as client:
        measured = await client.submit(
            _job(name="online", qps=400, duration_s=1.5, warmup_queries=50)
        )
        never = _job(name="online", qps=50, duration_s=20)
        await client.cancel(never.job_id, timeout=0.5)
        with anyio.fail_after(20):
            empty = await client.submit(never)
        return measured, empty, await client.queries(measured.evaluation_id)


def _nearest_rank(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(max(math.ceil(q / 100 * len(sorted_ms)), 1), len(sorted_ms)) - 1]


def _recomputed(rows: pd.DataFrame) -> dict[str, object]:
    measured = rows[rows["warmup"] == 0]
    ok = measured[measured["ok"] != 0]
    lat = sorted(((ok["completed_ns"] - ok["scheduled_ns"]) / 1e6).tolist())
    cut = math.floor(0.2 * len(lat))
    first = int(measured.loc[measured["outcome"] != 4, "issued_ns"].min())
    last = int(measured.loc[measured["completed_ns"] > 0, "completed_ns"].max())
    return {
        "queries": len(measured),
        "warmup_queries": len(rows) - len(measured),
        "p50_ms": _nearest_rank(lat, 50),
        "p90_ms": _nearest_rank(lat, 90),
        "p99_ms": _nearest_rank(lat, 99),
        "trimmed_mean_ms": float(np.mean(lat[cut : len(lat) - cut])),
        "throughput_ips": int(ok["batch_size"].sum()) / ((last - first) / 1e9),
    }


def _mlscope(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python(), "-m", "cli.main", *args],
        env=child_env(stack.settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_report_and_export_json_hold_the_figures_of_the_raw_rows(
    noop_stack: Stack, tmp_path: Path
) -> None:
    measured, empty, rows = anyio.run(_runs, noop_stack, backend="asyncio")
    assert empty.status == "cancelled" and empty.queries == 0
    expected = _recomputed(rows)
    assert expected["warmup_queries"] == 50

    done = _mlscope(noop_stack, "report", measured.evaluation_id, empty.evaluation_id, "--json")
    assert done.returncode == 0, done.stderr
    table = json.loads(done.stdout)["sections"][0]["tables"][0]["rows"]
    got = {r["evaluation_id"]: r for r in table}
    row, none = got[measured.evaluation_id], got[empty.evaluation_id]
    for key in ("queries", "warmup_queries", "p50_ms", "p90_ms", "p99_ms", "throughput_ips"):
        assert row[key] == expected[key], (key, row[key], expected[key])
    assert row["trimmed_mean_ms"] == pytest.approx(expected["trimmed_mean_ms"], rel=1e-12)
    assert row["throughput_ips"] == measured.throughput_ips  # the stored figure, every digit
    for key in ("queries", "warmup_queries", "batch_size"):  # whole numbers, in every row
        assert type(row[key]) is int and type(none[key]) is int, (key, row[key], none[key])
    assert none["queries"] == 0 and none["p99_ms"] is None

    again = _mlscope(noop_stack, "report", measured.evaluation_id, measured.evaluation_id, "--json")
    assert again.returncode == 0, again.stderr
    sections = json.loads(again.stdout)["sections"]  # named twice: one run, one row
    assert len(sections[0]["tables"][0]["rows"]) == 1
    assert not any(s["title"].startswith("Comparison") for s in sections)

    out = tmp_path / "export"
    done = _mlscope(
        noop_stack, "export", measured.evaluation_id, "--format", "json", "-o", str(out)
    )
    assert done.returncode == 0, done.stderr
    [exported] = [json.loads(x) for x in (out / "evaluations.jsonl").read_text().splitlines()]
    assert exported["throughput_ips"] == expected["throughput_ips"]
    assert json.loads(exported["summary"])["latency_ms"]["p99"] == expected["p99_ms"]
    queries = pd.read_json(out / "queries.jsonl", lines=True, precise_float=True)
    assert len(queries) == len(rows) and queries["query_index"].is_unique
    assert queries["completed_ns"].tolist() == rows["completed_ns"].tolist()

    out = tmp_path / "parquet"
    ids = (measured.evaluation_id, empty.evaluation_id)
    done = _mlscope(noop_stack, "export", *ids, "--format", "parquet", "-o", str(out))
    assert done.returncode == 0, done.stderr
    evaluations = pd.read_parquet(out / "evaluations.parquet").set_index("evaluation_id")
    for key in ("queries", "warmup_queries", "errors", "samples"):  # counts, typed as such
        assert pd.api.types.is_integer_dtype(evaluations[key]), (key, evaluations[key].dtype)
    assert evaluations.loc[empty.evaluation_id, "queries"] == 0
    assert evaluations.loc[measured.evaluation_id, "queries"] == len(rows)  # warm-up too


async def _cancelled_mid_run(stack: Stack) -> tuple[EvaluationSummary, EvaluationSummary]:
    """A completed run, and one cancelled after it had answered queries."""
    async with Client(stack.settings) as client:
        measured = await client.submit(_job(name="online", qps=100, duration_s=1.0))
        job = _job(name="online", qps=100, duration_s=20)
        result: list[EvaluationSummary] = []

        async def run() -> None:
            result.append(await client.submit(job))

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await anyio.sleep(2.0)
            assert await client.cancel(job.job_id) is not None
        return measured, result[0]


def test_a_cancelled_run_has_no_latency_to_plot_or_compare(noop_stack: Stack) -> None:
    """A cancelled run's summary has no latency figures (it stopped part-way): no
    report, plot or comparison gives it any either."""
    from analysis.compare import compare_runs
    from analysis.source import BusSource
    from mlscope.errors import ConfigError

    measured, cancelled = anyio.run(_cancelled_mid_run, noop_stack, backend="asyncio")
    assert cancelled.status == "cancelled" and cancelled.queries > 0
    assert cancelled.latency_ms is None or cancelled.latency_ms.p99 is None

    done = _mlscope(noop_stack, "report", measured.evaluation_id, cancelled.evaluation_id, "--json")
    assert done.returncode == 0, done.stderr
    sections = json.loads(done.stdout)["sections"]
    titles = [s["title"] for s in sections]
    assert not any(t.startswith("Comparison") for t in titles), titles
    plots = [p for s in sections for p in s["plots"]]
    assert not any(cancelled.evaluation_id in p for p in plots), plots
    with (
        BusSource(noop_stack.settings) as source,
        pytest.raises(ConfigError, match=f"{cancelled.evaluation_id} .*cancelled"),
    ):
        compare_runs(source, measured.evaluation_id, cancelled.evaluation_id, check=False)


def test_stored_without_a_server_is_a_bus_error_not_none(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """None means the database holds no such evaluation; with no server to ask (a bus
    and nothing on it), the answer is unknown, so it fails as every other read does."""
    from mlscope.errors import BusError
    from mlscope.settings import Settings

    async def go() -> None:
        settings = Settings(nats_url=nats_server.url, data_dir=tmp_path / "data")
        async with Client(settings) as client:
            with pytest.raises(BusError):
                await client.queries("ev-1")
            with pytest.raises(BusError):
                await client.stored("ev-1")

    anyio.run(go, backend="asyncio")


def test_export_into_a_file_is_refused_before_anything_is_read(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """``-o`` names a directory: a file there (or on the way) is refused in one line
    before the tables are read, here with no server to read them from."""
    import os

    from tests.conftest import REPO

    taken = tmp_path / "queries.csv"
    taken.write_text("kept\n")
    env = {
        **os.environ,
        "MLSCOPE_NATS_URL": nats_server.url,
        "MLSCOPE_DATA_DIR": str(tmp_path / "data"),
        "PYTHONPATH": str(REPO),
    }
    for out in (taken, taken / "sub"):
        done = subprocess.run(
            [python(), "-m", "cli.main", "export", "ev-1", "-o", str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 1, done.stderr
        assert done.stderr.strip().splitlines() == [
            f"mlscope export: cannot write into {out}: {taken} is not a directory"
        ]
    assert taken.read_text() == "kept\n"
