"""MLPerf LoadGen against a real stack (nats-server, server, onnxruntime agent).

``mlscope mlperf`` and ``mlscope import mlperf`` run as a user runs them (child
processes); LoadGen decides validity itself. Runs are kept short through user.conf
overrides (below): the official minimum is 10 minutes per scenario.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgpack
import numpy as np
import pytest

from broker import mlperf_logs as logs
from cli.mlperf_cmd import find_results
from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import codec, names, remote
from mlscope.stats import percentiles
from tests.conftest import child_env, running_stack
from tests.procfs import proc_status_bytes

pytestmark = pytest.mark.timeout(300)

MLSCOPE = Path(sys.executable).parent / "mlscope"
SUBMIT = Path(sys.executable).parent / "mlscope-submit"
USER_CONF = """\
# Short runs for a test machine: the official minimum duration is 600 s.
*.Offline.min_duration = 500
*.Offline.min_query_count = 1
# 4 s at 200 QPS is ~800 queries: more than the 459 that early stopping needs at p99
# with none over the bound, so a few late ones (a neighbour's burst) are tolerated.
*.Server.min_duration = 4000
*.Server.min_query_count = 700
# LoadGen's default Server bound is 10 ms (measured alone here: p99 ~5 ms at 200 QPS).
# The test machine's 2 cores are shared with other work, which has pushed p99 to 90 ms:
# the bound is one a loaded machine still meets, since what is tested is that LoadGen
# accepts the run mlscope serves, not how fast the machine is.
*.Server.target_latency = 1000
*.SingleStream.min_duration = 500
*.SingleStream.min_query_count = 100
*.MultiStream.min_duration = 500
*.MultiStream.min_query_count = 100
"""
OFFLINE_QPS = "200000"
"""Offline: LoadGen issues 1.1 x this x min_duration samples in one query; the run is
VALID only if answering them takes at least min_duration, so this is set well above
what digits_cnn reaches here: 35-50k samples/s over the bus from held samples, 50-64k
with LoadGen next to the model."""


@pytest.fixture(scope="module")
def ort(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("mlperf"), zoo_dir, ["onnxruntime"]) as s:
        yield s


@pytest.fixture(scope="module")
def user_conf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("conf") / "user.conf"
    path.write_text(USER_CONF)
    return path


def cli(stack: Stack, *args: str) -> str:
    """``mlscope ARGS`` against the stack: its standard output (it must succeed)."""
    out = subprocess.run(
        [str(MLSCOPE), *args],
        env=child_env(stack.settings),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def mlscope(stack: Stack, *args: str) -> Any:
    return json.loads(cli(stack, *args, "--json"))


def mlperf(stack: Stack, out: Path, conf: Path, *flags: str) -> dict[str, Any]:
    doc: dict[str, Any] = mlscope(
        stack,
        "mlperf",
        "digits_cnn",
        "--framework",
        "onnxruntime",
        "--user-conf",
        str(conf),
        "--output",
        str(out),
        *flags,
    )
    return doc


def query(stack: Stack, sql: str, **params: Any) -> list[list[Any]]:
    async def go() -> list[list[Any]]:
        async with busmod.connect(stack.settings, name="test") as bus:
            return (await remote.sql(bus, sql, params))[1]

    return anyio.run(go, backend="asyncio")


def summary_stats(text: str) -> dict[str, int]:
    """The summary file's latency lines, read independently of broker.mlperf_logs."""
    found = re.findall(r"^(\d+\.\d+) percentile latency \(ns\)\s*:\s*(\d+)$", text, re.M)
    stats = {q: int(v) for q, v in found}
    top = re.search(r"^Max latency \(ns\)\s*:\s*(\d+)$", text, re.M)
    assert top is not None, text
    stats["max"] = int(top[1])
    return stats


def assert_stored_like_summary(doc: dict[str, Any], text: str) -> None:
    """LoadGen's own figures, kept apart under ``mlperf``, are its summary file's (the
    summary's ``latency_ms`` is the stored rows': tests/test_mlperf_numbers.py)."""
    stats = summary_stats(text)
    lg = doc["mlperf"]
    for q in ("50.00", "90.00", "99.00"):
        assert lg["percentiles_ns"][q] == stats[q]
    result = lg["result"]
    assert result.get("max_query_latency_ns", result.get("max_latency_ns")) == stats["max"]


PLACEMENTS = pytest.mark.parametrize("placement", ["server", "agent"])
"""LoadGen on the server's host (its SUT sends queries over the bus) or on the agent's,
next to the model (the logs are shipped back and stored alike)."""


@PLACEMENTS
def test_offline_is_valid_by_loadgen(
    ort: Stack, user_conf: Path, tmp_path: Path, placement: str
) -> None:
    doc = mlperf(
        ort,
        tmp_path,
        user_conf,
        "--scenario",
        "Offline",
        "--target-qps",
        OFFLINE_QPS,
        "--placement",
        placement,
    )
    summary = (tmp_path / logs.SUMMARY).read_text()
    assert "Result is : VALID" in summary, summary
    assert {logs.DETAIL, logs.TRACE} <= {p.name for p in tmp_path.iterdir()}
    assert doc["valid"] and doc["mlperf"]["validity"] == "VALID" and doc["errors"] == 0
    assert doc["placement"] == placement
    assert doc["scenario"]["name"] == "mlperf-offline"
    # The agent's peak memory, as every run reports it: at most the kernel's
    # high-water mark of the agent process (MB are 10^6 bytes).
    agent = next(p for name, p in ort.children.items() if name != "server")
    assert doc["peak_rss_mb"] is not None and doc["peak_rss_mb"] > 0
    assert doc["peak_rss_mb"] * 1e6 <= proc_status_bytes(agent.pid, "VmHWM") * 1.005
    assert_stored_like_summary(doc, summary)
    rows = query(
        ort,
        "SELECT count(), sum(ok), min(agent_received_ns) FROM queries FINAL "
        "WHERE evaluation_id = {e:String}",
        e=doc["evaluation_id"],
    )
    # One row per LoadGen sample, every one answered, agent times on LoadGen's clock.
    assert rows[0][0] == rows[0][1] == doc["samples"] >= 11 * int(OFFLINE_QPS) // 20
    assert rows[0][2] > 0
    # The logs it wrote, imported on this server, are this run: nothing stored again.
    count = "SELECT count() FROM evaluations FINAL"
    before = query(ort, count)
    said = cli(ort, "import", "mlperf", str(tmp_path), "--model", "digits_cnn")
    assert f"already stored: the mlscope mlperf run of job {doc['job_id']}" in said, said
    [again] = mlscope(ort, "import", "mlperf", str(tmp_path), "--model", "digits_cnn")
    assert again["evaluation_id"] == doc["evaluation_id"] and again["import"]["already_imported"]
    assert query(ort, count) == before


@PLACEMENTS
def test_server_200_qps_is_valid_by_loadgen(
    ort: Stack, user_conf: Path, tmp_path: Path, placement: str
) -> None:
    doc = mlperf(
        ort,
        tmp_path,
        user_conf,
        "--scenario",
        "Server",
        "--target-qps",
        "200",
        "--placement",
        placement,
    )
    summary = (tmp_path / logs.SUMMARY).read_text()
    assert "Result is : VALID" in summary, summary
    assert doc["valid"] and doc["mlperf"]["validity"] == "VALID"
    assert doc["placement"] == placement
    assert doc["requested_qps"] == 200 and 180 < doc["achieved_qps"] < 220
    assert_stored_like_summary(doc, summary)
    rows = query(
        ort,
        "SELECT completed_ns - scheduled_ns, issued_ns >= scheduled_ns, "
        "agent_received_ns <= completed_ns FROM queries FINAL "
        "WHERE evaluation_id = {e:String}",
        e=doc["evaluation_id"],
    )
    assert len(rows) == doc["queries"] >= 700
    assert all(r[1] and r[2] for r in rows)
    # The stored per-query latencies are LoadGen's: its p50 is among them.
    assert int(summary_stats(summary)["50.00"]) in {int(r[0]) for r in rows}
    # Where the time went, as for any run: each stage's p50 is the median of the
    # stored rows' own differences (nearest rank, computed here with numpy).
    stages = query(
        ort,
        "SELECT agent_received_ns - issued_ns, predict_start_ns - agent_received_ns, "
        "predict_end_ns - predict_start_ns, completed_ns - agent_replied_ns "
        "FROM queries FINAL WHERE evaluation_id = {e:String} AND ok",
        e=doc["evaluation_id"],
    )
    split = doc["latency_split_ms"]
    for k, name in enumerate(("to_agent", "queueing", "compute", "from_agent")):
        ns = np.sort(np.array([r[k] for r in stages], np.int64))
        assert split[name]["p50"] == pytest.approx(ns[(len(ns) + 1) // 2 - 1] / 1e6), name
    assert split["compute"]["p50"] > 0 and split["transport"]["p50"] > 0
    assert_reported(ort, tmp_path, doc["evaluation_id"])


def assert_reported(stack: Stack, tmp_path: Path, *ids: str) -> None:
    """``mlscope report`` reads the runs like any other evaluation."""
    out = subprocess.run(
        [str(MLSCOPE), "report", *ids, "-o", str(tmp_path / "r.md")],
        env=child_env(stack.settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "r.md").read_text()
    assert all(i in text for i in ids) and "mlperf-" in text


@PLACEMENTS
def test_accuracy_run_matches_the_zoo(
    ort: Stack, user_conf: Path, tmp_path: Path, placement: str
) -> None:
    doc = mlperf(
        ort,
        tmp_path,
        user_conf,
        "--scenario",
        "Offline",
        "--mode",
        "AccuracyOnly",
        "--placement",
        placement,
    )
    assert (tmp_path / "accuracy.txt").read_text() == "accuracy=97.778%, good=352, total=360\n"
    # The zoo records top1 0.9778 for digits_cnn on its 360-sample holdout.
    assert round(doc["accuracy"]["top1"], 4) == 0.9778 and doc["accuracy"]["samples"] == 360
    entries = logs.accuracy_entries((tmp_path / logs.ACCURACY).read_text())
    assert sorted(i for i, _ in entries) == list(range(360))
    # The stored specification runs LoadGen again.
    again = mlscope(ort, "rerun", doc["evaluation_id"])
    assert again["mlperf"]["mode"] == "AccuracyOnly" and again["accuracy"] == doc["accuracy"]
    assert again["placement"] == placement
    assert again["evaluation_id"] != doc["evaluation_id"]


@PLACEMENTS
def test_samples_loaded_in_sets_as_loadgen_asks(
    ort: Stack, user_conf: Path, tmp_path: Path, placement: str
) -> None:
    """LoadGen's load/unload callbacks honoured: with 100 samples in memory at a time,
    an accuracy run loads the 360 in four sets (unloading each before the next) and
    every answer comes from a loaded sample."""
    conf = tmp_path / "user.conf"
    conf.write_text(user_conf.read_text() + "*.Offline.performance_sample_count_override = 100\n")
    out = tmp_path / "out"
    doc = mlperf(
        ort, out, conf, "--scenario", "Offline", "--mode", "AccuracyOnly", "--placement", placement
    )
    detail = (out / logs.DETAIL).read_text()
    assert '"key": "effective_performance_sample_count", "value": 100' in detail
    assert detail.count('"key": "loaded_qsl_set"') == 4  # 100 + 100 + 100 + 60
    assert doc["errors"] == 0 and doc["accuracy"]["samples"] == 360
    assert round(doc["accuracy"]["top1"], 4) == 0.9778


def test_a_server_placement_test_survives_hostile_replies_in_its_inbox(
    ort: Stack, user_conf: Path, tmp_path: Path
) -> None:
    """Beside each real answer, the SUT's inbox gets garbage, wrong types, deep nesting,
    foreign indices and an unreadable reply for the very chunk asked: none completes a
    sample, and LoadGen's test is VALID with every sample answered by the agent."""
    deep: Any = 1
    for _ in range(200):
        deep = [deep]
    seen = threading.Event()
    stop = threading.Event()

    def hostile(index: int) -> list[bytes]:
        return [  # the chunk's own index first, so it may beat the agent's answer
            codec.encode({"kind": "reply", "index": index, "ok": True, "t_received": "late"}),
            b"\xc1garbage",
            msgpack.packb(deep),
            codec.encode([1, 2, 3]),
            codec.encode({"kind": "reply", "index": "seven", "ok": True}),
            codec.encode({"kind": "reply", "index": 2**64 - 1, "ok": True}),
            codec.encode({"kind": "error", "error": "not a mapping"}),
            codec.encode({"kind": "reply", "index": index, "ok": True, "pad": b"x" * 4096}),
        ]

    async def attack() -> None:
        async with busmod.connect(ort.settings, name="test attacker") as bus:

            async def poison(msg: Any) -> None:
                if msg.reply:
                    seen.set()
                    for data in hostile(int(codec.decode(msg.data)["index"])):
                        await bus.nc.publish(msg.reply, data)

            await bus.nc.subscribe(f"{names.PREFIX}.agent.*.samples", cb=poison)
            await bus.nc.flush()
            while not stop.is_set():
                await anyio.sleep(0.05)

    attacker = threading.Thread(target=anyio.run, args=(attack,), daemon=True)
    attacker.start()
    try:
        flags = ["--scenario", "Server", "--target-qps", "200", "--placement", "server"]
        doc = mlperf(ort, tmp_path, user_conf, *flags)
    finally:
        stop.set()
        attacker.join(10)
    assert seen.is_set(), "the attacker saw no query"
    summary = (tmp_path / logs.SUMMARY).read_text()
    assert "Result is : VALID" in summary, summary
    assert doc["valid"] and doc["errors"] == 0 and doc["queries"] >= 700


@pytest.mark.parametrize("scenario", ["SingleStream", "MultiStream"])
def test_stream_scenarios(ort: Stack, user_conf: Path, tmp_path: Path, scenario: str) -> None:
    doc = mlperf(ort, tmp_path, user_conf, "--scenario", scenario)
    summary = (tmp_path / logs.SUMMARY).read_text()
    assert f"Scenario : {scenario}" in summary
    # No sample failed in the agent; LoadGen's own runtime errors are kept apart (with
    # these short runs it may run out of generated queries, one error, which it reports).
    assert doc["errors"] == 0 and "num_errors" in doc["mlperf"]
    assert_stored_like_summary(doc, summary)
    per_query = 8 if scenario == "MultiStream" else 1  # LoadGen's default samples/query
    assert doc["scenario"]["batch_size"] == 1  # a row, and a query of the summary: a sample
    assert doc["mlperf"]["samples_per_query"] == per_query
    rows = query(
        ort,
        "SELECT count(), sum(ok) FROM queries FINAL WHERE evaluation_id = {e:String}",
        e=doc["evaluation_id"],
    )
    lg_queries = doc["mlperf"]["result"]["query_count"]
    assert rows[0][0] == rows[0][1] == doc["queries"] == lg_queries * per_query >= 100 * per_query
    # LoadGen's verdict is what the summary file says, reasons included.
    assert doc["valid"] == ("Result is : VALID" in summary)
    if not doc["valid"]:
        assert doc["invalid_reasons"] and all(
            r.startswith("LoadGen: ") for r in doc["invalid_reasons"]
        )


@PLACEMENTS
def test_a_conf_loadgen_refuses_is_a_typed_error(
    ort: Stack, tmp_path: Path, placement: str
) -> None:
    bad = tmp_path / "user.conf"
    bad.write_text("*.Server.target_qps = fast\n")
    out = subprocess.run(
        [
            str(MLSCOPE),
            "mlperf",
            "digits_cnn",
            "--framework",
            "onnxruntime",
            "--scenario",
            "Server",
            "--user-conf",
            str(bad),
            "--output",
            str(tmp_path / "out"),
            "--placement",
            placement,
        ],
        env=child_env(ort.settings),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 1 and "LoadGen refused the user.conf" in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()


def run_loadgen(out: Path, scenario: str, *, latency_s: float) -> None:
    """Real LoadGen against an in-process SUT that answers after ``latency_s``."""
    import mlperf_loadgen as lg

    def issue(samples: list[Any]) -> None:
        def answer() -> None:
            data = np.zeros(1, np.int64)
            lg.QuerySamplesComplete(
                [lg.QuerySampleResponse(s.id, data.ctypes.data, data.nbytes) for s in samples]
            )

        threading.Timer(latency_s, answer).start()

    sut = lg.ConstructSUT(issue, lambda: None)
    qsl = lg.ConstructQSL(64, 64, lambda _: None, lambda _: None)
    ts = lg.TestSettings()
    ts.scenario = getattr(lg.TestScenario, scenario)
    ts.mode = lg.TestMode.PerformanceOnly
    ts.server_target_qps = 300
    ts.offline_expected_qps = 100
    ts.min_duration_ms = 1000
    ts.min_query_count = 100
    log = lg.LogSettings()
    log.log_output.outdir = str(out)
    log.log_output.copy_summary_to_stdout = False
    log.enable_trace = scenario == "Server"
    out.mkdir(parents=True)
    lg.StartTestWithLogSettings(sut, qsl, ts, log)
    lg.DestroyQSL(qsl)
    lg.DestroySUT(sut)


def test_import_gives_the_summary_files_percentiles(ort: Stack, tmp_path: Path) -> None:
    tree = tmp_path / "results" / "testbox"
    run_loadgen(tree / "digits_cnn" / "Server" / "performance" / "run_1", "Server", latency_s=0.002)
    run_loadgen(
        tree / "digits_cnn" / "Offline" / "performance" / "run_1", "Offline", latency_s=0.01
    )
    docs = mlscope(ort, "import", "mlperf", str(tmp_path / "results"))
    assert len(docs) == 2
    for doc, run_dir in zip(docs, find_results(tmp_path / "results"), strict=True):
        summary = (run_dir / logs.SUMMARY).read_text()
        assert f"Scenario : {doc['mlperf']['scenario']}" in summary
        assert_stored_like_summary(doc, summary)
        assert doc["mlperf"]["imported"] and doc["agent_id"] == "imported"
        assert doc["host"] == "testbox" and doc["model"]["name"] == "digits_cnn"
        assert doc["valid"] == ("Result is : VALID" in summary)
        spec, stored = anyio.run(_evaluation, ort, doc["evaluation_id"], backend="asyncio")
        assert spec["imported"]["source"] == str(run_dir.resolve())
        assert stored["latency_ms"] == doc["latency_ms"]
    server = next(d for d in docs if d["mlperf"]["scenario"] == "Server")
    rows = query(
        ort,
        "SELECT count() FROM queries FINAL WHERE evaluation_id = {e:String}",
        e=server["evaluation_id"],
    )
    assert rows[0][0] == server["queries"]  # per-sample records from the trace log
    assert_reported(ort, tmp_path, *(d["evaluation_id"] for d in docs))
    out = subprocess.run(
        [str(MLSCOPE), "rerun", server["evaluation_id"]],
        env=child_env(ort.settings),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1 and "imported" in out.stderr


async def _evaluation(stack: Stack, eval_id: str) -> tuple[dict[str, Any], dict[str, Any]]:
    async with busmod.connect(stack.settings, name="test") as bus:
        return await remote.evaluation(bus, eval_id)


# Cross-check: mlscope's open-loop Poisson generator (online) and LoadGen's Server
# scenario, same model, agent, rate and seed (each generator draws its own Poisson
# schedule from it), both measuring from the scheduled time in a process of the
# server's host. Compared: the two latency distributions from the stored per-query
# records, at p10, p25, p50, p75 and p90 (the quantile function over most of its
# range, not one point). Each quantile must agree within
# max(CROSS_FLOOR_MS, f(q) x the larger), where f grows linearly from 0.3 at p10 to
# 0.7 at p90 (cross_tolerance): the body is where a real disagreement shows -- a unit
# or clock error, latency counted from the issue instead of the schedule under load,
# or a hop added on one path moves it by more than 30-45 % or 0.75 ms -- and the upper
# quantiles belong more and more to the neighbours on this shared 2-core machine (the
# same generator's p90 ranged from 1.9 to 62 ms between back-to-back 3 s runs), so
# they get more room; p99 and above are not compared. The generators run alternately
# CROSS_PAIRS times and each quantile is the median over a generator's runs, so two
# runs of each caught in a neighbour's burst change nothing: one such run moved p50
# from 1 to 7 ms (load average 4-6), and with 3 pairs one of 5 tries failed at load
# average 5-8. Measured
# here with load average ~3: p10..p75 within 0.35 ms, p90 2.2 vs 3.2 ms (tolerance
# 2.3 ms). The floor covers the one hop LoadGen's path has by design: its issue
# thread calls the SUT at the scheduled time and the query crosses to the event loop
# after it (mlscope's pacer hands queries over ahead and holds them to the deadline).
# On a 2-core AMD EPYC VM that hop took 0.25 ms at p10 quiet (issued -> agent
# received 0.59 vs 0.33 ms, medians of 5 runs) and 0.5 ms under a full test run.
# A hop shifts the distribution and leaves its shape; a stretched clock or a unit
# error changes the shape, so the spreads (p75 - p25) must also agree within a factor
# CROSS_SPREAD (measured: 1.05 under a full test run, 1.25 quiet) or, for a body as
# narrow as this one's (~0.5 ms), within CROSS_SPREAD_FLOOR_MS: beside a full test
# run and another session once, the spreads differed by the factor 1.60 while the
# quantiles agreed, the kind of 0.1-0.2 ms a neighbour's burst moves a 0.3 ms spread.
# A stretch by 1.8 of the same body moves it by ~0.7 ms and still fails.
# test_cross_check_catches_a_disagreement shows shifted, stretched and
# heavier-tailed distributions fail the comparison.
CROSS_QPS = "200"
CROSS_PAIRS = 5
CROSS_QUANTILES = (10, 25, 50, 75, 90)
CROSS_FLOOR_MS = 0.75
CROSS_FRACTION = (0.3, 0.7)
"""f(q) at p10 and at p90; linear between."""
CROSS_SPREAD = 1.6
CROSS_SPREAD_FLOOR_MS = 0.3


def cross_tolerance(q: float, x: float, y: float) -> float:
    """How far apart two generators' q-th percentiles (ms) may be."""
    lo, hi = CROSS_FRACTION
    f = lo + (hi - lo) * (q - CROSS_QUANTILES[0]) / (CROSS_QUANTILES[-1] - CROSS_QUANTILES[0])
    return max(CROSS_FLOOR_MS, f * max(x, y))


def run_quantiles(latencies_ms: np.ndarray) -> list[float]:
    found = percentiles(latencies_ms, CROSS_QUANTILES)
    assert None not in found
    return [float(q) for q in found if q is not None]


def disagreements(a_runs: list[list[float]], b_runs: list[list[float]]) -> list[str]:
    """Quantiles (medians over each generator's runs) that differ by more than
    :func:`cross_tolerance`, and spreads that differ by more than CROSS_SPREAD and
    CROSS_SPREAD_FLOOR_MS; empty
    when the distributions agree."""
    a, b = (np.median(np.asarray(r), axis=0) for r in (a_runs, b_runs))
    found = [
        f"p{q}: {x:.3f} vs {y:.3f} ms (tolerance {cross_tolerance(q, x, y):.3f})"
        for q, x, y in zip(CROSS_QUANTILES, a, b, strict=True)
        if abs(x - y) > cross_tolerance(q, x, y)
    ]
    p25, p75 = CROSS_QUANTILES.index(25), CROSS_QUANTILES.index(75)
    spread_a, spread_b = a[p75] - a[p25], b[p75] - b[p25]
    wide, narrow = max(spread_a, spread_b), min(spread_a, spread_b)
    if wide > CROSS_SPREAD * narrow and wide - narrow > CROSS_SPREAD_FLOOR_MS:
        found.append(
            f"p25..p75: {spread_a:.3f} vs {spread_b:.3f} ms "
            f"(factor {CROSS_SPREAD}, at least {CROSS_SPREAD_FLOOR_MS} ms apart)"
        )
    return found


def stored_quantiles(stack: Stack, evaluation_id: str) -> list[float]:
    rows = query(
        stack,
        "SELECT completed_ns - scheduled_ns FROM queries FINAL "
        "WHERE evaluation_id = {e:String} AND ok = 1",
        e=evaluation_id,
    )
    return run_quantiles(np.asarray([r[0] for r in rows], float) / 1e6)


def test_cross_check_with_mlscope_loadgen(ort: Stack, user_conf: Path, tmp_path: Path) -> None:
    runs: dict[str, list[list[float]]] = {"LoadGen": [], "mlscope": []}
    for k in range(CROSS_PAIRS):
        lg_doc = mlperf(
            ort,
            tmp_path / f"run{k}",
            user_conf,
            "--scenario",
            "Server",
            "--target-qps",
            CROSS_QPS,
            "--seed",
            "7",
            "--batch-size",
            "1",
        )
        assert lg_doc["mlperf"]["effective"]["schedule_rng_seed"] == 7
        out = subprocess.run(
            [
                str(SUBMIT),
                "digits_cnn",
                "--framework",
                "onnxruntime",
                "--scenario",
                "online",
                "--qps",
                CROSS_QPS,
                "--duration",
                "4",
                "--seed",
                "7",
                "--trace-level",
                "none",
                "--json",
            ],
            env=child_env(ort.settings),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        runs["LoadGen"].append(stored_quantiles(ort, lg_doc["evaluation_id"]))
        runs["mlscope"].append(stored_quantiles(ort, json.loads(out.stdout)["evaluation_id"]))
    found = disagreements(runs["LoadGen"], runs["mlscope"])
    assert not found, f"{found}; per run (ms at {CROSS_QUANTILES}): {runs}"


# ----------------------------------------------------------------- fast, no stack


def test_cross_check_catches_a_disagreement() -> None:
    """The comparison fails on distributions that differ as a bug would make them:
    shifted by a constant, stretched, or with a heavier upper part; and passes on
    independent draws of one distribution."""
    rng = np.random.default_rng(7)

    def runs(transform: Any = lambda x: x) -> list[list[float]]:
        # A body like digits_cnn's at 200 QPS here: median ~1.2 ms, p90 ~2.5 ms.
        return [run_quantiles(transform(rng.lognormal(np.log(1.2), 0.55, 800))) for _ in range(3)]

    assert not disagreements(runs(), runs())
    hop = disagreements(runs(), runs(lambda x: x + 1.0))  # a hop added: +1 ms
    assert any(d.startswith("p10:") for d in hop)  # seen in the body, not only a tail
    stretched = disagreements(runs(), runs(lambda x: x * 1.8))  # a clock or unit error
    assert any(d.startswith("p25..p75:") for d in stretched)
    assert disagreements(runs(), runs(lambda x: np.where(x > 1.6, x * 4, x)))  # upper part
