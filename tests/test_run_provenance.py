"""What an evaluation records beyond latency: the agent's memory over the run, energy
only when a power source was read, per-layer memory from ONNX Runtime's profiler, the
agent's own versions and the settings it ran with; and ``mlscope rerun`` pinned to the
original's host, saying what differs."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import onnxruntime as ort
import pytest

import mlscope
from agent.energy import rapl_counters
from agent.predictors import open_predictor
from agent.profiling.onnxruntime import node_events
from agent.sysmon import RssWatch
from analysis.layers import _mb
from cli.rerun_cmd import differences, rerun, rerun_job
from cli.summary_text import format_summary
from mlscope import bus as busmod
from mlscope import provenance, remote
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.contracts import EvaluationSummary, JobRequest, ScenarioSpec
from mlscope.errors import ResolutionError
from mlscope.jobs import submit
from mlscope.natsserver import NatsServer
from mlscope.predictor import PredictorOptions
from mlscope.settings import Settings
from tests.conftest import make_data_dir, wait_agents, wait_server
from tests.procfs import proc_status_bytes
from tests.scale_fixtures import start, stop

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def noop_agent_process(
    tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path
) -> Iterator[tuple[Settings, int]]:
    """nats-server, a server and one noop agent, as processes; the agent's pid."""
    base = tmp_path_factory.mktemp("provenance")
    with NatsServer(store_dir=base / "nats") as nats_server:
        settings = Settings(nats_url=nats_server.url, data_dir=make_data_dir(base / "d", zoo_dir))
        procs = [start(settings, "server")]
        try:
            anyio.run(wait_server, settings)
            procs.append(start(settings, "agent", "--framework", "noop", "--agent-id", "n0"))
            anyio.run(wait_agents, settings, 1, 120.0)
            yield settings, procs[-1].pid
        finally:
            stop(*procs)


@pytest.fixture(scope="module")
def noop_agent(noop_agent_process: tuple[Settings, int]) -> Settings:
    return noop_agent_process[0]


def _run(settings: Settings) -> EvaluationSummary:
    job = JobRequest(
        model="noop", framework="noop", scenario=ScenarioSpec(name="online", qps=50, duration_s=1)
    )
    return anyio.run(lambda: submit(settings, job, timeout=90), backend="asyncio")


def _stored(settings: Settings, evaluation_id: str) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with busmod.connect(settings, name="test") as bus:
            spec, _ = await remote.evaluation(bus, evaluation_id)
        return dict(spec)

    return anyio.run(go, backend="asyncio")


def test_a_summary_has_the_agents_memory_and_no_made_up_energy(noop_agent: Settings) -> None:
    s = _run(noop_agent)
    # A Python process with numpy and nats loaded holds tens of MB; the noop run keeps
    # little of what it allocated.
    assert s.peak_rss_mb is not None and 20 < s.peak_rss_mb < 4000, s.peak_rss_mb
    assert s.rss_growth_mb is not None and abs(s.rss_growth_mb) < s.peak_rss_mb
    text = format_summary(s)
    assert f"agent peak RSS {s.peak_rss_mb:.1f} MB" in text
    # The host's other processes, read from /proc/stat (checked against a burner
    # process in tests/test_hostload.py): reported, and said in the summary.
    assert s.host_other_cores is not None and s.host_other_cores >= 0
    assert f"other processes kept {s.host_other_cores:.2f} cores busy" in text
    if rapl_counters():  # this machine exposes a readable package counter
        assert s.energy_j is not None and s.energy_j > 0
        assert s.energy_per_inference_j == pytest.approx(s.energy_j / s.samples)
    else:  # no RAPL counter readable: unknown, never 0
        assert s.energy_j is None and s.energy_per_inference_j is None
        assert "energy        not available" in text


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_the_peak_rss_agrees_with_the_kernels_view_of_the_agent(
    noop_agent_process: tuple[Settings, int],
) -> None:
    """The reported peak, checked from outside the agent: at least every resident size
    the kernel showed while the run went on, at most the process's lifetime high-water
    mark (MB are 10^6 bytes: a MiB figure would fall below the samples)."""
    settings, pid = noop_agent_process
    seen: list[int] = []

    def sample(event: Any) -> None:
        if event.event == "progress":
            seen.append(proc_status_bytes(pid, "VmRSS"))

    job = JobRequest(
        model="noop", framework="noop", scenario=ScenarioSpec(name="online", qps=50, duration_s=3)
    )
    s = anyio.run(lambda: submit(settings, job, on_event=sample, timeout=90), backend="asyncio")
    assert seen and s.peak_rss_mb is not None
    peak = s.peak_rss_mb * 1e6
    assert peak >= max(seen) * 0.995, (peak, seen)  # a page or two of slack between reads
    assert peak <= proc_status_bytes(pid, "VmHWM") * 1.005, peak


def test_the_specification_holds_the_agents_settings_and_own_versions(
    noop_agent: Settings,
) -> None:
    s = _run(noop_agent)
    spec = _stored(noop_agent, s.evaluation_id)
    settings = spec["agent_settings"]
    assert settings["device"] == "cpu" and settings["max_batch"] == 1
    assert {
        "batch_wait_us",
        "queue_capacity",
        "inflight_bytes",
        "pre_workers",
        "threads",
        "runtime",
    } <= set(settings)
    assert spec["agent_mlscope_version"] == mlscope.__version__
    # The agent runs from this checkout: its commit is this one's.
    assert spec["agent_git_commit"] == provenance.git_commit()
    assert json.dumps(spec)  # stored as JSON


def test_rerun_pins_the_original_host_and_says_what_differs(
    noop_agent: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _run(noop_agent)
    spec = _stored(noop_agent, first.evaluation_id)
    job = rerun_job(spec, first.evaluation_id)
    assert job.system is not None and job.system.host == spec["agent"]["host"]
    assert rerun_job(spec, first.evaluation_id, any_system=True).system is None

    again = anyio.run(lambda: rerun(noop_agent, first.evaluation_id), backend="asyncio")
    after = _stored(noop_agent, again.evaluation_id)
    assert after["job"]["system"]["host"] == spec["agent"]["host"]
    assert after["job"]["rerun_of"] == first.evaluation_id
    assert differences(spec, after) == []  # same agent, same settings, same bytes
    said = capsys.readouterr().err
    assert f"nothing differs from {first.evaluation_id} (host, agent," in said, said

    moved = {
        **after,
        "agent": {**after["agent"], "host": "other-host"},
        "agent_settings": {**after["agent_settings"], "threads": 3},
        "agent_git_commit": "f" * 40,
        "artifact_sha256": "b" * 64,
    }
    spec_a = {**spec, "artifact_sha256": "a" * 64}
    lines = differences(spec_a, moved)
    assert f"host: other-host (original {spec['agent']['host']})" in lines
    assert "agent setting threads: 3 (original default)" in lines
    assert any(line.startswith(f"agent git commit: {'f' * 40} (original ") for line in lines)
    assert any("artifact differs" in line for line in lines)

    # A pinned host that no live agent runs on is refused, naming the miss.
    gone = {**spec, "agent": {**spec["agent"], "host": "decommissioned"}}
    with pytest.raises(ResolutionError, match=r"agent n0 misses host .*, not decommissioned"):
        anyio.run(
            lambda: submit(noop_agent, rerun_job(gone, first.evaluation_id), timeout=60),
            backend="asyncio",
        )


def test_onnxruntime_layers_carry_their_memory_and_the_session_its_options(
    zoo_dir: Path, tmp_path: Path
) -> None:
    entry = Catalog.load(default_manifest_dirs()).find("digits_cnn", framework="onnxruntime")
    graph = entry.graph(zoo_dir)
    pred: Any = open_predictor(
        "onnxruntime", graph, entry.manifest, PredictorOptions(threads=1, runtime={})
    )
    got = pred.effective_options()
    assert got["providers"] == ["CPUExecutionProvider"] and got["intra_op_threads"] == 1

    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "ort_profile")
    session = ort.InferenceSession(str(graph), so)
    first = session.get_inputs()[0]
    shape = [d if isinstance(d, int) else 1 for d in first.shape]
    session.run(None, {first.name: np.zeros(shape, np.float32)})
    raw = json.loads(Path(session.end_profiling()).read_text())
    events = node_events(raw, base_ns=0, device="cpu")
    assert events
    for e in events:
        outputs = e.shape["outputs"]
        if any(o["dtype"] != "float" for o in outputs):
            continue
        elements = sum(int(np.prod(o["shape"])) for o in outputs)
        assert e.extra["output_bytes"] == 4 * elements, (e.name, outputs)  # float32
        assert _mb(e.extra["output_bytes"]) == e.extra["output_bytes"] / 1e6
    assert any(e.extra.get("parameter_bytes", 0) > 0 for e in events)  # a conv's weights
    assert _mb(None) is None


@pytest.mark.parametrize(
    ("framework", "threads_key"),
    [
        ("onnxruntime", "intra_op_threads"),
        ("pytorch", "intra_op_threads"),
        ("tflite", "num_threads"),
        ("tensorflow", "intra_op_threads"),
    ],
)
def test_each_runtime_says_what_it_runs_with(
    framework: str, threads_key: str, zoo_dir: Path
) -> None:
    pytest.importorskip({"tflite": "ai_edge_litert", "pytorch": "torch"}.get(framework, framework))
    entry = Catalog.load(default_manifest_dirs()).find("digits_cnn", framework=framework)
    pred: Any = open_predictor(
        framework, entry.graph(zoo_dir), entry.manifest, PredictorOptions(threads=1)
    )
    try:
        got = pred.effective_options()
    finally:
        pred.close()
    assert got[threads_key] == 1, got
    assert json.dumps(got)  # stored in the specification as JSON


def test_the_rss_watch_sees_a_peak_that_is_gone_at_release() -> None:
    watch = RssWatch(interval_s=0.01)
    watch.start("ev-a")
    block = np.ones(64 << 20, np.uint8)  # written, so resident
    time.sleep(0.1)
    del block  # a large numpy buffer goes back to the system at once
    got = watch.stop("ev-a")
    assert got is not None
    start, peak, end = got
    assert peak - start >= 60 << 20, got
    assert end < peak - (32 << 20), got  # growth (end - start) is not the peak
    assert watch.stop("ev-a") is None  # not watched any more


def test_the_rss_growth_counts_what_a_run_kept_not_what_the_allocator_kept() -> None:
    """A run that allocates many small buffers and frees most of them leaves holes that
    glibc keeps for reuse: the process's RSS stays up. The growth an evaluation reports
    is what the run kept (here 256 KB), not those holes (64 MB)."""
    watch = RssWatch(interval_s=0.01)
    watch.start("ev-a")
    bufs = [np.ones(4096, np.uint8) for _ in range(16384)]  # from the heap, not mmap
    kept = bufs[::256]
    del bufs
    got = watch.stop("ev-a")
    assert got is not None and len(kept) == 64
    start, peak, end = got
    assert peak - start >= 48 << 20, got  # the run did use them
    assert end - start < 16 << 20, got


def test_a_closed_rss_watch_leaves_no_thread_behind() -> None:
    """An agent that stops with evaluations never released ends the watch's thread."""
    watch = RssWatch(interval_s=0.01)
    watch.start("ev-a")
    watch.start("ev-b")
    (thread,) = [t for t in threading.enumerate() if t.name == "rss" and t is watch._thread]
    watch.close()
    assert not thread.is_alive()
    assert watch.stop("ev-a") is None
    watch.start("ev-c")  # a watch can start again after it closed
    assert watch.stop("ev-c") is not None
    assert watch._thread is None
