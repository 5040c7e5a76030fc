"""Hostile input: every bad message, value and job the stack can be sent, at once.

A real nats-server, the server and a noop agent as child processes (real chDB under
the server). Every request subject gets random bytes, truncated msgpack, wrong types,
oversize and deeply nested payloads and must answer each with a typed error reply;
the job and trace streams and both buckets get the same plus the values that used to
kill services. Afterwards every process is up, a normal job succeeds, the poison is
listed by ``mlscope doctor`` and ``mlscope models --remote`` still works.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import anyio
import msgpack
import pytest

from cli.doctor_cmd import diagnose
from mlscope import bus as busmod
from mlscope import codec, names, remote
from mlscope.contracts import (
    EvaluationSummary,
    JobEvent,
    JobRequest,
    PrepareOp,
    ReleaseOp,
    RunOp,
    ScenarioSpec,
    new_id,
)
from mlscope.errors import ConfigError, MLScopeError, error_from_wire
from mlscope.jobs import stored_result, submit
from mlscope.registry import list_agents
from mlscope.settings import Settings
from tests.conftest import child_env, python, wait_agents, wait_server

pytestmark = pytest.mark.timeout(300)
AGENT = "hostile-noop"


def nested_msgpack(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]


def nested_json(size: int) -> bytes:
    half = size // 2
    return b"[" * half + b"]" * half


def bad_payloads() -> list[bytes]:
    good = codec.encode(
        {"op": "prepare", "evaluation_id": "ev-x", "model": "noop", "model_version": "1.0.0"}
    )
    return [
        os.urandom(64),
        os.urandom(4096),
        b"",
        b"\xc1",
        good[: len(good) // 2],
        codec.encode([1, 2, 3]),
        codec.encode("text"),
        codec.encode(17),
        codec.encode({"op": 5}),
        codec.encode({"op": "launch"}),
        codec.encode({"op": "prepare", "evaluation_id": 3, "model": ["x"]}),
        codec.encode(
            {
                "op": "prepare",
                "evaluation_id": "e",
                "model": "noop",
                "model_version": "1.0.0",
                "batch_size": 0,
            }
        ),
        codec.encode({"kind": "query", "evaluation_id": "e", "index": "zero", "inputs": 1}),
        codec.encode({"sql": 7}),
        codec.encode({"sql": "SELECT 1", "format": "arrow", "page_rows": -1}),
        codec.encode({"sql": "SELECT 1", "format": "arrow", "page_rows": 0}),
        codec.encode({"sql": "SELECT 1", "format": "arrow", "page_rows": [1]}),
        codec.encode({"sql": "SELECT 1", "format": "arrow", "page_rows": 2**64 - 1}),
        codec.encode({"sql": "SELECT 1", "format": "arrow", "offset": 0}),
        codec.encode({"cursor": "x" * 32, "page_rows": 1}),
        codec.encode({"sql": "SELECT 1", "format": "parquet"}),
        codec.encode({"evaluation_id": {"a": 1}}),
        # ids that would become subjects longer than nats-server's control line
        codec.encode(
            {
                "op": "prepare",
                "evaluation_id": "e" * 8000,
                "model": "noop",
                "model_version": "1.0.0",
            }
        ),
        codec.encode({"op": "release", "evaluation_id": "e" * 8000}),
        codec.encode({"kind": "query", "evaluation_id": "ev-x", "index": 2**64 - 1, "inputs": 1}),
        codec.encode({"x" * 100: "y" * 700_000}),
        nested_msgpack(200_000),
        msgpack.packb({"a": [{"b": [{"c": [[[[[[[[[[1]]]]]]]]]]}]}]}),
    ]


@pytest.fixture
def hostile_stack(settings: Settings) -> Iterator[tuple[Settings, list[subprocess.Popen[bytes]]]]:
    env = child_env(settings)
    procs = [
        subprocess.Popen([python(), "-m", "cli.main", "server", "--log-level", "warning"], env=env),
        subprocess.Popen(
            [
                python(),
                "-m",
                "cli.main",
                "agent",
                "--framework",
                "noop",
                "--agent-id",
                AGENT,
                "--log-level",
                "warning",
            ],
            env=env,
        ),
    ]
    try:
        anyio.run(wait_agents, settings, 1)
        anyio.run(wait_server, settings)
        yield settings, procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(20)


def test_every_bad_input_gets_a_typed_error_and_every_service_stays_up(
    hostile_stack: tuple[Settings, list[subprocess.Popen[bytes]]],
) -> None:
    settings, procs = hostile_stack
    refusals: dict[str, JobEvent] = {}

    sock = settings.data_dir / "model.graph"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock))

    async def main() -> None:
        async with busmod.connect(settings, name="hostile") as bus:
            await _requests(bus)
            await _buckets(bus, sock)
            await _streams(bus, refusals)
            await _subjects_not_utf8(bus, settings)
            await _rows_within_max_payload(bus)

    anyio.run(main, backend="asyncio")
    listener.close()
    assert [p.poll() for p in procs] == [None, None]
    # Jobs that cannot run were refused at once, each with its typed reason.
    assert refusals["constraint"].error and "constraint" in str(refusals["constraint"].error)
    assert refusals["level"].error and "trace level" in str(refusals["level"].error)
    assert refusals["batch0"].error is not None
    # A query over the bus's max payload is refused before any load, naming the limit.
    with pytest.raises(ConfigError, match="max payload"):
        anyio.run(lambda: submit(settings, _job(batch_size=20_000), timeout=60), backend="asyncio")
    # A normal job still runs, to a stored evaluation.
    normal = _job()
    summary = anyio.run(lambda: submit(settings, normal, timeout=90), backend="asyncio")
    assert summary.status == "completed" and summary.errors == 0 and summary.queries > 50

    async def stored() -> EvaluationSummary | None:  # what a submitter that missed "done" reads
        async with busmod.connect(settings, name="hostile") as bus:
            _, found = await stored_result(bus, normal.job_id)
            return found

    assert anyio.run(stored, backend="asyncio") == summary
    # The poison is visible to the operator, with its error.
    report = anyio.run(lambda: diagnose(settings, limit=100), backend="asyncio")
    dead = report["newest"]
    assert any(
        d["subject"].startswith("mlscope.traces.") and "span_id" in d["error"] for d in dead
    ), dead
    assert any(d["subject"] == names.JOBS_SUBJECT for d in dead), dead
    assert report["streams"][names.TRACES_STREAM]["bytes"] >= 0
    # The models listing survives the hostile bucket values and names them.
    out = subprocess.run(
        [python(), "-m", "cli.main", "models", "--remote"],
        env=child_env(settings),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert [p.poll() for p in procs] == [None, None]


async def _requests(bus: busmod.Bus) -> None:
    subjects = [
        names.agent_ctl(AGENT),
        names.agent_query(AGENT),
        names.agent_samples(AGENT),
        names.capability("noop", "noop"),
        names.SQL_SUBJECT,
        names.EVALUATION_SUBJECT,
    ]
    for subject in subjects:
        for payload in bad_payloads():
            if len(payload) > bus.nc.max_payload:
                continue
            msg = await bus.nc.request(subject, payload, timeout=10)
            reply = codec.decode(msg.data)
            assert isinstance(reply, dict) and reply.get("kind") == "error", (subject, reply)
            err = error_from_wire(reply["error"])
            assert isinstance(err, MLScopeError) and err.code != "error", (subject, reply)


async def _buckets(bus: busmod.Bus, sock: Path) -> None:
    agents = await bus.kv(names.AGENTS_BUCKET)
    desc = await bus.kv(names.AGENTS_BUCKET)
    entry = await desc.get(AGENT)
    assert entry.value is not None
    live = codec.decode(entry.value)
    for key, changes in (
        ("neg-pid", {"pid": -1}),
        ("future", {"heartbeat_at": 1e20}),
        ("nan", {"heartbeat_at": float("nan")}),
        ("types", {"frameworks": "noop", "cpu_cores": "many"}),
    ):
        await agents.put(key, codec.encode({**live, "agent_id": key, **changes}))
    # A live agent's description under another key: the agent listed twice, or kept
    # listed after it died, by whoever may write that key.
    await agents.put("imposter", codec.encode({**live, "heartbeat_at": time.time()}))
    for key, value in (
        ("nested", nested_msgpack(300_000)),
        ("random", os.urandom(512)),
        ("json", nested_json(400_000)),
    ):
        await agents.put(key, value)
    models = await bus.kv(names.MODELS_BUCKET)
    for key, value in (
        ("nested.1.noop", nested_json(400_000)),
        ("deep.1.noop", nested_json(200_000)),
        ("random.1.noop", os.urandom(300)),
        ("types.1.noop", json.dumps({"kind": "model", "name": 5}).encode()),
        ("sockety.1.0.0.noop", _socket_manifest(sock)),  # under its own key
    ):
        await models.put(key, value)
    await anyio.sleep(2.0)  # every watcher has seen them
    assert [d.agent_id for d in await list_agents(bus)] == [AGENT]


def _socket_manifest(sock: Path) -> bytes:
    """A manifest of the agent's framework whose asset is not a regular file."""
    return json.dumps(
        {
            "kind": "model",
            "name": "sockety",
            "version": "1.0.0",
            "framework": {"name": "noop", "version": "*"},
            "task": "platform_overhead",
            "inputs": [
                {"type": "tensor", "layer_name": "input", "element_type": "float32", "shape": [16]}
            ],
            "outputs": [{"type": "tensor", "layer_name": "output"}],
            "assets": {
                "base_url": f"file://{sock.parent}",
                "graph_path": sock.name,
                "sha256": "0" * 64,
            },
            "latency_only": True,
        }
    ).encode()


async def _subjects_not_utf8(bus: busmod.Bus, settings: Settings) -> None:
    """Subjects and reply subjects with bytes that are not UTF-8, written on a raw socket
    (no client library sends them), where a submitter, reader or agent may publish: a
    job's cancel, the agents' bucket, the traces stream (redelivered to the ingester
    until dead-lettered), the SQL subject's reply. The server hears on afterwards."""
    url = urlparse(settings.nats_url)
    frames = [
        b"PUB mlscope.job.\xff.cancel 1\r\nx\r\n",
        b"PUB $KV.mlscope_agents.\xfe\xff 1\r\nx\r\n",
        b"PUB " + names.traces("ev-bytes", "a").encode() + b".\xff 1\r\nx\r\n",
        b"PUB mlscope.traces.\xc3\x28.a 1\r\nx\r\n",
        b"PUB mlscope.db.sql _INBOX.\xff 2\r\n\x80\x80\r\n",
    ]
    with socket.create_connection((url.hostname or "127.0.0.1", url.port or 4222)) as raw:
        raw.recv(4096)  # INFO
        raw.sendall(b"CONNECT {}\r\n" + b"".join(frames) + b"PING\r\n")
        assert b"PONG" in _read_until(raw, b"PONG")
    await anyio.sleep(3.0)  # the ingester has fetched the batch
    with anyio.fail_after(20):
        assert (await remote.sql(bus, "SELECT 1", timeout=10))[1] == [[1]]
        assert [d.agent_id for d in await list_agents(bus)] == [AGENT]


def _read_until(raw: socket.socket, end: bytes, timeout_s: float = 10.0) -> bytes:
    """What the server sent until ``end`` (one recv may hold only part of it: the
    ``+OK`` of each frame can come apart from the ``PONG``), or until it closes."""
    raw.settimeout(timeout_s)
    got = b""
    while end not in got:
        chunk = raw.recv(4096)
        if not chunk:
            break
        got += chunk
    return got


async def _streams(bus: busmod.Bus, refusals: dict[str, JobEvent]) -> None:
    columns: dict[str, list[Any]] = {
        c: [1] for c in ("parent_id", "query_index", "level", "start_ns", "end_ns")
    }
    columns.update(span_id=["abc"], kind=["k"], name=["n"], attrs=[""])
    span = {
        "kind": "spans",
        "evaluation_id": "ev-poison",
        "agent_id": "a",
        "host": "h",
        "batch_id": "b1",
        "columns": columns,
    }
    for payload in [codec.encode(span), *bad_payloads()[:12], nested_msgpack(100_000)]:
        await bus.js.publish(names.traces("ev-poison", "a"), payload)
    good = JobRequest(model="noop", framework="noop").dump()
    jobs: dict[str, dict[str, Any]] = {
        "constraint": {"framework_version": ">>>1"},
        "level": {"trace_level": "bogus"},
        "batch0": {"scenario": {"name": "batched", "batch_sizes": [0]}},
    }
    subs = {}
    for name, change in jobs.items():
        job_id = new_id("job")
        subs[name] = await bus.nc.subscribe(names.job_events(job_id))
        await bus.js.publish(names.JOBS_SUBJECT, codec.encode({**good, **change, "job_id": job_id}))
    for payload in bad_payloads()[:12]:
        await bus.js.publish(names.JOBS_SUBJECT, payload)
    for long_id in ("j" * 200, "j" * 5000):  # a valid id, and one past the contract's bound
        short = {"name": "online", "qps": 50, "duration_s": 0.5}
        job = {**good, "job_id": long_id, "scenario": short}
        await bus.js.publish(names.JOBS_SUBJECT, codec.encode(job))
    for name, sub in subs.items():
        while name not in refusals:
            event = codec.decode_model(JobEvent, (await sub.next_msg(timeout=20)).data)
            if event.event == "failed":
                refusals[name] = event


async def _rows_within_max_payload(bus: busmod.Bus) -> None:
    """A local run whose request asks for row messages larger than the bus carries gets
    them within the max payload, its final one too; the agent goes on."""

    async def ctl(op: Any) -> dict[str, Any]:
        msg = await bus.nc.request(names.agent_ctl(AGENT), codec.encode_model(op), timeout=20)
        reply: dict[str, Any] = codec.decode(msg.data)
        assert reply.get("kind") != "error", reply
        return reply

    ev = "ev-bigrows"
    await ctl(PrepareOp(evaluation_id=ev, model="noop", model_version="1.0.0", batch_size=4096))
    sub = await bus.nc.subscribe(names.agent_rows(AGENT, ev))
    spec = ScenarioSpec(name="concurrency", concurrency=4, duration_s=0.5, batch_size=4096)
    await ctl(RunOp(evaluation_id=ev, scenario=spec, max_bytes=64 << 20))
    sizes, final = [], False
    while not final:
        msg = await sub.next_msg(timeout=30)
        sizes.append(len(msg.data))
        final = bool(codec.decode(msg.data).get("final"))
    assert max(sizes) <= bus.nc.max_payload, sizes
    await ctl(ReleaseOp(evaluation_id=ev))


def _job(*, batch_size: int = 1) -> JobRequest:
    return JobRequest(
        model="noop",
        framework="noop",
        scenario=ScenarioSpec(name="online", qps=200, duration_s=1, batch_size=batch_size),
    )
