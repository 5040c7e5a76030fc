"""Placement agent against placement server, a bare loop and MLPerf LoadGen, in one run.

1. Batched throughput through the platform with ``placement: agent`` (and, with
   ``--server``, ``placement: server``) against a bare ``predictor.predict`` loop over
   pre-processed batches of the same file, opened with the agent's options (its
   framework manifest's runtime and thread settings), in a process of its own. By
   default the throughput goal's cases: ``digits_cnn`` ONNX Runtime batch 32 and
   ``efficientnet_lite0`` batch 1 and 4 on ONNX Runtime, PyTorch, TensorFlow and
   TFLite. The paths alternate in each round (the order rotates), so all see the same
   background load; medians over rounds, and each placement's median per-round ratio
   to the bare loop.
2. Single-stream p50 of ``efficientnet_lite0`` (ONNX Runtime) in placement agent
   against the median of single bare calls (same file and options), alternated.
3. Latency of the noop model at ``--qps`` (1,000) Poisson with ``placement: agent``
   (the agent's own pacer and executor; no bus per query) against MLPerf LoadGen's
   Server scenario at the same rate with an in-process null SUT (each query completed
   inside ``issue_query``), in a process of its own, and against ``placement: server``;
   the three rotate in each round; medians of p50 / p99 and of the issue lag.
4. (``--only gap``) The bare loop of each batched case with a fixed busy gap of
   ``--gaps`` µs of the calling thread between calls, the gaps alternated in each
   round: what a given amount of per-batch work on the predict thread costs a runtime
   (its intra-op threads wait through it), the budget a placement's per-batch work has.

Usage: PYTHONPATH=. python bench/bench_placement.py [--zoo DIR] [--rounds 3]
       [--seconds 5] [--cases M:F:B,...] [--server] [--queries 300] [--qps 1000]
       [--online-seconds 10] [--gaps 0,30,60,120]
       [--only batched|single-stream|online|gap]
Prints one JSON document per part (and one line per batched case); asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import numpy as np

from cli.demo import wait_for_agent
from cli.stack import Stack
from mlscope.contracts import EvaluationSummary, JobRequest, ScenarioSpec
from mlscope.jobs import submit
from mlscope.predictor import PredictorOptions
from mlscope.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
CASES = (
    "digits_cnn:onnxruntime:32",
    *(
        f"efficientnet_lite0:{fw}:{b}"
        for fw in ("onnxruntime", "pytorch", "tensorflow", "tflite")
        for b in (1, 4)
    ),
)
"""The model, framework and batch size of each batched comparison (the throughput goal's)."""


class Case(NamedTuple):
    model: str
    framework: str
    batch: int

    @classmethod
    def parse(cls, text: str) -> Case:
        model, framework, batch = text.split(":")
        return cls(model, framework, int(batch))

    def __str__(self) -> str:
        return f"{self.model}:{self.framework}:{self.batch}"


def stack(zoo: Path, frameworks: list[str]) -> tuple[Stack, Settings]:
    data = Path(tempfile.mkdtemp(prefix="mlscope-bench-placement-"))  # fresh: never ~/.mlscope
    (data / "zoo").symlink_to(zoo, target_is_directory=True)
    s = Stack(Settings(data_dir=data), nats_port=0, frameworks=frameworks)
    live = s.start()
    for fw in frameworks:
        anyio.run(wait_for_agent, live, fw)
    return s, live


def run_job(settings: Settings, job: JobRequest) -> EvaluationSummary:
    return anyio.run(lambda: submit(settings, job, timeout=600), backend="asyncio")


def agent_options(framework: str, batch: int) -> PredictorOptions:
    """How an agent with default settings opens a model of ``framework``: the runtime
    options of its framework manifest (threads included), as the agent builds them."""
    from mlscope.framework_manifest import FrameworkManifest
    from mlscope.manifest_files import load_manifest

    doc = load_manifest(ROOT / "manifests" / "frameworks" / f"{framework}.yaml")
    runtime = doc.runtime("cpu") if isinstance(doc, FrameworkManifest) else {}
    return PredictorOptions(batch_size=batch, runtime=runtime)


# ----------------------------------------------------------------------- children


class Child:
    """A bench child process answering one line per request line."""

    def __init__(self, *args: str) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.ask("ready")

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if line != "ready":
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        for out in self.proc.stdout:  # runtimes may print first
            if out.startswith("@"):
                return out[1:].strip()
        raise RuntimeError("the bench child ended")

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


def bare_child(zoo: Path, case: Case) -> None:
    """``predictor.predict`` over pre-processed batches of the agent's file, opened with
    the agent's options; nothing else. ``rate S`` answers inputs/s over S seconds,
    ``latency N`` the median ms of N single calls, ``gap S G`` inputs/s over S seconds
    with G µs of busy waiting on this thread after each call."""
    from agent.predictors import open_predictor
    from agent.worker import LoadedModel
    from mlscope import samples
    from mlscope.catalog import Catalog, default_manifest_dirs

    entry = Catalog.load(default_manifest_dirs()).find(case.model, framework=case.framework)
    m = entry.manifest
    inputs, _ = samples.feeders(samples.dataset(entry, zoo), m.inputs[0].shape, case.batch, 0)
    shaper = LoadedModel(entry, open_predictor("noop", Path("none"), m, PredictorOptions()), 0)
    batches = [np.ascontiguousarray(shaper.pre[0](inputs(i))) for i in range(16)]
    pred = open_predictor(
        case.framework, entry.graph(zoo), m, agent_options(case.framework, case.batch)
    )
    pred.predict([np.zeros((1, *batches[0].shape[1:]), batches[0].dtype)])  # as the agent

    def rate(seconds: float, gap_us: float = 0.0) -> float:
        done, k, t0 = 0, 0, time.perf_counter()
        gap_ns = int(gap_us * 1e3)
        while time.perf_counter() - t0 < seconds:
            pred.predict([batches[k % len(batches)]])
            done += case.batch
            k += 1
            if gap_ns:
                until = time.perf_counter_ns() + gap_ns
                while time.perf_counter_ns() < until:
                    pass
        return done / (time.perf_counter() - t0)

    def latency(n: int) -> float:
        took = []
        for k in range(n):
            t = time.perf_counter_ns()
            pred.predict([batches[k % len(batches)]])
            took.append(time.perf_counter_ns() - t)
        return statistics.median(took) / 1e6

    rate(2.0)  # warm-up
    print("@ready", flush=True)
    for line in sys.stdin:
        what, *args = line.split()
        if what == "rate":
            got = rate(float(args[0]))
        elif what == "gap":
            got = rate(float(args[0]), float(args[1]))
        else:
            got = latency(int(args[0]))
        print(f"@{got}", flush=True)
    pred.close()


def null_sut_child() -> None:
    """MLPerf LoadGen Server scenario with a null SUT: every query completed at issue."""
    import mlperf_loadgen as lg

    from broker.mlperf_logs import parse_detail

    def issue(queries: list[Any]) -> None:
        lg.QuerySamplesComplete([lg.QuerySampleResponse(q.id, 0, 0) for q in queries])

    print("@ready", flush=True)
    for line in sys.stdin:
        qps, seconds = (float(v) for v in line.split())
        out = Path(tempfile.mkdtemp(prefix="mlscope-null-sut-"))
        sut = lg.ConstructSUT(issue, lambda: None)
        qsl = lg.ConstructQSL(1024, 1024, lambda _: None, lambda _: None)
        ts = lg.TestSettings()
        ts.scenario = lg.TestScenario.Server
        ts.mode = lg.TestMode.PerformanceOnly
        ts.server_target_qps = qps
        ts.min_duration_ms = int(seconds * 1000)
        ts.min_query_count = int(qps * seconds * 0.9)
        log = lg.LogSettings()
        log.log_output.outdir = str(out)
        log.log_output.copy_summary_to_stdout = False
        lg.StartTestWithLogSettings(sut, qsl, ts, log)
        lg.DestroyQSL(qsl)
        lg.DestroySUT(sut)
        kv = parse_detail((out / "mlperf_log_detail.txt").read_text())
        doc = {
            "p50_ms": kv["result_50.00_percentile_latency_ns"] / 1e6,
            "p99_ms": kv["result_99.00_percentile_latency_ns"] / 1e6,
            "queries": kv.get("result_query_count"),
        }
        print("@" + json.dumps(doc), flush=True)


# ----------------------------------------------------------------------- parts


def batched(
    zoo: Path, cases: list[Case], rounds: int, seconds: float, server: bool
) -> list[dict[str, Any]]:
    """Each case: the bare loop, placement agent (and server) alternated, rotating."""
    s, live = stack(zoo, sorted({c.framework for c in cases}))
    try:
        return [_batched_case(live, zoo, c, rounds, seconds, server) for c in cases]
    finally:
        s.stop()


def _batched_case(
    live: Settings, zoo: Path, case: Case, rounds: int, seconds: float, server: bool
) -> dict[str, Any]:
    bare = Child("--bare-child", "--zoo", str(zoo), "--case", str(case))
    spec = ScenarioSpec(
        name="batched", batch_size=case.batch, duration_s=seconds, min_duration_s=0, min_queries=1
    )
    order = ["bare", "agent", *(["server"] if server else [])]
    got: dict[str, list[float]] = {k: [] for k in order}
    try:
        for _ in range(1 + rounds):  # the first round warms every path up, not kept
            for who in order:
                if who == "bare":
                    ips = float(bare.ask(f"rate {seconds}"))
                else:
                    job = JobRequest(
                        model=case.model,
                        framework=case.framework,
                        scenario=spec,
                        trace_level="none",
                        placement=who,  # type: ignore[arg-type]
                    )
                    ips = run_job(live, job).throughput_ips or 0.0
                got[who].append(ips)
            order = order[1:] + order[:1]  # rotate: no path always runs first
    finally:
        bare.close()
    kept = {k: v[1:] for k, v in got.items()}
    doc = {
        "case": str(case),
        "runtime_options": agent_options(case.framework, case.batch).runtime,
        "inputs_per_s": kept,
        "median_inputs_per_s": {k: statistics.median(v) for k, v in kept.items()},
        "median_ratio_to_bare": {
            who: statistics.median(p / b for p, b in zip(kept[who], kept["bare"], strict=True))
            for who in kept
            if who != "bare"
        },
    }
    print(json.dumps({"batched_case": doc}), flush=True)
    return doc


def single_stream(zoo: Path, case: Case, rounds: int, queries: int) -> dict[str, Any]:
    """Single-stream p50 in placement agent against the median of single bare calls."""
    s, live = stack(zoo, [case.framework])
    bare = Child("--bare-child", "--zoo", str(zoo), "--case", str(case))
    spec = ScenarioSpec(
        name="single-stream", max_queries=queries, duration_s=600, min_duration_s=0, min_queries=1
    )
    got: dict[str, list[float]] = {"bare": [], "agent": []}
    order = list(got)
    try:
        for _ in range(1 + rounds):
            for who in order:
                if who == "bare":
                    got[who].append(float(bare.ask(f"latency {queries}")))
                    continue
                job = JobRequest(
                    model=case.model,
                    framework=case.framework,
                    scenario=spec,
                    trace_level="none",
                    placement="agent",
                )
                got[who].append(run_job(live, job).latency_ms.p50 or 0.0)
            order = order[1:] + order[:1]
    finally:
        bare.close()
        s.stop()
    kept = {k: v[1:] for k, v in got.items()}
    return {
        "case": str(case),
        "queries_per_run": queries,
        "p50_ms": kept,
        "median_p50_ms": {k: statistics.median(v) for k, v in kept.items()},
        "median_ratio_to_bare": statistics.median(
            a / b for a, b in zip(kept["agent"], kept["bare"], strict=True)
        ),
    }


def online(zoo: Path, rounds: int, seconds: float, qps: float) -> dict[str, Any]:
    s, live = stack(zoo, ["noop"])
    lg = Child("--null-sut-child")
    spec = ScenarioSpec(name="online", qps=qps, duration_s=seconds)
    got: dict[str, list[dict[str, Any]]] = {"agent": [], "null_sut": [], "server": []}
    order = list(got)
    try:
        for _ in range(rounds):
            for who in order:
                if who == "null_sut":
                    got[who].append(json.loads(lg.ask(f"{qps} {seconds}")))
                    continue
                job = JobRequest(
                    model="noop",
                    framework="noop",
                    scenario=spec,
                    trace_level="none",
                    placement=who,  # type: ignore[arg-type]
                )
                got[who].append(_latency(run_job(live, job)))
            order = order[1:] + order[:1]  # rotate: no path always runs first
    finally:
        lg.close()
        s.stop()

    def med(who: str, key: str) -> float:
        return statistics.median(float(r[key]) for r in got[who])

    return {
        "qps": qps,
        "seconds_per_run": seconds,
        "rounds": rounds,
        "runs": got,
        "median_p50_ms": {k: med(k, "p50_ms") for k in got},
        "median_p99_ms": {k: med(k, "p99_ms") for k in got},
        "median_issue_lag_us": {
            k: {q: med(k, f"issue_lag_{q}_us") for q in ("p50", "p99")} for k in ("agent", "server")
        },
    }


def _latency(summ: EvaluationSummary) -> dict[str, Any]:
    split = summ.issue_lag_split_us or {}
    return {
        "p50_ms": summ.latency_ms.p50,
        "p99_ms": summ.latency_ms.p99,
        "issue_lag_p50_us": summ.issue_lag_us.get("p50"),
        "issue_lag_p99_us": summ.issue_lag_us.get("p99"),
        "pacer_p99_us": (split.get("pacer") or {}).get("p99"),
        "handoff_p99_us": (split.get("loop") or {}).get("p99"),
        "queries": summ.queries,
        "valid": summ.valid,
        "invalid_reasons": list(summ.invalid_reasons),
    }


def gaps(
    zoo: Path, case: Case, rounds: int, seconds: float, gaps_us: list[float]
) -> dict[str, Any]:
    """The bare loop of ``case`` with each busy gap between calls, alternated."""
    bare = Child("--bare-child", "--zoo", str(zoo), "--case", str(case))
    got: dict[float, list[float]] = {g: [] for g in gaps_us}
    order = list(gaps_us)
    try:
        for _ in range(1 + rounds):  # the first round warms up, not kept
            for g in order:
                got[g].append(float(bare.ask(f"gap {seconds} {g}")))
            order = order[1:] + order[:1]
    finally:
        bare.close()
    kept = {g: v[1:] for g, v in got.items()}
    base = kept[gaps_us[0]]
    return {
        "case": str(case),
        "inputs_per_s": {f"{g:g} us": v for g, v in kept.items()},
        "median_ratio_to_first": {
            f"{g:g} us": statistics.median(x / b for x, b in zip(v, base, strict=True))
            for g, v in kept.items()
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--zoo", type=Path, default=Path(os.environ.get("MLSCOPE_TEST_ZOO", "/work/zoo"))
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--qps", type=float, default=1000.0)
    p.add_argument("--online-seconds", type=float, default=10.0)
    p.add_argument("--queries", type=int, default=300, help="single-stream queries per run")
    p.add_argument(
        "--cases",
        default=",".join(CASES),
        help="batched comparisons, MODEL:FRAMEWORK:BATCH comma-separated",
    )
    p.add_argument("--server", action="store_true", help="batched: placement server too")
    p.add_argument("--only", choices=("batched", "single-stream", "online", "gap"), default=None)
    p.add_argument(
        "--gaps", default="0,30,60,120", help="gap: busy µs after each bare call, comma-separated"
    )
    p.add_argument("--bare-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--null-sut-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", type=Case.parse, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.bare_child:
        return bare_child(a.zoo, a.case)
    if a.null_sut_child:
        return null_sut_child()
    print(f"# load average at start: {os.getloadavg()}", flush=True)
    if a.only in (None, "batched"):
        cases = [Case.parse(c) for c in a.cases.split(",")]
        got = batched(a.zoo, cases, a.rounds, a.seconds, a.server)
        print(json.dumps({"batched": got}, indent=1), flush=True)
    if a.only in (None, "single-stream"):
        case = Case("efficientnet_lite0", "onnxruntime", 1)
        doc = single_stream(a.zoo, case, a.rounds, a.queries)
        print(json.dumps({"single_stream": doc}, indent=1), flush=True)
    if a.only in (None, "online"):
        doc = online(a.zoo, a.rounds, a.online_seconds, a.qps)
        print(json.dumps({"online": doc}, indent=1), flush=True)
    if a.only == "gap":
        gap_list = [float(g) for g in a.gaps.split(",")]
        for c in a.cases.split(","):
            doc = gaps(a.zoo, Case.parse(c), a.rounds, a.seconds, gap_list)
            print(json.dumps({"gap": doc}, indent=1), flush=True)
    print(f"# load average at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
