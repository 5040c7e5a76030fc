"""The walking skeleton end to end: real nats-server, server and agent processes, chDB."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Any

import anyio
import pytest

from mlscope import bus as busmod
from mlscope import remote
from mlscope.buildlock import BuildLock
from mlscope.contracts import EvaluationSummary, JobRequest, ScenarioSpec
from mlscope.errors import ResolutionError, UnknownModelError
from mlscope.jobs import submit
from mlscope.provision import AGENT_TTL_S
from mlscope.registry import list_agents
from mlscope.settings import Settings
from tests.conftest import child_env, python, wait_agents

pytestmark = pytest.mark.timeout(240)


def run_job(settings: Settings, **kw: Any) -> EvaluationSummary:
    fields: dict[str, Any] = {
        "model": "digits_cnn",
        "framework": "onnxruntime",
        "scenario": ScenarioSpec(name="online", qps=200, duration_s=2),
        **kw,
    }
    job = JobRequest.model_validate(fields)
    return anyio.run(lambda: submit(settings, job, timeout=120), backend="asyncio")


def query(settings: Settings, sql: str, **params: object) -> list[list[Any]]:
    async def go() -> list[list[Any]]:
        async with busmod.connect(settings, name="test") as bus:
            return (await remote.sql(bus, sql, params))[1]

    return anyio.run(go, backend="asyncio")


def wait_rows(settings: Settings, sql: str, expected: int, timeout: float = 30, **p: object) -> int:
    deadline = time.monotonic() + timeout
    got = -1
    while time.monotonic() < deadline:
        got = int(query(settings, sql, **p)[0][0])
        if got >= expected:
            break
        time.sleep(0.3)
    return got


def test_online_evaluation_end_to_end(stack: Settings) -> None:
    s = run_job(
        stack,
        scenario=ScenarioSpec(name="online", qps=200, duration_s=2, seed=3),
        trace_level="model",
    )
    assert s.status == "completed" and s.errors == 0 and s.not_issued == 0
    assert s.queries == s.samples > 300
    assert s.framework["name"] == "onnxruntime" and s.framework["version"].startswith("1.")
    assert s.model == {"name": "digits_cnn", "version": "1.0.0"}
    lat = s.latency_ms
    assert 0 < lat.p50 <= lat.p90 <= lat.p99 <= lat.max  # type: ignore[operator]
    assert s.issue_lag_us["p50"] is not None and s.issue_lag_us["p50"] >= 0
    assert s.accuracy is not None and s.accuracy["top1"] > 0.95
    assert s.achieved_qps and abs(s.achieved_qps / s.scheduled_qps - 1) < 0.05  # type: ignore[operator]
    # The same clock on one host: the estimated agent offset is within the ping RTT.
    assert abs(s.clock_offset_ns) <= max(s.clock_rtt_ns, 2_000_000)

    # Raw per-query rows are stored, latency measured from the scheduled time.
    rows = query(
        stack,
        "SELECT count(), min(issued_ns - scheduled_ns), "
        "sum(completed_ns < scheduled_ns) FROM queries FINAL "
        "WHERE evaluation_id = {e:String}",
        e=s.evaluation_id,
    )
    assert rows[0][0] == s.queries and rows[0][1] >= 0 and rows[0][2] == 0

    # Model-level spans: exactly queries x (preprocess, predict, postprocess).
    steps = wait_rows(
        stack,
        "SELECT count() FROM spans FINAL WHERE evaluation_id = {e:String} AND kind = 'step'",
        3 * s.queries,
        e=s.evaluation_id,
    )
    assert steps == 3 * s.queries
    names = query(
        stack,
        "SELECT name, count() FROM spans FINAL WHERE evaluation_id = "
        "{e:String} GROUP BY name ORDER BY name",
        e=s.evaluation_id,
    )
    assert names == [
        ["postprocess", s.queries],
        ["predict", s.queries],
        ["preprocess", s.queries],
        ["query", s.queries],
    ]


def test_batched_reports_throughput_and_spec_is_stored(stack: Settings) -> None:
    s = run_job(
        stack,
        scenario=ScenarioSpec(name="batched", batch_size=16, duration_s=1.5, min_duration_s=1),
    )
    assert s.status == "completed" and s.errors == 0 and s.valid
    assert s.samples == 16 * s.queries and s.throughput_ips and s.throughput_ips > 1000
    assert s.accuracy and s.accuracy["top1"] > 0.95

    async def fetch() -> tuple[dict[str, Any], dict[str, Any]]:
        async with busmod.connect(stack, name="test") as bus:
            return await remote.evaluation(bus, s.evaluation_id)

    spec, stored = anyio.run(fetch, backend="asyncio")
    assert stored["evaluation_id"] == s.evaluation_id
    assert spec["manifest"]["name"] == "digits_cnn"
    # A built zoo model is verified against its build lock: that is the hash that ran.
    lock = BuildLock.read(stack.data_dir / "zoo" / "digits_cnn" / "1.0.0")
    assert lock is not None
    assert spec["artifact_sha256"] == lock.artifacts[spec["manifest"]["assets"]["graph_path"]]
    assert spec["job"]["scenario"]["batch_size"] == 16 and spec["mlscope_version"]


def test_trace_level_none_emits_no_span(stack: Settings) -> None:
    s = run_job(
        stack, scenario=ScenarioSpec(name="online", qps=100, duration_s=1), trace_level="none"
    )
    time.sleep(1.0)
    n = query(
        stack, "SELECT count() FROM spans FINAL WHERE evaluation_id = {e:String}", e=s.evaluation_id
    )
    assert n == [[0]]


def test_unknown_model_fails_fast_naming_known_models(stack: Settings) -> None:
    t = time.monotonic()
    with pytest.raises(UnknownModelError, match=r"known models: .*digits_cnn"):
        run_job(stack, model="resnet9000")
    assert time.monotonic() - t < 10


def test_missing_framework_or_version_names_live_agents(stack: Settings) -> None:
    with pytest.raises(Exception, match=r"no manifest|no live agent") as info:
        run_job(stack, framework="tensorflow")
    assert "digits_cnn" in str(info.value)
    with pytest.raises(ResolutionError, match=r"live agents: .*onnxruntime 1\."):
        run_job(stack, framework_version=">=99")


def test_cli_submit_json_and_agents(stack: Settings) -> None:
    env = child_env(stack)
    out = subprocess.run(
        [
            python(),
            "-m",
            "cli.submit",
            "digits_cnn",
            "--framework",
            "onnxruntime",
            "--scenario",
            "online",
            "--qps",
            "100",
            "--duration",
            "1",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    for key in (
        "evaluation_id",
        "status",
        "valid",
        "invalid_reasons",
        "model",
        "framework",
        "agent_id",
        "scenario",
        "queries",
        "duration_s",
        "requested_qps",
        "achieved_qps",
        "latency_ms",
        "issue_lag_us",
        "throughput_ips",
        "accuracy",
    ):
        assert key in doc, key
    assert set(doc["latency_ms"]) >= {"trimmed_mean", "p50", "p90", "p99", "max"}
    bad = subprocess.run(
        [python(), "-m", "cli.submit", "nope", "--framework", "onnxruntime"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode != 0 and "unknown model 'nope'" in bad.stderr
    # The job's id as a server took it, then its error in one line.
    said = bad.stderr.strip().splitlines()
    assert len(said) == 2 and said[0].strip().startswith("job "), said
    agents = subprocess.run(
        [python(), "-m", "cli.main", "agents", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (desc,) = [a for a in json.loads(agents.stdout) if a["frameworks"][0]["name"] == "onnxruntime"]
    assert desc["cpu_cores"] >= 1 and desc["memory_bytes"] > 0 and desc["arch"]
    assert "digits_cnn" in {m["name"] for m in desc["models"]}


def test_agent_registers_and_expires_after_sigkill(stack: Settings) -> None:
    proc = subprocess.Popen(
        [python(), "-m", "cli.main", "agent", "--framework", "onnxruntime", "--agent-id", "doomed"],
        env=child_env(stack),
    )
    try:
        agents = anyio.run(wait_agents, stack, 2)
        assert "doomed" in {a.agent_id for a in agents}
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()

        async def gone() -> float:
            async with busmod.connect(stack, name="test") as bus:
                while "doomed" in {a.agent_id for a in await list_agents(bus)}:
                    await anyio.sleep(0.2)
            return time.monotonic() - killed

        assert anyio.run(gone, backend="asyncio") <= AGENT_TTL_S + 2
    finally:
        if proc.poll() is None:
            proc.kill()


def test_clean_exit_deletes_the_registry_entry(stack: Settings) -> None:
    proc = subprocess.Popen(
        [python(), "-m", "cli.main", "agent", "--framework", "onnxruntime", "--agent-id", "polite"],
        env=child_env(stack),
    )
    anyio.run(wait_agents, stack, 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0

    async def ids() -> set[str]:
        async with busmod.connect(stack, name="test") as bus:
            return {a.agent_id for a in await list_agents(bus, include_stale=True)}

    assert "polite" not in anyio.run(ids, backend="asyncio")


def test_rerun_reproduces_the_stored_specification(stack: Settings) -> None:
    from cli.rerun_cmd import rerun

    first = run_job(
        stack,
        scenario=ScenarioSpec(name="online", qps=150, duration_s=1, seed=7),
        trace_level="none",
    )
    second = anyio.run(rerun, stack, first.evaluation_id, backend="asyncio")

    async def specs() -> tuple[dict[str, Any], dict[str, Any]]:
        async with busmod.connect(stack, name="test") as bus:
            a, _ = await remote.evaluation(bus, first.evaluation_id)
            b, _ = await remote.evaluation(bus, second.evaluation_id)
            return a, b

    a, b = anyio.run(specs, backend="asyncio")
    assert b["job"]["rerun_of"] == first.evaluation_id
    volatile = {
        "job_id",
        "submitted_at",
        "rerun_of",
        "model_version",
        "manifest_sha256",
        "framework_version",
        "system",
    }
    assert {k: v for k, v in b["job"].items() if k not in volatile} == {
        k: v for k, v in a["job"].items() if k not in volatile
    }
    # a rerun is pinned to the original agent's host
    assert b["job"]["system"]["host"] == a["agent"]["host"]
    assert b["job"]["model_version"] == a["manifest"]["version"]
    assert b["job"]["manifest_sha256"] == a["manifest_sha256"] == b["manifest_sha256"]
    (fw,) = [f for f in a["agent"]["frameworks"] if f["name"] == "onnxruntime"]
    assert b["job"]["framework_version"] == f"=={fw['version']}"
    for key in ("manifest", "manifest_file", "artifact_sha256", "mlscope_version", "git_commit"):
        assert b[key] == a[key], key
    assert b["agent"]["frameworks"] == a["agent"]["frameworks"]
    assert second.scenario == first.scenario and second.queries == first.queries


def test_malformed_control_requests_get_a_typed_error_reply(stack: Settings) -> None:
    from mlscope import codec, names
    from mlscope.bus import request
    from mlscope.errors import WireError

    async def go() -> None:
        async with busmod.connect(stack, name="test") as bus:
            agent = (await list_agents(bus))[0]
            subject = names.agent_ctl(agent.agent_id)
            for bad in (
                {"op": "prepare"},
                {
                    "op": "prepare",
                    "evaluation_id": "e",
                    "model": "digits_cnn",
                    "model_version": "1.0.0",
                    "batch_size": "many",
                },
                [1, 2],
            ):
                with pytest.raises(WireError):
                    await request(bus, subject, codec.encode(bad), timeout=10)
            pong = await request(bus, subject, codec.encode({"op": "ping"}), timeout=10)
            assert "t_agent" in pong  # still serving

    anyio.run(go, backend="asyncio")
