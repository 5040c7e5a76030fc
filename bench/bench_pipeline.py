"""Streaming pipeline benchmark, in one run:

1. Per-query in-process overhead of the pipeline executor: closed loop, one query
   at a time, ``end-to-end - predict`` where end-to-end runs from ``submit`` to the
   reply callback (two thread hand-offs: into the executor and back). Measured for
   the null predictor with no operators (the executor alone) and for ``digits_cnn``
   on ONNX Runtime with its manifest operators (softmax + top-5 included).
2. Batched throughput of ``efficientnet_lite0`` per framework through a real agent
   process over NATS (pre-processing on the agent, two queries outstanding) versus a
   bare loop of the same runtime on the same file over the same pre-processed
   batches, same thread settings: the ratio agent / bare (goal >= 0.95).

Usage: python bench/bench_pipeline.py [--frameworks onnxruntime,pytorch,...]
       [--batch-size 4] [--seconds 3] [--rounds 3] [--queries 3000] [--zoo /work/zoo]
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from agent.job import Job
from agent.pipeline import Executor, ExecutorConfig
from agent.predictors import open_predictor
from agent.tracer import SpanBuffer
from agent.worker import LoadedModel
from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.catalog import Catalog, Entry, default_manifest_dirs
from mlscope.contracts import Query, TraceLevel
from mlscope.errors import MLScopeError
from mlscope.manifest import ModelManifest
from mlscope.natsserver import NatsServer
from mlscope.predictor import PredictorOptions
from mlscope.settings import Settings

now = time.perf_counter_ns
WARMUP_S = 2.0
FRAMEWORKS = ("onnxruntime", "pytorch", "tensorflow", "tflite")


# ----------------------------------------------------------------------- overhead


def noop_entry() -> Entry:
    m = ModelManifest.model_validate(
        {
            "name": "noop_echo",
            "version": "1.0.0",
            "task": "classification",
            "framework": {"name": "noop"},
            "inputs": [{"shape": [8, 8], "element_type": "uint8"}],
            "outputs": [{}],
            "assets": {"graph_path": "none", "sha256": "0" * 64},
        }
    )
    return Entry(manifest=m, path=Path("noop.yaml"))


def overhead(
    model: LoadedModel, x: np.ndarray, queries: int, level: TraceLevel
) -> dict[str, float]:
    """Median/p90 (us) of end-to-end minus predict, one query at a time."""
    ex = Executor(model, ExecutorConfig(pre_workers=2))
    done: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
    spans = SpanBuffer() if level > TraceLevel.NONE else None

    def reply(r: Any) -> None:
        done.put((now(), r))

    over, e2e = [], []
    try:
        for i in range(queries):
            t0 = now()
            ex.submit(Job(index=i, inputs=x, received_ns=t0, level=level, spans=spans, reply=reply))
            t1, r = done.get()
            if not r.ok:
                raise RuntimeError(r.error)
            pred = r.t_predict_end - r.t_predict_start
            over.append((t1 - t0 - pred) / 1e3)
            e2e.append((t1 - t0) / 1e3)
    finally:
        ex.stop()
    keep = over[len(over) // 10 :]  # the first 10% warm caches up: reported, not timed
    out = {
        "overhead_p50_us": statistics.median(keep),
        "overhead_p90_us": float(np.percentile(keep, 90)),
        "e2e_p50_us": statistics.median(e2e[len(e2e) // 10 :]),
    }
    if spans is not None:  # the manifest's operators, timed by the pipeline's own spans
        cols = spans.take()
        for step in ("preprocess", "postprocess"):
            d = [
                (b - a) / 1e3
                for n, a, b in zip(cols["name"], cols["start_ns"], cols["end_ns"], strict=True)
                if n == step
            ]
            out[f"{step}_p50_us"] = statistics.median(d[len(d) // 10 :])
    return out


# ----------------------------------------------------------------------- throughput


class BareLoop:
    """predictor.predict over pre-processed batches, nothing else (same file, options)."""

    def __init__(
        self, entry: Entry, graph: Path, batches: list[np.ndarray], threads: int | None
    ) -> None:
        self.batches = batches
        self.pred = open_predictor(
            entry.manifest.framework.name,
            graph,
            entry.manifest,
            PredictorOptions(batch_size=len(batches[0]), threads=threads),
        )
        # The agent's first inference (batch 1 on zeros, at load), then warm-up: TorchScript
        # profiles its first runs and specializes on the shapes it saw.
        self.pred.predict([np.zeros((1, *batches[0].shape[1:]), batches[0].dtype)])
        self.rate(WARMUP_S)

    def rate(self, seconds: float) -> float:
        done, n, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            b = self.batches[n % len(self.batches)]
            self.pred.predict([b])
            done += len(b)
            n += 1
        return done / (time.perf_counter() - t0)


class BareProcess:
    """The bare loop in its own fresh process (one framework loaded, like the agent)."""

    def __init__(self, framework: str, zoo: Path, batch: int, threads: int | None) -> None:
        cmd = [
            sys.executable,
            __file__,
            "--bare-child",
            framework,
            "--zoo",
            str(zoo),
            "--batch-size",
            str(batch),
        ] + (["--threads", str(threads)] if threads else [])
        root = str(Path(__file__).resolve().parent.parent)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
        }
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # runtimes may print first
            if line.strip() == "ready":
                break
        else:
            raise RuntimeError(f"bare loop for {framework} did not start")

    def rate(self, seconds: float) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{seconds}\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            try:
                return float(line)
            except ValueError:
                continue  # a runtime's own output
        raise RuntimeError("the bare loop process ended")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


def bare_child(framework: str, zoo: Path, batch: int, threads: int | None) -> None:
    entry, _, batches = inputs(framework, zoo, batch)
    loop = BareLoop(entry, entry.graph(zoo), batches, threads)
    print("ready", flush=True)
    for line in sys.stdin:
        print(loop.rate(float(line)), flush=True)
    loop.pred.close()


def inputs(
    framework: str, zoo: Path, batch: int
) -> tuple[Entry, list[np.ndarray], list[np.ndarray]]:
    """The manifest, raw image batches, and the same batches pre-processed."""
    entry = Catalog.load(default_manifest_dirs()).find("efficientnet_lite0", framework=framework)
    with np.load(entry.dataset(zoo)) as npz:  # type: ignore[arg-type]
        images = npz["x"]
    raw = [images[(np.arange(batch) + k) % len(images)] for k in range(4)]
    model = LoadedModel(
        entry, open_predictor("noop", Path("none"), entry.manifest, PredictorOptions()), 0
    )
    return entry, raw, [np.ascontiguousarray(model.pre[0](r)) for r in raw]


async def through_agent(
    settings: Settings,
    framework: str,
    entry: Entry,
    raw: list[np.ndarray],
    bare: BareProcess,
    *,
    seconds: float,
    rounds: int,
    window: int = 2,
) -> list[tuple[float, float]]:
    """(bare, agent) inputs/s for each round; the agent keeps ``window`` queries out.

    Bare and agent slices alternate so that both see the same background load.
    """
    m = entry.manifest
    async with busmod.connect(settings, name="bench") as bus:
        agent_id = await _agent_id(bus, framework)
        ctl = names.agent_ctl(agent_id)
        eval_id = f"ev-bench-{framework}"
        await busmod.request(
            bus,
            ctl,
            codec.encode(
                {
                    "op": "prepare",
                    "evaluation_id": eval_id,
                    "model": m.name,
                    "model_version": m.version,
                    "batch_size": len(raw[0]),
                    "trace_level": "model",
                }
            ),
            timeout=300,
        )
        payloads = [
            codec.encode_model(Query(evaluation_id=eval_id, index=i, inputs=b))
            for i, b in enumerate(raw)
        ]
        subject = names.agent_query(agent_id)

        async def one(i: int) -> int:
            msg = await bus.nc.request(subject, payloads[i % len(payloads)], timeout=120)
            reply = codec.decode(msg.data)
            if not reply.get("ok"):
                raise RuntimeError(reply)
            return len(raw[i % len(raw)])

        async def agent_rate() -> float:
            done, t0 = 0, time.perf_counter()
            counter = iter(range(10**9))

            async def lane() -> None:
                nonlocal done
                while time.perf_counter() - t0 < seconds:
                    n = await one(next(counter))  # not `done += await`: lanes interleave
                    done += n

            async with anyio.create_task_group() as tg:
                for _ in range(window):
                    tg.start_soon(lane)
            return done / (time.perf_counter() - t0)

        t_warm = time.perf_counter()
        for i in itertools.count():
            await one(i)
            if time.perf_counter() - t_warm > WARMUP_S:
                break
        out = [(bare.rate(seconds), await agent_rate()) for _ in range(rounds)]
        await busmod.request(
            bus, ctl, codec.encode({"op": "release", "evaluation_id": eval_id}), timeout=10
        )
        return out


async def _agent_id(bus: busmod.Bus, framework: str) -> str:
    from mlscope.registry import list_agents

    for _ in range(600):
        try:
            agents = await list_agents(bus)
        except MLScopeError:  # the agent has not provisioned the bucket yet
            agents = []
        for a in agents:
            if a.frameworks[0].name == framework:
                return a.agent_id
        await anyio.sleep(0.2)
    raise TimeoutError(f"no {framework} agent registered")


def throughput(
    framework: str, zoo: Path, batch: int, seconds: float, rounds: int, threads: int | None
) -> dict[str, float]:
    entry, raw, _ = inputs(framework, zoo, batch)
    bare = BareProcess(framework, zoo, batch, threads)
    data = Path(tempfile.mkdtemp(prefix="mlscope-bench-"))
    (data / "zoo").symlink_to(zoo, target_is_directory=True)
    with NatsServer(store_dir=data / "nats") as server:
        settings = Settings(nats_url=server.url, data_dir=data)
        env = {**os.environ, **settings.as_env()}
        cmd = [sys.executable, "-m", "cli.main", "agent", "--framework", framework]
        agent = subprocess.Popen(cmd + (["--threads", str(threads)] if threads else []), env=env)
        try:
            pairs = anyio.run(
                lambda: through_agent(
                    settings, framework, entry, raw, bare, seconds=seconds, rounds=rounds
                ),
                backend="asyncio",
            )
        finally:
            agent.terminate()
            agent.wait(30)
            bare.close()
    return {
        "bare_ips": statistics.median(b for b, _ in pairs),
        "agent_ips": statistics.median(a for _, a in pairs),
        "ratio": statistics.median(a / b for b, a in pairs),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3, help="per slice")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads, the same for the bare loop and the agent",
    )
    ap.add_argument("--rounds", type=int, default=3, help="bare/agent slice pairs")
    ap.add_argument("--queries", type=int, default=3000)
    ap.add_argument(
        "--zoo", type=Path, default=Path(os.environ.get("MLSCOPE_TEST_ZOO", "/work/zoo"))
    )
    ap.add_argument("--bare-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_child:
        return bare_child(args.bare_child, args.zoo, args.batch_size, args.threads)
    sys.setswitchinterval(0.0002)  # as the agent sets it
    if args.queries:
        overheads(args)
    print(
        f"2. efficientnet_lite0 batched throughput, batch {args.batch_size}, "
        f"{args.rounds} x {args.seconds:g} s alternating slices (median of ratios)"
    )
    for fw in filter(None, args.frameworks.split(",")):
        r = throughput(fw, args.zoo, args.batch_size, args.seconds, args.rounds, args.threads)
        print(
            f"   {fw:12} bare {r['bare_ips']:8.1f}/s  agent {r['agent_ips']:8.1f}/s  "
            f"ratio {r['ratio']:.3f}",
            flush=True,
        )


def handoff_floor(rounds: int) -> float:
    """Median us of the bare round trip the executor cannot avoid: a value handed to
    another thread through a SimpleQueue and back (the two hand-offs of a query),
    under the same interpreter settings as :func:`overhead`."""
    there: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    back: queue.SimpleQueue[int] = queue.SimpleQueue()

    def echo() -> None:
        while (v := there.get()) is not None:
            back.put(v)

    t = threading.Thread(target=echo)
    t.start()
    rtt = []
    try:
        for i in range(rounds):
            t0 = now()
            there.put(i)
            back.get()
            rtt.append((now() - t0) / 1e3)
    finally:
        there.put(None)
        t.join()
    return statistics.median(rtt[rounds // 10 :])


def overheads(args: argparse.Namespace) -> None:
    print("1. per-query in-process overhead (end-to-end - predict), closed loop")
    print(
        f"   floor: bare two-thread SimpleQueue round trip p50 "
        f"{handoff_floor(max(args.queries, 1000) * 3):.1f} us"
    )
    x = np.zeros((1, 8, 8), np.uint8)
    for level in (TraceLevel.NONE, TraceLevel.MODEL):
        noop = LoadedModel(
            noop_entry(),
            open_predictor("noop", Path("none"), noop_entry().manifest, PredictorOptions()),
            0,
        )
        r = overhead(noop, x, args.queries, level)
        print(
            f"   noop, no operators, trace {level.name.lower():5}: "
            + "  ".join(f"{k} {v:.1f}" for k, v in r.items())
        )
    entry = Catalog.load(default_manifest_dirs()).find("digits_cnn", framework="onnxruntime")
    for level in (TraceLevel.NONE, TraceLevel.MODEL):
        digits = LoadedModel.open(entry, entry.graph(args.zoo), PredictorOptions(threads=1))
        r = overhead(digits, x, args.queries, level)
        print(
            f"   digits_cnn onnxruntime, trace {level.name.lower():5}: "
            + "  ".join(f"{k} {v:.1f}" for k, v in r.items())
        )


if __name__ == "__main__":
    main()
