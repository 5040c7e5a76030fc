"""Scale benchmarks: job resolution with 32 registered agents, and aggregate noop
throughput over N agents sharing one queue group relative to 1 agent.

    PYTHONPATH=$PWD python bench/bench_scale.py [--agents 8] [--queries 4000]

Starts its own nats-server and agent processes (noop framework); prints medians.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.predictors import probe  # noqa: E402
from broker.resolve import resolve  # noqa: E402
from mlscope import bus as busmod  # noqa: E402
from mlscope import codec, names  # noqa: E402
from mlscope.catalog import Catalog, default_manifest_dirs  # noqa: E402
from mlscope.contracts import AgentDescription, JobRequest, ModelOffer, Query  # noqa: E402
from mlscope.natsserver import NatsServer  # noqa: E402
from mlscope.provision import provisioned  # noqa: E402
from mlscope.registry import AgentCache, list_agents  # noqa: E402
from mlscope.settings import Settings  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.array(xs), q))


async def resolution(settings: Settings, n_agents: int, rounds: int) -> dict[str, float]:
    """Register n agents (real descriptions in the registry bucket); time
    list_agents + resolve, the work a server does per job before it runs it."""
    catalog = Catalog.load(default_manifest_dirs(None))
    entry = catalog.find("noop", framework="noop")
    info = probe("noop")
    assert info is not None
    async with provisioned(settings, name="bench") as bus:
        kv = await bus.kv(names.AGENTS_BUCKET)

        async def register() -> None:
            """(Re)put every entry: the bucket's TTL drops them after AGENT_TTL_S."""
            now = time.time()
            for i in range(n_agents):
                desc = AgentDescription(
                    agent_id=f"bench-{i:02d}",
                    host="h",
                    arch="x86_64",
                    os="Linux",
                    cpu_model="c",
                    cpu_cores=2,
                    memory_bytes=1 << 30,
                    frameworks=(info,),
                    models=(
                        ModelOffer(
                            name="noop",
                            version=entry.manifest.version,
                            framework="noop",
                            sha256=entry.manifest.assets.sha256,
                        ),
                    ),
                    capabilities=(names.capability("noop", "noop"),),
                    pid=1,
                    mlscope_version="0",
                    started_at=now,
                    heartbeat_at=now + 3600,
                    heartbeat_s=1,
                )
                await kv.put(desc.agent_id, codec.encode_model(desc))

        await register()
        assert len(await list_agents(bus)) == n_agents  # registered (and a warm-up)
        total, pure = [], []
        short = 0
        for n in range(rounds):
            if n % 20 == 0:
                await register()
            job = JobRequest(model="noop", framework="noop")
            t0 = time.perf_counter()
            agents = await list_agents(bus)
            t1 = time.perf_counter()
            if len(agents) != n_agents:  # see docs/BENCHMARKS.md: a short read
                short += 1
                continue
            resolve(job, agents, catalog)
            t2 = time.perf_counter()
            total.append((t2 - t0) * 1e3)
            pure.append((t2 - t1) * 1e3)
        # What the server does: resolve from the watched registry (AgentCache).
        cache = AgentCache(bus)
        cached = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(cache.run)
            await register()
            await cache.ready.wait()
            for _ in range(rounds):
                job = JobRequest(model="noop", framework="noop")
                t0 = time.perf_counter()
                resolve(job, cache.agents(), catalog)
                cached.append((time.perf_counter() - t0) * 1e3)
            assert len(cache.agents()) == n_agents
            tg.cancel_scope.cancel()
        for i in range(n_agents):
            await kv.delete(f"bench-{i:02d}")
    return {
        "p50_ms": pct(total, 50),
        "p99_ms": pct(total, 99),
        "resolve_only_p50_ms": pct(pure, 50),
        "cached_p50_ms": pct(cached, 50),
        "cached_p99_ms": pct(cached, 99),
        "short_reads": short,
    }


async def throughput(settings: Settings, n_agents: int, queries: int, inflight: int) -> float:
    """Queries/s through the noop capability queue group served by n agents."""
    eval_id = f"ev-bench-{n_agents}"
    async with busmod.connect(settings, name="bench") as bus:
        deadline = time.monotonic() + 120
        while len(await list_agents(bus)) < n_agents:
            if time.monotonic() > deadline:
                raise TimeoutError("agents did not register")
            await anyio.sleep(0.2)
        for a in await list_agents(bus):
            await busmod.request(
                bus,
                names.agent_ctl(a.agent_id),
                codec.encode(
                    {
                        "op": "prepare",
                        "evaluation_id": eval_id,
                        "model": "noop",
                        "model_version": "1.0.0",
                        "batch_size": 1,
                        "trace_level": "none",
                    }
                ),
                timeout=30,
            )
        subject = names.capability("noop", "noop")
        payloads = [
            codec.encode_model(
                Query(
                    evaluation_id=eval_id,
                    index=i,
                    trace_level=0,
                    inputs=np.zeros((1, 16), np.float32),
                )
            )
            for i in range(queries)
        ]
        sem = anyio.Semaphore(inflight)

        async def one(p: bytes) -> None:
            async with sem:
                await bus.nc.request(subject, p, timeout=30)

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for p in payloads:
                tg.start_soon(one, p)
        return queries / (time.perf_counter() - t0)


def agents(settings: Settings, n: int) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, **settings.as_env(), "PYTHONPATH": str(REPO)}
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cli.main",
                "agent",
                "--framework",
                "noop",
                "--agent-id",
                f"tp-{n}-{i}",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(n)
    ]


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--registered", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--queries", type=int, default=4000)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, NatsServer(store_dir=Path(tmp) / "n") as srv:
        settings = Settings(nats_url=srv.url, data_dir=Path(tmp))
        r = anyio.run(resolution, settings, args.registered, args.rounds, backend="asyncio")
        print(
            f"resolution with {args.registered} agents, server path (watched registry "
            f"+ resolve): p50 {r['cached_p50_ms']:.3f} ms  p99 {r['cached_p99_ms']:.3f} ms"
        )
        print(
            f"resolution with {args.registered} agents, one-shot bucket read "
            f"(list_agents + resolve): p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  "
            f"(resolve() alone p50 {r['resolve_only_p50_ms']:.3f} ms; "
            f"{r['short_reads']} of {args.rounds} reads came back short)"
        )
        rates = {}
        for n in (1, args.agents):
            procs = agents(settings, n)
            try:
                runs = [
                    anyio.run(
                        throughput, settings, n, args.queries, args.inflight, backend="asyncio"
                    )
                    for _ in range(args.repeat)
                ]
            finally:
                stop(procs)
            rates[n] = float(np.median(runs))
            print(
                f"noop throughput, {n} agent(s): median {rates[n]:.0f} queries/s "
                f"(runs: {', '.join(f'{x:.0f}' for x in runs)})"
            )
            time.sleep(6)  # let the stopped agents' registry entries expire
        print(
            f"ratio {args.agents} agents / 1 agent: {rates[args.agents] / rates[1]:.2f} "
            f"on {os.cpu_count()} cores"
        )


if __name__ == "__main__":
    main()
