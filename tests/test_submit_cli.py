"""The ``mlscope-submit`` entry point, as a user runs it, for every scenario flag.

Each test runs the installed console script in a child process against a real stack
(nats-server, server, noop agent) and reads its ``--json`` summary. Runs are short
and validity is loosened to what a shared machine can meet: what is tested is that
each flag reaches the scenario and shows in the summary, not speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import remote, replay_file, schedule
from mlscope.stats import percentile
from tests.conftest import LOOSE_FLAGS, child_env

pytestmark = pytest.mark.timeout(180)

SUBMIT = Path(sys.executable).parent / "mlscope-submit"


def submit_json(stack: Stack, *flags: str) -> dict[str, Any]:
    """``mlscope-submit noop --framework noop FLAGS --json``: its summary."""
    out = subprocess.run(
        [str(SUBMIT), "noop", "--framework", "noop", "--trace-level", "none", *flags, "--json"],
        env=child_env(stack.settings),
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    assert doc["status"] == "completed" and doc["errors"] == 0 and doc["not_issued"] == 0
    return doc


def stored(stack: Stack, evaluation_id: str) -> np.ndarray:
    """(scheduled, issued, completed, ok) ns of every stored query, in index order."""

    async def go() -> list[list[Any]]:
        async with busmod.connect(stack.settings, name="test") as bus:
            return (
                await remote.sql(
                    bus,
                    "SELECT scheduled_ns, issued_ns, completed_ns, ok FROM queries FINAL "
                    "WHERE evaluation_id = {e:String} ORDER BY query_index",
                    {"e": evaluation_id},
                )
            )[1]

    return np.asarray(anyio.run(go, backend="asyncio"), dtype=np.int64).reshape(-1, 4)


def only_early_stopping(doc: dict[str, Any]) -> bool:
    """Short runs may lack the queries early stopping wants; nothing else may fail."""
    return all(r.startswith("early stopping") for r in doc["invalid_reasons"])


def max_in_flight(rows: np.ndarray) -> int:
    issued, done = rows[:, 1], rows[:, 2]
    return max(int((issued <= t).sum() - (done <= t).sum()) for t in issued)


def test_single_stream(noop_stack: Stack) -> None:
    doc = submit_json(noop_stack, "--scenario", "single-stream", "--duration", "1", *LOOSE_FLAGS)
    assert doc["scenario"]["name"] == "single-stream" and doc["scenario"]["concurrency"] == 1
    assert doc["requested_qps"] is None and doc["queries"] > 20
    assert only_early_stopping(doc), doc["invalid_reasons"]
    rows = stored(noop_stack, doc["evaluation_id"])
    assert len(rows) == doc["queries"]
    assert (rows[:, 0] == rows[:, 1]).all()  # closed loop: scheduled when sent
    assert max_in_flight(rows) == 1
    assert (rows[1:, 1] >= rows[:-1, 2]).all()  # the next goes when the last came back


def test_concurrency(noop_stack: Stack) -> None:
    doc = submit_json(
        noop_stack,
        "--scenario",
        "concurrency",
        "--concurrency",
        "4",
        "--duration",
        "1",
        *LOOSE_FLAGS,
    )
    assert doc["scenario"]["name"] == "concurrency" and doc["scenario"]["concurrency"] == 4
    assert doc["requested_qps"] is None and doc["queries"] > 20
    assert only_early_stopping(doc), doc["invalid_reasons"]
    assert max_in_flight(stored(noop_stack, doc["evaluation_id"])) == 4


def test_multi_stream(noop_stack: Stack) -> None:
    doc = submit_json(
        noop_stack,
        "--scenario",
        "multi-stream",
        "--qps",
        "20",
        "--batch-size",
        "4",
        "--duration",
        "1",
        *LOOSE_FLAGS,
    )
    assert doc["scenario"]["name"] == "multi-stream" and doc["scenario"]["batch_size"] == 4
    assert doc["queries"] == 20 and doc["samples"] == 80 and doc["requested_qps"] == 20
    rows = stored(noop_stack, doc["evaluation_id"])
    assert (rows[:, 0] == np.arange(1, 21) * 50_000_000).all()  # one query every 50 ms


def test_constant(noop_stack: Stack) -> None:
    doc = submit_json(
        noop_stack, "--scenario", "constant", "--qps", "100", "--duration", "1", *LOOSE_FLAGS
    )
    assert doc["scenario"]["name"] == "constant" and doc["requested_qps"] == 100
    assert doc["queries"] == 100 and doc["samples"] == 100
    assert doc["scheduled_qps"] == pytest.approx(100, rel=0.02)
    rows = stored(noop_stack, doc["evaluation_id"])
    assert (rows[:, 0] == np.arange(1, 101) * 10_000_000).all()  # exactly every 10 ms
    assert (rows[:, 1] >= rows[:, 0]).all()


def test_replay_schedule_file(noop_stack: Stack, tmp_path: Path) -> None:
    gaps = [0.0, 0.01, 0.002, 0.05, 0.0, 0.02] * 5
    path = tmp_path / "arrivals.txt"
    path.write_text("# inter-arrival times, s\n" + "\n".join(f"{g}" for g in gaps) + "\n")
    doc = submit_json(noop_stack, "--scenario", "replay", "--schedule", str(path), *LOOSE_FLAGS)
    assert doc["scenario"]["name"] == "replay" and doc["requested_qps"] is None
    assert doc["scenario"]["arrivals_s"] == pytest.approx(gaps)
    assert doc["queries"] == len(gaps)
    rows = stored(noop_stack, doc["evaluation_id"])
    assert (rows[:, 0] == replay_file.replay(path).offsets_ns).all()


def test_latency_bound_on_an_online_run(noop_stack: Stack) -> None:
    common = (
        "--scenario",
        "online",
        "--qps",
        "600",
        "--duration",
        "1",
        "--seed",
        "3",
        *LOOSE_FLAGS,
    )
    tight = submit_json(noop_stack, *common, "--latency-bound-ms", "0.001")
    assert tight["scenario"]["latency_bound_ms"] == 0.001
    assert not tight["valid"]
    assert any(
        r.startswith("p99 latency") and r.endswith("> bound 0.001 ms")
        for r in tight["invalid_reasons"]
    ), tight["invalid_reasons"]
    # Reported p99 is the one judged against the bound.
    assert tight["latency_ms"]["p99"] > 0.001
    loose = submit_json(noop_stack, *common, "--latency-bound-ms", "1000")
    assert loose["scenario"]["latency_bound_ms"] == 1000
    assert not any("bound" in r for r in loose["invalid_reasons"]), loose["invalid_reasons"]
    # 600 queries, none over 1 s: enough for early stopping (459 under a p99 bound).
    assert loose["queries"] == len(schedule.poisson(600, duration_s=1, seed=3)) > 459


def test_peak_search(noop_stack: Stack) -> None:
    """From the default 100 QPS, which is too few queries in 1 s to show p99: the
    search starts at the lowest rate that can, and reports what it tried. The bound is
    one no run of this machine's speed misses at the first rate, so the outcome does
    not depend on how loaded the machine is; the search's steps have their own tests."""
    bound = 20_000
    doc = submit_json(
        noop_stack,
        *("--scenario", "peak", "--latency-bound-ms", str(bound), "--duration", "1"),
        *("--peak-trials", "3", *LOOSE_FLAGS),
    )
    assert doc["scenario"]["name"] == "peak" and doc["scenario"]["latency_bound_ms"] == bound
    points = doc["points"]
    assert len(points) == 3
    assert points[0]["qps"] == pytest.approx(1.1 * 459)  # not 100
    passing = [p["qps"] for p in points if p["valid"]]
    assert passing, [p["invalid_reasons"] for p in points]
    assert doc["peak_qps"] == max(passing)
    assert doc["valid"] and doc["requested_qps"] == doc["peak_qps"]
    best = next(p for p in points if p["qps"] == doc["peak_qps"])
    assert doc["evaluation_id"] != best["evaluation_id"]  # the parent, listing its runs
    assert doc["latency_ms"]["p99"] == best["latency_ms"]["p99"] <= bound
    for p in points:
        assert p["evaluation_id"].startswith(doc["evaluation_id"] + "-")
        lat = stored(noop_stack, p["evaluation_id"])
        assert len(lat) == len(schedule.poisson(p["qps"], duration_s=1, seed=0))
        ok = lat[:, 3] == 1  # latencies of answered queries, from the schedule
        reported = percentile((lat[ok, 2] - lat[ok, 0]) / 1e6, 99)
        assert p["latency_ms"]["p99"] == pytest.approx(reported), (p, int((~ok).sum()))
        assert p["valid"] == (p["latency_ms"]["p99"] <= bound and not p["invalid_reasons"])
