"""Tracing end to end on a real stack: levels, the exported timeline, system samples,
agent history, and an ingester (the server) killed mid-stream."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import onnx
import onnxruntime as ort
import pytest

from analysis.layers import top_layers
from analysis.source import open_source
from cli import trace_cmd
from cli.main import main as mlscope_main
from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import codec, names, remote
from mlscope.contracts import EvaluationSummary, JobRequest, ScenarioSpec, new_id
from mlscope.jobs import submit
from mlscope.settings import Settings
from tests.conftest import REPO, child_env, make_data_dir, python, wait_agents, wait_server
from tests.stored_rows import span_batch
from tests.trace_faults import freeze_holding_batches, traces_consumer
from tests.tracing_fixtures import ensure_built

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tstack(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[Settings]:
    """nats-server, the server and an onnxruntime agent serving efficientnet_lite0 too."""
    ensure_built(zoo_dir, "efficientnet_lite0")
    base = make_data_dir(tmp_path_factory.mktemp("tstack"), zoo_dir)
    s = Stack(Settings(data_dir=base), nats_port=0, frameworks=["onnxruntime"])
    import os

    os.environ.setdefault("PYTHONPATH", str(REPO))
    live = s.start()
    try:
        anyio.run(wait_agents, live, 1)
        anyio.run(wait_server, live)
        yield live
    finally:
        s.stop()
        shutil.rmtree(base / "nats", ignore_errors=True)


def run_job(settings: Settings, model: str, level: str, queries: int) -> EvaluationSummary:
    job = JobRequest(
        model=model,
        framework="onnxruntime",
        trace_level=level,
        scenario=ScenarioSpec(name="online", qps=20, duration_s=30, max_queries=queries),
    )
    summary = anyio.run(lambda: submit(settings, job, timeout=120), backend="asyncio")
    assert summary.status == "completed" and summary.errors == 0, summary
    return summary


def sql(settings: Settings, query: str, **params: Any) -> list[list[Any]]:
    async def go() -> list[list[Any]]:
        async with busmod.connect(settings, name="test") as bus:
            return (await remote.sql(bus, query, params))[1]

    return anyio.run(go, backend="asyncio")


def wait_count(
    settings: Settings, table: str, eval_id: str, want: int, timeout: float = 30.0
) -> int:
    """Rows of one evaluation in ``table`` (FINAL) once ``want`` arrived (or time is up)."""
    deadline = time.monotonic() + timeout
    while True:
        n = int(
            sql(
                settings,
                f"SELECT count() FROM {table} FINAL WHERE evaluation_id = {{e:String}}",
                e=eval_id,
            )[0][0]
        )
        if n >= want or time.monotonic() > deadline:
            return n
        time.sleep(0.3)


def test_levels_end_to_end(tstack: Settings) -> None:
    none = run_job(tstack, "digits_cnn", "none", 6)
    model = run_job(tstack, "digits_cnn", "model", 6)
    assert wait_count(tstack, "spans", model.evaluation_id, 24) == 24
    assert wait_count(tstack, "spans", none.evaluation_id, 1, timeout=2) == 0
    kinds = sql(
        tstack,
        "SELECT kind, name, count() FROM spans FINAL WHERE evaluation_id = "
        "{e:String} GROUP BY kind, name ORDER BY kind, name",
        e=model.evaluation_id,
    )
    assert kinds == [
        ["query", "query", 6],
        ["step", "postprocess", 6],
        ["step", "predict", 6],
        ["step", "preprocess", 6],
    ]


def test_framework_trace_of_efficientnet_has_every_node_under_predict(
    tstack: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    queries = 3
    summary = run_job(tstack, "efficientnet_lite0", "framework", queries)
    eval_id = summary.evaluation_id
    # The nodes ORT executes for this model: its optimized graph, saved by ORT itself.
    graph = tstack.zoo_dir / "efficientnet_lite0" / "1.0.0" / "efficientnet_lite0.onnx"
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(graph), sess_options=opts, providers=["CPUExecutionProvider"])
    nodes = sorted(n.name for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)
    want = queries * (4 + len(nodes))
    assert wait_count(tstack, "spans", eval_id, want) == want

    out = tmp_path / "trace.json"
    for key, value in tstack.as_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(trace_cmd, "PAGE", 7)  # dozens of pages, none of them full at the end
    assert mlscope_main(["trace", eval_id, "-o", str(out)]) == 0
    assert mlscope_main(["trace", "ev-nosuchthing", "-o", str(tmp_path / "x.json")]) == 1
    doc = json.loads(out.read_text())
    events = doc["traceEvents"]
    predicts = {
        e["args"]["span_id"]: e for e in events if e.get("ph") == "X" and e["name"] == "predict"
    }
    assert len(predicts) == queries
    children: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e["cat"] == "layer":
            children[e["args"]["parent_id"]].append(e)
    assert set(children) == set(predicts)  # every layer hangs under a predict span
    for sid, p in predicts.items():
        layers = children[sid]
        assert sorted(e["name"] for e in layers) == nodes
        for e in layers:
            assert e["pid"] == p["pid"] and e["tid"] == p["tid"]
            assert e["args"]["query_index"] == p["args"]["query_index"]
            assert p["ts"] - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= p["ts"] + p["dur"] + 1e-3
            assert e["args"]["attrs"]["op_type"] and "shape" in e["args"]["attrs"]
            assert e["args"]["attrs"]["output_bytes"] >= 0  # ORT's memory per node
    # Table 3's allocated memory per layer, from those attributes.
    top = top_layers(open_source(tstack), eval_id, n=5)
    assert len(top) == 5 and (top["alloc_mb"] > 0).all(), top
    # One timeline: the agent's predict spans sit inside the load generator's query.
    issued = {e["id"]: e["ts"] for e in events if e.get("cat") == "loadgen" and e["ph"] == "b"}
    done = {e["id"]: e["ts"] for e in events if e.get("cat") == "loadgen" and e["ph"] == "e"}
    for p in predicts.values():
        q = p["args"]["query_index"]
        slack = summary.clock_rtt_ns / 1000 + 1000  # µs: offset error is bounded by RTT/2
        assert issued[q] - slack <= p["ts"] and p["ts"] + p["dur"] <= done[q] + slack


def test_system_level_samples_and_agent_history(tstack: Settings) -> None:
    summary = run_job(tstack, "digits_cnn", "system", 20)
    n = wait_count(tstack, "system_samples", summary.evaluation_id, 1)
    assert n > 0
    metrics = {
        r[0]
        for r in sql(
            tstack,
            "SELECT DISTINCT metric FROM system_samples FINAL WHERE evaluation_id = {e:String}",
            e=summary.evaluation_id,
        )
    }
    assert {"cpu.util", "proc.rss_bytes", "proc.threads"} <= metrics
    model = run_job(tstack, "digits_cnn", "model", 3)  # below system: no samples
    assert wait_count(tstack, "spans", model.evaluation_id, 12) == 12
    assert wait_count(tstack, "system_samples", model.evaluation_id, 1, timeout=1) == 0
    # The server records the agents' bucket: an agent that starts, beats and leaves.
    assert (
        int(
            sql(
                tstack,
                "SELECT count() FROM agent_history FINAL WHERE agent_id = {a:String}",
                a=summary.agent_id,
            )[0][0]
        )
        >= 1
    )
    agent = subprocess.Popen(
        [python(), "-m", "cli.main", "agent", "--framework", "tflite", "--agent-id", "passing-by"],
        env=child_env(tstack),
    )
    try:
        anyio.run(wait_agents, tstack, 2)
        time.sleep(2.5)  # a heartbeat or two
    finally:
        agent.terminate()
        agent.wait(20)
    deadline = time.monotonic() + 15
    while True:
        events = [
            r[0]
            for r in sql(
                tstack,
                "SELECT event FROM agent_history FINAL "
                "WHERE agent_id = 'passing-by' ORDER BY revision",
            )
        ]
        if events[-1:] == ["removed"] or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert events[0] == "registered" and events[-1] == "removed", events
    assert "heartbeat" in events


def test_killed_ingester_loses_and_duplicates_no_span(settings: Settings) -> None:
    """SIGKILL the server (the ingester and chDB owner) mid-stream; restart; count."""
    env = child_env(settings)
    eval_id, per, batches = new_id("ev"), 500, 80
    server = subprocess.Popen([python(), "-m", "cli.main", "server"], env=env)
    try:
        anyio.run(wait_server, settings)

        async def publish(first: int, last: int) -> None:
            async with busmod.connect(settings, name="test") as bus:
                for b in range(first, last):
                    batch = span_batch(eval_id, b * per + 1, per)
                    await bus.js.publish(
                        names.traces(eval_id, batch.agent_id),
                        codec.encode_model(batch),
                        headers={"Nats-Msg-Id": batch.batch_id},
                    )
                    await anyio.sleep(0.05)

        # The publisher keeps going through the kill and the restart.
        publisher = threading.Thread(
            target=lambda: anyio.run(publish, 0, batches, backend="asyncio")
        )
        publisher.start()
        deadline = time.monotonic() + 30
        while wait_count(settings, "spans", eval_id, 1, timeout=0) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # Killed while it holds delivered, unacknowledged batches: JetStream must give
        # exactly those to the next server (redelivery), which must not store them twice.
        held = freeze_holding_batches(settings, server)
        server.send_signal(signal.SIGKILL)  # mid-stream: some batches stored, others not
        server.wait(10)
        publishing_at_kill = int(publisher.is_alive())
        server = subprocess.Popen([python(), "-m", "cli.main", "server"], env=env)
        anyio.run(wait_server, settings)
        total = per * batches
        assert wait_count(settings, "spans", eval_id, total, timeout=60) == total
        time.sleep(1.0)  # anything redelivered late would show now
        rows = sql(
            settings,
            "SELECT count(), uniqExact(span_id), min(span_id), max(span_id) "
            "FROM spans FINAL WHERE evaluation_id = {e:String}",
            e=eval_id,
        )
        publisher.join(30)
        assert rows == [[total, total, 1, total]]
        assert publishing_at_kill  # the kill really happened while spans were flowing
        # Redelivery really happened: the durable consumer delivered more often than the
        # stream has messages (each redelivery takes a consumer sequence number), at
        # least once for every batch the killed server held.
        delivered = anyio.run(traces_consumer, settings, backend="asyncio").delivered
        assert delivered is not None and delivered.stream_seq == batches
        assert delivered.consumer_seq - delivered.stream_seq >= held > 0, (delivered, held)
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(20)
