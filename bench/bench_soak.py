"""Soak: the noop model at a steady rate, run after run, watching for leaks and growth.

    PYTHONPATH=$PWD python bench/bench_soak.py [--duration 1800] [--qps 500] [--run-s 30]

Starts its own nats-server, server and noop agent (fresh data dir), then submits one
online job of ``--run-s`` seconds after another until ``--duration`` seconds have
passed. After every run it samples the resident memory of the server and the agent
processes and the bytes held by the job, trace and dead-letter streams. At the end it
prints every sample and the verdict figures: errors and failed jobs over all runs,
memory growth after warm-up (the first ``--warmup`` fraction of runs is excluded; least
squares slope in MB per hour), and the largest stream sizes. Nothing is asserted; the
figures are read and copied into docs/BENCHMARKS.md with their conditions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from mlscope import bus as busmod  # noqa: E402
from mlscope import names  # noqa: E402
from mlscope.contracts import JobRequest, ScenarioSpec  # noqa: E402
from mlscope.errors import MLScopeError  # noqa: E402
from mlscope.jobs import submit  # noqa: E402
from mlscope.natsserver import NatsServer  # noqa: E402
from mlscope.settings import Settings  # noqa: E402

STREAMS = (names.JOBS_STREAM, names.TRACES_STREAM, names.DEAD_STREAM)


async def stream_bytes(settings: Settings) -> dict[str, int]:
    async with busmod.connect(settings, name="soak") as bus:
        out = {}
        for name in STREAMS:
            try:
                out[name] = int((await bus.js.stream_info(name)).state.bytes)
            except Exception:  # not created yet
                out[name] = 0
        return out


async def wait_ready(settings: Settings, timeout: float = 60.0) -> None:
    from mlscope.registry import list_agents

    deadline = time.monotonic() + timeout
    async with busmod.connect(settings, name="soak") as bus:
        while time.monotonic() < deadline:
            try:
                if await list_agents(bus):
                    return
            except MLScopeError:
                pass
            await anyio.sleep(0.3)
    raise TimeoutError("the noop agent did not register")


def rss_mb(pid: int) -> float:
    return float(psutil.Process(pid).memory_info().rss) / 1e6


def one_run(settings: Settings, args: argparse.Namespace, k: int) -> dict[str, Any]:
    job = JobRequest(
        model="noop",
        framework="noop",
        trace_level=args.trace_level,
        scenario=ScenarioSpec(name="online", qps=args.qps, duration_s=args.run_s, seed=k),
    )
    try:
        s = anyio.run(
            lambda: submit(settings, job, timeout=args.run_s * 4 + 120), backend="asyncio"
        )
    except MLScopeError as exc:
        return {"failed": f"{type(exc).__name__}: {exc}"}
    return {
        "queries": s.queries,
        "errors": s.errors,
        "not_issued": s.not_issued,
        "valid": s.valid,
        "p50_ms": s.latency_ms.p50,
        "p99_ms": s.latency_ms.p99,
        "achieved_qps": s.achieved_qps,
    }


def slope_mb_per_h(t: list[float], mb: list[float]) -> float | None:
    if len(t) < 3:
        return None
    return float(np.polyfit(np.array(t) / 3600.0, np.array(mb), 1)[0])


def soak(args: argparse.Namespace, base: Path) -> list[dict[str, Any]]:
    with NatsServer(store_dir=base / "nats") as nats:
        settings = Settings(nats_url=nats.url, data_dir=base / "data")
        env = {**os.environ, **settings.as_env(), "PYTHONPATH": str(REPO)}
        cli = [sys.executable, "-m", "cli.main"]
        server = subprocess.Popen([*cli, "server", "--log-level", "warning"], env=env)
        agent = subprocess.Popen(
            [*cli, "agent", "--framework", "noop", "--log-level", "warning"], env=env
        )
        samples: list[dict[str, Any]] = []
        try:
            anyio.run(wait_ready, settings)
            t0 = time.monotonic()
            k = 0
            while time.monotonic() - t0 < args.duration:
                run = one_run(settings, args, k)
                run.update(
                    run=k,
                    t_s=round(time.monotonic() - t0, 1),
                    server_mb=rss_mb(server.pid),
                    agent_mb=rss_mb(agent.pid),
                    server_up=server.poll() is None,
                    agent_up=agent.poll() is None,
                    **anyio.run(stream_bytes, settings),
                )
                samples.append(run)
                print(json.dumps(run), flush=True)
                k += 1
        finally:
            for p in (agent, server):
                p.terminate()
                p.wait(30)
        return samples


def report(samples: list[dict[str, Any]], warmup: float) -> dict[str, Any]:
    done = [s for s in samples if "failed" not in s]
    steady = samples[int(len(samples) * warmup) :]
    t = [s["t_s"] for s in steady]
    return {
        "runs": len(samples),
        "failed_jobs": len(samples) - len(done),
        "queries": sum(s["queries"] for s in done),
        "errors": sum(s["errors"] + s["not_issued"] for s in done),
        "invalid_runs": sum(not s["valid"] for s in done),
        "p99_ms_median": float(np.median([s["p99_ms"] for s in done])) if done else None,
        "server_mb_first_last": (steady[0]["server_mb"], steady[-1]["server_mb"])
        if steady
        else None,
        "agent_mb_first_last": (steady[0]["agent_mb"], steady[-1]["agent_mb"]) if steady else None,
        "server_mb_per_h": slope_mb_per_h(t, [s["server_mb"] for s in steady]),
        "agent_mb_per_h": slope_mb_per_h(t, [s["agent_mb"] for s in steady]),
        "max_stream_bytes": {n: max(s[n] for s in samples) for n in STREAMS} if samples else {},
        "services_up": all(s["server_up"] and s["agent_up"] for s in samples),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds (default 30 min)")
    ap.add_argument("--qps", type=float, default=500.0)
    ap.add_argument("--run-s", type=float, default=30.0, help="seconds per job")
    ap.add_argument("--trace-level", default="model")
    ap.add_argument(
        "--warmup", type=float, default=0.2, help="fraction of runs left out of the memory slope"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlscope-soak-") as tmp:
        samples = soak(args, Path(tmp))
    print(json.dumps(report(samples, args.warmup), indent=2))


if __name__ == "__main__":
    main()
