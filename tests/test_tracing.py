"""Trace levels and the span tree on real frameworks, driven through a real Executor."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import anyio
import onnx
import onnxruntime as ort
import pytest

from agent import profiling
from agent.sysmon import Sampler, parse_perf_line
from agent.tracer import SampleBuffer, Tracer
from mlscope.contracts import TraceLevel
from mlscope.provision import provisioned
from mlscope.settings import Settings
from tests.tracing_fixtures import check_tree, ensure_built, open_model, run_queries

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def effnet_zoo(zoo_dir: Path) -> Path:
    ensure_built(zoo_dir, "efficientnet_lite0")
    return zoo_dir


@pytest.mark.parametrize("framework", ["onnxruntime", "pytorch", "tensorflow"])
def test_levels_filter_spans(zoo_dir: Path, framework: str) -> None:
    model = open_model(zoo_dir, "digits_cnn", framework)
    for _ in range(3):  # TorchScript's profiling executor settles after two runs
        model.warmup()
    assert run_queries(model, TraceLevel.NONE, 2) == []
    rows = run_queries(model, TraceLevel.MODEL, 3)
    assert Counter(r["kind"] for r in rows) == {"query": 3, "step": 9}
    assert {r["level"] for r in rows} == {TraceLevel.MODEL}
    framework_rows = run_queries(model, TraceLevel.FRAMEWORK, 4)
    layers = check_tree(framework_rows)
    assert set(layers) == {0, 1, 2, 3}
    assert len(set(layers.values())) == 1, layers  # the same count for every query
    assert min(layers.values()) >= 3
    for r in framework_rows:
        if r["kind"] == "layer":
            attrs = json.loads(r["attrs"])
            assert attrs["op_type"] and attrs["device"] == "cpu"
            if framework != "tensorflow":  # TF's host events carry no shapes
                assert attrs["shape"]["inputs"]
    model.predictor.close()


def test_full_level_adds_pytorch_ops_under_their_layer(zoo_dir: Path) -> None:
    model = open_model(zoo_dir, "digits_cnn", "pytorch")
    for _ in range(3):
        model.warmup()
    framework = run_queries(model, TraceLevel.FRAMEWORK, 2)
    full = run_queries(model, TraceLevel.FULL, 2)
    assert not [r for r in framework if r["kind"] == "op"]
    layers = check_tree(full)  # ops under layers, inside them
    ops = Counter(r["query_index"] for r in full if r["kind"] == "op")
    assert set(ops) == {0, 1} and len(set(ops.values())) == 1
    assert layers == check_tree(framework)  # the same layers at both levels
    model.predictor.close()


def test_onnxruntime_every_executed_node_is_a_layer_span(effnet_zoo: Path, tmp_path: Path) -> None:
    model = open_model(effnet_zoo, "efficientnet_lite0", "onnxruntime")
    rows = run_queries(model, TraceLevel.FRAMEWORK, 2)
    layers = check_tree(rows)
    assert set(layers) == {0, 1}
    # The graph ORT ran (after its graph optimizations), saved by ORT itself.
    path, so, providers = model.predictor.profile_args  # type: ignore[attr-defined]
    opts = ort.SessionOptions()
    opts.graph_optimization_level = so.graph_optimization_level
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(path, sess_options=opts, providers=providers)
    nodes = [n.name for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    for q in (0, 1):
        names = [r["name"] for r in rows if r["kind"] == "layer" and r["query_index"] == q]
        assert sorted(names) == sorted(nodes)
    model.predictor.close()


def test_onnxruntime_unoptimized_graph_maps_node_for_node(effnet_zoo: Path) -> None:
    """With ORT's optimizations off, the layer spans are the ONNX file's own nodes."""
    model = open_model(effnet_zoo, "efficientnet_lite0", "onnxruntime")
    path, so, _ = model.predictor.profile_args  # type: ignore[attr-defined]
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    rows = run_queries(model, TraceLevel.FRAMEWORK, 1)
    check_tree(rows)
    graph = onnx.load(path).graph
    executed = Counter(r["name"] for r in rows if r["kind"] == "layer")
    expected = Counter(n.name for n in graph.node if n.op_type != "Constant")
    assert executed == expected
    ops = Counter(json.loads(r["attrs"])["op_type"] for r in rows if r["kind"] == "layer")
    assert ops == Counter(n.op_type for n in graph.node if n.op_type != "Constant")


def test_tflite_has_no_profiler_and_stays_at_model_level(zoo_dir: Path) -> None:
    model = open_model(zoo_dir, "digits_cnn", "tflite")
    assert profiling.profiler_for(model.predictor) is None
    rows = run_queries(model, TraceLevel.FRAMEWORK, 2)
    assert Counter(r["kind"] for r in rows) == {"query": 2, "step": 6}


def test_sampler_reads_cpu_process_and_counters() -> None:
    buf = SampleBuffer()
    sampler = Sampler(interval_s=0.05, perf=False)
    sampler.watch("ev", buf.add)
    sampler.unwatch("ev")
    sampler.sample_once()  # not watched any more: nothing lands in the buffer
    assert len(buf) == 0
    sampler.watch("ev", buf.add)
    try:
        sampler.sample_once()
    finally:
        sampler.unwatch("ev")
    cols = buf.take()
    got = {(m, d): v for m, d, v in zip(cols["metric"], cols["device"], cols["value"], strict=True)}
    assert got[("proc.rss_bytes", "proc")] > 10_000_000
    assert got[("proc.threads", "proc")] >= 1
    assert 0.0 <= got[("cpu.util", "all")] <= 100.0
    assert ("cpu.util", "cpu0") in got
    assert parse_perf_line("     0.100192116,1234.5,msec,task-clock,100,100.00,,") == (
        "task-clock",
        1234.5,
    )
    assert parse_perf_line("0.1,<not supported>,,cycles:u,0,100.00,,") is None
    assert parse_perf_line("0.2,42,,instructions:u,10,100.0,,") == ("instructions", 42.0)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="no CUDA device")
def test_pytorch_cuda_kernels_hang_under_their_op(zoo_dir: Path) -> None:
    from agent.worker import LoadedModel
    from mlscope.catalog import Catalog, default_manifest_dirs
    from mlscope.predictor import PredictorOptions

    cat = Catalog.load(default_manifest_dirs(None))
    entry = next(
        e
        for e in cat.entries
        if e.manifest.name == "digits_cnn" and e.manifest.framework.name == "pytorch"
    )
    model = LoadedModel.open(entry, entry.graph(zoo_dir), PredictorOptions(device="cuda:0"))
    for _ in range(3):
        model.warmup()
    # The first profiled run of a process does one-off work of its own (on an H200,
    # cuDNN's two workspace memsets under the first convolution): a traced warm-up.
    run_queries(model, TraceLevel.FRAMEWORK, 1)
    rows = run_queries(model, TraceLevel.FRAMEWORK, 3, first_index=1)
    check_tree(rows)  # kernels under layer spans, layers under predict
    kernels = [r for r in rows if r["kind"] == "kernel"]
    assert kernels and all(json.loads(r["attrs"])["device"].startswith("cuda") for r in kernels)
    per_query = Counter(r["query_index"] for r in kernels)
    assert len(set(per_query.values())) == 1, per_query
    by_id = {r["span_id"]: r for r in rows}
    owner = [(by_id[k["parent_id"]]["name"], k["name"]) for k in kernels]
    # The input's copy to the device and the output's back are the predictor's aten::to;
    # the network's kernels sit under its convolutions, activations and linear layers.
    assert {op for op, name in owner if name.startswith("Memcpy")} == {"aten::to"}, owner
    ops = {op for op, name in owner if not name.startswith("Memcpy")}
    assert any("conv" in op for op in ops) and {"aten::relu", "aten::linear"} <= ops, ops
    model.predictor.close()


def test_a_failing_profiler_leaves_the_query_alone(zoo_dir: Path, tmp_path: Path) -> None:
    model = open_model(zoo_dir, "digits_cnn", "onnxruntime")
    _, so, providers = model.predictor.profile_args  # type: ignore[attr-defined]
    model.predictor.profile_args = (str(tmp_path / "gone.onnx"), so, providers)  # type: ignore[attr-defined]
    rows = run_queries(model, TraceLevel.FRAMEWORK, 2)  # replies are ok (checked inside)
    assert Counter(r["kind"] for r in rows) == {"query": 2, "step": 6}


def test_tracer_drops_idle_buffers_and_never_reuses_span_ids(settings: Settings) -> None:
    """Two buffers of one evaluation (an evicted one and its successor, or two agent
    processes with one id) publish disjoint span ids; an idle buffer is dropped."""

    async def main() -> tuple[list[int], Tracer]:
        async with provisioned(settings, name="test") as bus:
            tracer = Tracer(bus, agent_id="a1", host="h", flush_s=0.01, idle_s=0.03)
            ids = [
                tracer.buffer("ev-1").add(
                    parent=0,
                    query_index=i,
                    level=TraceLevel.MODEL,
                    kind="query",
                    name="q",
                    start_ns=i,
                    end_ns=i + 1,
                )
                for i in range(3)
            ]
            await tracer.flush()
            assert "ev-1" in tracer.buffers  # just flushed: not idle yet
            for _ in range(3):
                await tracer.flush()
            assert "ev-1" not in tracer.buffers
            ids += [
                tracer.buffer("ev-1").add(
                    parent=0,
                    query_index=9,
                    level=TraceLevel.MODEL,
                    kind="query",
                    name="q",
                    start_ns=9,
                    end_ns=10,
                )
            ]
            await tracer.flush()
            return ids, tracer

    ids, tracer = anyio.run(main, backend="asyncio")
    assert tracer.published == 4 and len(set(ids)) == 4
    assert ids[1] == ids[0] + 1 and ids[2] == ids[1] + 1
    assert all(0 < i < 2**53 for i in ids)


def test_a_held_evaluations_buffers_and_its_runs_outlast_idleness(settings: Settings) -> None:
    """A prepared sweep's earlier run is idle while later ones run, and a profiler may
    write its held-back layer spans into that run's buffer at the release: buffers of
    a held evaluation and of its runs (``<id>-<k>``) are kept, others' dropped, and
    once let go they are dropped too."""

    async def main() -> None:
        async with provisioned(settings, name="test") as bus:
            tracer = Tracer(bus, agent_id="a1", host="h", flush_s=0.01, idle_s=0.03)
            tracer.hold("ev-s")
            ids = ("ev-s", "ev-s-0", "ev-s-1", "ev-other", "ev-other-0")
            for eval_id in ids:
                tracer.buffer(eval_id)
                tracer.samples(eval_id)
            for _ in range(4):
                await tracer.flush()
            kept = {"ev-s", "ev-s-0", "ev-s-1"}
            assert set(tracer.buffers) == set(tracer.sample_buffers) == kept
            tracer.let_go("ev-s")
            for _ in range(4):
                await tracer.flush()
            assert not tracer.buffers and not tracer.sample_buffers

    anyio.run(main, backend="asyncio")
