"""Tracing benchmarks: ingest rate JetStream -> chDB, and tracing overhead per query.

1. Ingest: ``--spans`` spans (model-level shape: step spans with short names, no
   attributes, plus ``--layer-share`` of layer spans with ORT-like attribute JSON)
   are published to the traces stream in the tracer's batches of ``--batch`` spans
   (halved until one fits the max payload, as the tracer does) *before* the ingester
   starts; then one Ingester drains the stream into a fresh chDB, and the rate is
   spans / (time until every span is inserted; ``count()`` is checked after).
   A/B in one run: the tracer's wire form (its repeating string columns
   dictionary-encoded) against plain string lists (the older form, which the
   ingester still takes), alternated over ``--rounds`` rounds, each run in a fresh
   nats-server and chDB; medians.
2. Overhead on ``efficientnet_lite0`` / ONNX Runtime through a real Executor:
   per-query time at levels none, model and framework (``--queries`` each,
   interleaved in rounds so that machine noise hits all levels alike), reported as
   medians; plus the cost of the model level's four ``SpanBuffer.add`` calls measured
   alone, as a share of the median predict time (the noise-free number).

Usage: python bench/bench_tracing.py [--spans 1000000] [--queries 60]
       python bench/bench_tracing.py --spans 500000 --layer-share 0.9 --rounds 3 --queries 0
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from agent.job import Job
from agent.pipeline import Executor
from agent.tracer import SpanBuffer, dictionary_encode
from agent.worker import LoadedModel
from broker.db import Database
from broker.ingest import Ingester
from mlscope import codec, names
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.contracts import QueryReply, SpanBatch, TraceLevel, new_id
from mlscope.natsserver import NatsServer
from mlscope.predictor import PredictorOptions
from mlscope.provision import provisioned
from mlscope.settings import Settings
from mlscope.zoo.build import build

LAYER_ATTRS = json.dumps(
    {
        "op_type": "Conv",
        "shape": {
            "inputs": [
                {"dtype": "float", "shape": [1, 32, 112, 112]},
                {"dtype": "float", "shape": [32, 1, 3, 3]},
            ],
            "outputs": [{"dtype": "float", "shape": [1, 32, 112, 112]}],
        },
        "device": "cpu",
        "provider": "CPUExecutionProvider",
        "node_index": "268",
    }
)


def make_batch(
    eval_id: str, first: int, n: int, layer_share: float, *, plain: bool = False
) -> SpanBatch:
    """``n`` spans as the agent's tracer publishes them (``plain``: without the
    dictionary encoding of its string columns, the older wire form)."""
    ids = list(range(first, first + n))
    layers = int(n * layer_share)
    kinds = ["layer"] * layers + ["step"] * (n - layers)
    attrs = [LAYER_ATTRS] * layers + [""] * (n - layers)
    names_ = ["/_blocks.0/_depthwise_conv/Conv"] * layers + ["predict"] * (n - layers)
    columns: dict[str, list[Any]] = {
        "span_id": ids,
        "parent_id": [0] * n,
        "query_index": ids,
        "level": [1] * n,
        "kind": kinds,
        "name": names_,
        "start_ns": ids,
        "end_ns": ids,
        "attrs": attrs,
    }
    dicts: dict[str, list[str]] = {}
    if not plain:
        columns, dicts = dictionary_encode(columns, ("kind", "name", "attrs"))
    return SpanBatch(
        evaluation_id=eval_id,
        agent_id="bench-agent",
        host="bench",
        batch_id=new_id("sb"),
        columns=columns,
        dicts=dicts,
    )


async def ingest_rate(
    settings: Settings, db: Database, total: int, batch: int, layer_share: float, plain: bool
) -> tuple[float, float]:
    """(spans/s ingested, spans/s published) for ``total`` spans."""
    eval_id = new_id("ev")
    async with provisioned(settings, name="bench") as bus:
        t0 = time.perf_counter()
        acks = []
        limit = int(bus.nc.max_payload) - 4096
        while (
            batch > 1
            and len(codec.encode_model(make_batch(eval_id, 1, batch, layer_share, plain=plain)))
            > limit
        ):
            batch //= 2  # what the tracer does: a message never exceeds the max payload
        for first in range(0, total, batch):
            b = make_batch(eval_id, first + 1, min(batch, total - first), layer_share, plain=plain)
            acks.append(
                await bus.js.publish_async(
                    names.traces(eval_id, b.agent_id),
                    codec.encode_model(b),
                    headers={"Nats-Msg-Id": b.batch_id},
                )
            )
        await bus.js.publish_async_completed()
        pub_rate = total / (time.perf_counter() - t0)
        ingester = Ingester(bus, db)
        t1 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            tg.start_soon(ingester.run)
            for _ in range(60_000):  # polled every 10 ms, at most 10 minutes
                if ingester.ingested >= total:
                    break
                await anyio.sleep(0.01)
            elapsed = time.perf_counter() - t1
            tg.cancel_scope.cancel()
    n = db.rows("SELECT count() FROM spans FINAL WHERE evaluation_id = {e:String}", {"e": eval_id})[
        0
    ][0]
    assert n == total, (n, total)
    print(f"  (batches of {batch} spans)")
    return total / elapsed, pub_rate


def overhead(zoo: Path, queries: int) -> dict[str, float]:
    cat = Catalog.load(default_manifest_dirs(None))
    entry = next(
        e
        for e in cat.entries
        if e.manifest.name == "efficientnet_lite0" and e.manifest.framework.name == "onnxruntime"
    )
    model = LoadedModel.open(entry, entry.graph(zoo), PredictorOptions())
    model.warmup()
    worker = Executor(model)
    x = np.zeros((1, 256, 256, 3), np.uint8)
    replies: queue.Queue[QueryReply] = queue.Queue()
    wall: dict[TraceLevel, list[int]] = {
        lv: [] for lv in (TraceLevel.NONE, TraceLevel.MODEL, TraceLevel.FRAMEWORK)
    }
    predict: list[int] = []
    buf = SpanBuffer()
    for i in range(queries):
        for level in wall:
            if level == TraceLevel.FRAMEWORK and i % 6:
                continue  # framework level is slow by design: sample it less
            t = time.perf_counter_ns()
            worker.submit(
                Job(
                    index=i,
                    inputs=x,
                    received_ns=t,
                    level=level,
                    spans=buf if level else None,
                    reply=replies.put,
                )
            )
            r = replies.get()
            wall[level].append(time.perf_counter_ns() - t)
            if level == TraceLevel.NONE:
                predict.append(r.t_predict_end - r.t_predict_start)
        buf.take()
    worker.stop()
    # The model level's whole cost, alone: four span appends per query.
    add_buf = SpanBuffer()
    reps = 20_000
    t = time.perf_counter_ns()
    for i in range(reps):
        root = add_buf.add(
            parent=0,
            query_index=i,
            level=TraceLevel.MODEL,
            kind="query",
            name="query",
            start_ns=t,
            end_ns=t,
            attrs={"batch_size": 1},
        )
        for name in ("preprocess", "predict", "postprocess"):
            add_buf.add(
                parent=root,
                query_index=i,
                level=TraceLevel.MODEL,
                kind="step",
                name=name,
                start_ns=t,
                end_ns=t,
            )
    per_query_ns = (time.perf_counter_ns() - t) / reps
    med = {lv.name.lower(): statistics.median(v) / 1e6 for lv, v in wall.items()}
    p = statistics.median(predict) / 1e6
    return {
        "predict_ms": p,
        **{f"query_{k}_ms": v for k, v in med.items()},
        "model_vs_none": med["model"] / med["none"] - 1,
        "framework_vs_none": med["framework"] / med["none"] - 1,
        "model_span_cost_us": per_query_ns / 1e3,
        "model_span_cost_share_of_predict": per_query_ns / 1e6 / p,
    }


def ingest_once(tmp: Path, args: argparse.Namespace, *, plain: bool) -> float:
    """One ingest run into a fresh nats-server and chDB: spans/s."""
    with NatsServer(store_dir=tmp / "nats") as nats:
        settings = Settings(nats_url=nats.url, data_dir=tmp)
        db = Database(f"chdb:///{tmp / 'db'}")
        db.migrate()
        try:
            rate, pub = anyio.run(
                ingest_rate,
                settings,
                db,
                args.spans,
                args.batch,
                args.layer_share,
                plain,
                backend="asyncio",
            )
        finally:
            db.close()
    print(
        f"  {'plain' if plain else 'dictionary'} strings: ingest {rate:,.0f} spans/s; "
        f"publish {pub:,.0f} spans/s",
        flush=True,
    )
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=5000)
    ap.add_argument("--layer-share", type=float, default=0.0)
    ap.add_argument("--queries", type=int, default=60, help="0: ingest only")
    ap.add_argument("--rounds", type=int, default=1, help="ingest runs per string form")
    ap.add_argument("--zoo", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rates: dict[str, list[float]] = {"dictionary": [], "plain": []}
        for r in range(args.rounds):
            for k in range(2):
                form = ("dictionary", "plain")[(k + r) % 2]
                rate = ingest_once(Path(tmp) / f"{r}-{form}", args, plain=form == "plain")
                rates[form].append(rate)
        for form, v in rates.items():
            print(
                f"ingest JetStream -> chDB, {form} strings: median {statistics.median(v):,.0f} "
                f"spans/s, per round {[round(x) for x in v]} ({args.spans:,} spans, "
                f"layer share {args.layer_share})"
            )
        if args.queries == 0:
            return
        zoo = args.zoo or Path(tmp) / "zoo"
        build(zoo, only=["efficientnet_lite0"], log=lambda _m: None)
        o = overhead(zoo, args.queries)
    print(
        "overhead efficientnet_lite0/onnxruntime: "
        + ", ".join(f"{k}={v:.4g}" for k, v in o.items())
    )


if __name__ == "__main__":
    main()
