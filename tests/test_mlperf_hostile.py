"""MLPerf LoadGen runs against hostile or careless peers, on a real nats-server and real
LoadGen: an agent that claims huge files, never ends its run, answers with class
indices past Int32 or a prepare reply without its times; settings that would make
LoadGen generate more than a host can hold; an imported trace with a huge query_seq.

Each must end as a typed error (or fail only the samples concerned), never as an
untyped exception after a wasted test or an exhausted host.
"""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import numpy as np
import pytest

from broker import mlperf, mlperf_agent, mlperf_record
from broker import mlperf_logs as logs
from broker.evalsummary import budget_warnings
from mlscope import bus as busmod
from mlscope import codec, names, provision, wire
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.contracts import (
    MAX_MLPERF_FILE_BYTES,
    MLPERF_FILE_NAMES,
    JobRequest,
    MLPerfDone,
    MLPerfFile,
    MLPerfSpec,
    MLPerfStarted,
    PingReply,
    PrepareReply,
    QueryReply,
    ReleaseReply,
    SamplesReply,
)
from mlscope.errors import BusError, ConfigError, EvaluationError, MLScopeError, WireError
from mlscope.mlperf import (
    MAX_CLASS,
    TIMING,
    SampleTiming,
    load_loadgen,
    load_timing,
    rankings,
    save_timing,
)
from mlscope.mlperf import (
    test_settings as loadgen_settings,
)
from mlscope.natsserver import NatsServer
from mlscope.settings import Settings
from tests.conftest import agent_description
from tests.zoo_fixtures import built

pytestmark = pytest.mark.timeout(240)

USER_CONF = (
    "*.Offline.min_duration = 200\n*.Offline.min_query_count = 1\n"
    "*.SingleStream.min_duration = 300\n*.SingleStream.min_query_count = 100\n"
)
RELEASED = ReleaseReply()
GOOD_PREP = PrepareReply(cold=True, load_ns=1_000_000, first_inference_ns=1000, t_agent=0).dump()


def _timing_bytes() -> bytes:
    """A sut-timing.npz as a run writes it (one query of one sample)."""
    buf = io.BytesIO()
    save_timing(buf, [5], {(0, 0): SampleTiming(ok=True, prediction=3)}, 0)
    return buf.getvalue()


# --------------------------------------------------------------------------- fake agents


async def _fake_agent(
    bus: busmod.Bus,
    agent_id: str,
    files: dict[str, bytes],
    *,
    claims: dict[str, int] | None = None,
    served: list[int] | None = None,
    chatter: bool = False,
    mute: bool = False,
) -> None:
    """An agent's ctl for a placement-agent run: it claims ``claims`` (default: the
    sizes of ``files``) and serves ``files`` (past their end: more ``x``)."""
    sent = served if served is not None else [0]

    async def noise(subject: str) -> None:  # never the end, every 0.1 s
        while True:
            await bus.nc.publish(subject, codec.encode({"kind": "noise"}))
            await anyio.sleep(0.1)

    async def ctl(msg: Any) -> None:
        op = codec.decode(msg.data)
        kind = op.get("op")
        if kind == "ping":
            out: Any = PingReply(t_agent=time.perf_counter_ns()).dump()
        elif kind == "prepare":
            out = GOOD_PREP
        elif kind == "mlperf":
            subject = names.agent_rows(agent_id, op["evaluation_id"])
            if chatter:
                asyncio.get_running_loop().create_task(noise(subject))
            elif not mute:
                sizes = claims if claims is not None else {k: len(v) for k, v in files.items()}
                done = MLPerfDone.model_construct(evaluation_id=op["evaluation_id"], files=sizes)
                await bus.nc.publish(subject, codec.encode(done.dump()))
            out = MLPerfStarted(pid=1).dump()
        elif kind == "mlperf_fetch":
            data = files.get(op["name"], b"")[op["offset"] : op["offset"] + 65536]
            data = data or b"x" * 65536
            sent[0] += len(data)
            out = MLPerfFile(name=op["name"], offset=op["offset"], data=data).dump()
        else:
            out = {"kind": "released", "ok": True}
        await msg.respond(codec.encode(out))

    await bus.nc.subscribe(names.agent_ctl(agent_id), cb=ctl)
    await bus.nc.flush()


async def _answers_pings(bus: busmod.Bus, agent_id: str) -> None:
    """Until the agent answers a ping on this connection (the server resolves an agent
    by pinging it before it runs anything there)."""
    with anyio.fail_after(10):
        while True:
            try:
                await busmod.request(
                    bus, names.agent_ctl(agent_id), codec.encode({"op": "ping"}), timeout=1
                )
                return
            except BusError:
                await anyio.sleep(0.1)


def _agent_run(tmp_path: Path, **agent_kw: Any) -> BaseException | None:
    """run_in_agent against a fake agent; what it raised."""
    got: list[BaseException | None] = []

    async def main() -> None:
        with NatsServer(store_dir=tmp_path / "nats") as ns:
            settings = Settings(nats_url=ns.url, data_dir=tmp_path / "data")
            async with (
                busmod.connect(settings, name="fake agent") as agent_bus,
                busmod.connect(settings, name="server side") as bus,
            ):
                await _fake_agent(agent_bus, "agent-x", **agent_kw)
                await _answers_pings(bus, "agent-x")  # as the server sees it, before a run
                agent = SimpleNamespace(agent_id="agent-x")
                try:
                    with anyio.fail_after(20):
                        spec = MLPerfSpec(scenario="Offline")
                        await mlperf_agent.run_in_agent(bus, spec, "m", "ev-x", agent)  # type: ignore[arg-type]
                    got.append(None)
                except BaseException as exc:  # what the test checks
                    got.append(exc)

    anyio.run(main)
    return got[0]


def test_files_past_the_limits_are_refused_before_anything_is_fetched(tmp_path: Path) -> None:
    served = [0]
    err = _agent_run(tmp_path, files={}, claims={TIMING: 10**12}, served=served)
    assert isinstance(err, MLScopeError), err
    assert served[0] == 0


@pytest.mark.parametrize(
    "files",
    [
        {TIMING: MAX_MLPERF_FILE_BYTES + 1},
        {TIMING: 1000, logs.TRACE: MAX_MLPERF_FILE_BYTES, logs.DETAIL: 2 << 30},
        {TIMING: 1000, "../../etc/passwd": 10},
        {TIMING: -1},
    ],
)
def test_the_done_message_bounds_names_and_sizes(files: dict[str, int]) -> None:
    with pytest.raises(MLScopeError):
        codec.validate(MLPerfDone, {"kind": "mlperf_done", "evaluation_id": "e", "files": files})


def test_the_done_message_takes_every_file_a_run_leaves() -> None:
    assert {*logs.LOG_FILES, TIMING} == MLPERF_FILE_NAMES


def test_a_part_past_the_claimed_size_is_refused(tmp_path: Path) -> None:
    served = [0]
    err = _agent_run(tmp_path, files={}, claims={TIMING: 100}, served=served)
    assert isinstance(err, EvaluationError) and "past" in err.message, err
    assert served[0] <= 65536


def test_an_agent_that_chatters_but_never_ends_its_run_is_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mlperf_agent, "RUN_LIMIT_S", 1.0)
    monkeypatch.setattr(mlperf_agent, "IDLE_S", 0.5)
    err = _agent_run(tmp_path, files={}, chatter=True)
    assert isinstance(err, EvaluationError) and "within" in err.message, err


def test_a_run_whose_agent_restarted_under_its_id_is_given_up_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process answering pings under the agent's id is not the one that started the
    run (its registry entry says so): the run is lost, not awaited for hours."""
    monkeypatch.setattr(mlperf_agent, "IDLE_S", 0.5)
    ran = agent_description("agent-x", pid=4242, started_at=5.0, heartbeat_at=time.time())

    async def main() -> None:
        with NatsServer(store_dir=tmp_path / "nats") as ns:
            settings = Settings(nats_url=ns.url, data_dir=tmp_path / "data")
            async with (
                busmod.connect(settings, name="fake agent") as agent_bus,
                busmod.connect(settings, name="server side") as bus,
            ):
                await provision.ensure_infrastructure(bus)
                kv = await bus.kv(names.AGENTS_BUCKET)
                await kv.put("agent-x", codec.encode_model(ran.model_copy(update={"pid": 4243})))
                await _fake_agent(agent_bus, "agent-x", {}, mute=True)
                await _answers_pings(bus, "agent-x")
                with anyio.fail_after(20), pytest.raises(EvaluationError, match="it restarted"):
                    await mlperf_agent.run_in_agent(
                        bus, MLPerfSpec(scenario="Offline"), "m", "e", ran
                    )

    anyio.run(main)


def _npz(members: dict[str, np.ndarray], *, header_shape: tuple[int, ...] | None = None) -> bytes:
    """An npz of ``members``, the ``agent`` member's header claiming ``header_shape``
    (deflated: a few bytes that claim gigabytes)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, arr in members.items():
            out = io.BytesIO()
            np.lib.format.write_array(out, arr)
            data = out.getvalue()
            if name == "agent" and header_shape is not None:
                head = {"descr": "<i8", "fortran_order": False, "shape": header_shape}
                hdr = io.BytesIO()
                np.lib.format.write_array_header_1_0(hdr, head)
                data = hdr.getvalue() + b"\0" * 4096
            zf.writestr(f"{name}.npy", data)
    return buf.getvalue()


def test_a_timing_file_is_checked_before_its_arrays_are_read() -> None:
    good = dict(np.load(io.BytesIO(_timing_bytes())))
    assert load_timing(io.BytesIO(_npz(good)))["prediction"].tolist() == [3]
    huge = _npz(good, header_shape=(1 << 40, 4))
    assert len(huge) < 100_000
    with pytest.raises(EvaluationError):
        load_timing(io.BytesIO(huge))
    for bad in (
        {**good, "extra": np.zeros(1)},
        {**good, "ok": np.zeros(2, bool)},  # not one sample count
        {**good, "key": np.zeros((1, 3), np.int64)},
        {**good, "prediction": np.array([2**40])},
    ):
        with pytest.raises(EvaluationError):
            load_timing(io.BytesIO(_npz(bad)))
    with pytest.raises(EvaluationError):
        load_timing(io.BytesIO(b"not a zip"))


# --------------------------------------------------------------------------- placement server


class _Host:
    def __init__(self, bus: busmod.Bus, zoo: Path) -> None:
        self.bus, self.zoo_dir = bus, zoo
        self.db = SimpleNamespace(command=lambda *a, **k: None, insert=lambda *a, **k: None)
        self.stored: list[Any] = []

    def store_evaluation(self, s: Any, rec: Any, spec_doc: Any) -> None:
        self.stored.append((s, rec, spec_doc))


async def _served_agent(
    bus: busmod.Bus,
    agent_id: str,
    first: dict[str, Any],
    prep: dict[str, Any],
    files: Any,
    released: Any,
) -> None:
    """ping / prepare / samples; the first samples query answered with ``first`` over
    an honest reply; ``mlperf`` (placement agent) answered with ``files``; release with
    ``released``."""

    async def ctl(msg: Any) -> None:
        op = codec.decode(msg.data)
        kind = op.get("op")
        if kind == "ping":
            out: Any = {"kind": "pong", "t_agent": time.perf_counter_ns()}
        elif kind == "prepare":
            out = prep
        elif kind in ("load_samples", "unload_samples"):
            out = SamplesReply(held=0, bytes=0, preprocessed=False).dump()
        elif kind == "mlperf":
            sizes = {k: len(v) for k, v in files.items()}
            done = MLPerfDone(evaluation_id=op["evaluation_id"], files=sizes)
            subject = names.agent_rows(agent_id, op["evaluation_id"])
            await bus.nc.publish(subject, codec.encode_model(done))
            out = MLPerfStarted(pid=1).dump()
        elif kind == "mlperf_fetch":
            data = files[op["name"]][op["offset"] :]
            out = MLPerfFile(name=op["name"], offset=op["offset"], data=data).dump()
        else:
            out = released
        await msg.respond(codec.encode(out))

    async def samples(msg: Any) -> None:
        q = codec.decode(msg.data)
        n, t = len(q["samples"]), time.perf_counter_ns()
        fields = {
            "index": q["index"],
            "ok": True,
            "outputs": np.zeros((n, 1), np.int64),
            "t_received": t,
            "t_predict_start": t + 10,
            "t_predict_end": t + 20,
            "t_replied": t + 30,
        }
        if q["index"] == 0:
            fields.update({k: v(n) if callable(v) else v for k, v in first.items()})
        reply = QueryReply.model_construct(raw_outputs=None, labels=None, error=None, **fields)
        await bus.nc.publish(msg.reply, wire.encode_reply(reply))

    await bus.nc.subscribe(names.agent_ctl(agent_id), cb=ctl)
    await bus.nc.subscribe(names.agent_samples(agent_id), cb=samples)
    await bus.nc.flush()


def _mlperf_run(
    tmp_path: Path,
    first: dict[str, Any],
    *,
    prep: dict[str, Any] = GOOD_PREP,
    placement: str = "server",
    files: dict[str, bytes] | None = None,
    released: ReleaseReply | dict[str, Any] | list[Any] = RELEASED,
) -> tuple[_Host, BaseException | None]:
    """broker.mlperf.run (its real LoadGen child) against a fake agent."""
    zoo = built("digits_cnn").parent.parent
    entry = Catalog.load(default_manifest_dirs()).find("digits_cnn", framework="onnxruntime")
    got: list[tuple[_Host, BaseException | None]] = []

    async def main() -> None:
        with NatsServer(store_dir=tmp_path / "nats") as ns:
            settings = Settings(nats_url=ns.url, data_dir=tmp_path / "data")
            async with (
                busmod.connect(settings, name="fake agent") as agent_bus,
                busmod.connect(settings, name="server") as bus,
            ):
                # a ReleaseReply as an agent sends it, or any other answer as it is
                reply = released if isinstance(released, list | dict) else released.dump()
                await _served_agent(agent_bus, "agent-x", first, prep, files or {}, reply)
                await _answers_pings(bus, "agent-x")  # as the server sees it, before a run
                host = _Host(bus, zoo)
                job = JobRequest(
                    model="digits_cnn",
                    framework="onnxruntime",
                    trace_level="none",
                    placement=placement,  # type: ignore[arg-type]
                    mlperf=MLPerfSpec(scenario="Offline", target_qps=1000, user_conf=USER_CONF),
                )
                agent = SimpleNamespace(
                    agent_id="agent-x",
                    host="h",
                    frameworks=[SimpleNamespace(name="onnxruntime", version="1")],
                    dump=lambda: {"agent_id": "agent-x"},
                )
                err = None
                try:
                    await mlperf.run(host, job, agent, entry)  # type: ignore[arg-type]
                except BaseException as exc:  # what the test checks
                    err = exc
                got.append((host, err))

    anyio.run(main)
    return got[0]


def test_rankings_refuse_class_indices_past_int32() -> None:
    assert rankings(np.full((2, 1), MAX_CLASS, np.int64), 2) is not None
    assert rankings(np.full((2, 1), 2**40, np.int64), 2) is None
    assert rankings(np.full((2, 3), -(2**40), np.int64), 2) is None


@pytest.mark.integration  # builds the zoo and runs LoadGen
def test_an_out_of_range_class_index_fails_its_samples_not_the_run(tmp_path: Path) -> None:
    host, err = _mlperf_run(tmp_path, {"outputs": lambda n: np.full((n, 1), 2**40, np.int64)})
    assert err is None, err
    summary = host.stored[0][0]
    assert not summary.valid and summary.errors > 0
    assert any("samples failed in the agent" in r for r in summary.invalid_reasons)


@pytest.mark.integration  # builds the zoo and runs LoadGen
def test_an_agent_span_past_the_round_trip_fails_its_samples_not_the_run(
    tmp_path: Path,
) -> None:
    """An answer whose agent times are in order but span longer than the SUT saw the
    chunk away (received at the agent clock's zero: its whole uptime) fails its samples
    with the reason; its times are not kept."""
    host, err = _mlperf_run(tmp_path, {"t_received": 0})
    assert err is None, err
    summary, rec = host.stored[0][0], host.stored[0][1]
    assert not summary.valid and summary.errors > 0
    assert wire.AGENT_SPAN_TOO_LONG in rec.errors.values()
    assert all(e == wire.AGENT_SPAN_TOO_LONG for e in rec.errors.values())


@pytest.mark.integration  # builds the zoo and runs LoadGen
def test_span_batches_refused_are_a_warning_of_an_mlperf_run(tmp_path: Path) -> None:
    """An MLPerf run's summary says what the agent's release says of span batches the
    traces stream refused, as every other run's does (the same warning)."""
    host, err = _mlperf_run(tmp_path, {}, released=ReleaseReply(span_batches_refused=3))
    assert err is None, err
    summary = host.stored[0][0]
    assert budget_warnings({"span_batches_refused": 3})[0] in summary.warnings


@pytest.mark.integration  # builds the zoo and runs LoadGen
@pytest.mark.parametrize(
    "released",
    [
        {"kind": "released", "rss_peak_bytes": "lots", "rss_start_bytes": 1, "rss_end_bytes": 2},
        {"kind": "released", "rss_start_bytes": [1], "rss_end_bytes": 2},
        {"kind": "released", "energy_j": "warm", "span_batches_refused": "many"},
        {"kind": "released", "energy_j": -1e308, "rss_peak_bytes": -(2**63)},
        {"kind": "released", "span_batches_refused": -3},
        {"kind": "released", "host_other_cpu_s": float("nan"), "host_window_s": -1.0},
        [1, 2, 3],
        # an error reply: raised by the request, it replaced the finished test's outcome
        {"kind": "error", "error": {"code": "bus", "message": "agent going down"}},
    ],
)
def test_a_release_reply_that_is_no_release_reply_tells_nothing(
    tmp_path: Path, released: Any
) -> None:
    """The agent answers the release at the end of a finished test with wrong types,
    negative sizes or no mapping at all: the evaluation is stored as run, its memory
    and energy figures unknown (as from an agent that did not answer), not failed
    after its test nor stored with them as figures."""
    host, err = _mlperf_run(tmp_path, {}, released=released)
    assert err is None, repr(err)
    summary = host.stored[0][0]
    figures = ("peak_rss_mb", "rss_growth_mb", "energy_j", "energy_per_inference_j")
    assert [getattr(summary, k) for k in figures] == [None] * 4
    assert summary.host_other_cores is None and summary.host_steal_cores is None
    assert not any("span batches refused" in w for w in summary.warnings)


@pytest.mark.integration  # builds the zoo and runs LoadGen
def test_a_prepare_reply_without_load_times_is_refused_before_the_test(tmp_path: Path) -> None:
    host, err = _mlperf_run(tmp_path, {}, prep={"kind": "prepared", "cold": "no", "t_agent": 0})
    assert isinstance(err, MLScopeError), err
    assert "PrepareReply" in err.message and not host.stored


@pytest.mark.integration  # builds the zoo and runs LoadGen
def test_an_agents_run_without_its_summary_log_is_a_typed_error(tmp_path: Path) -> None:
    files = {TIMING: _timing_bytes(), logs.DETAIL: b":::MLLOG {}\n"}
    host, err = _mlperf_run(tmp_path, {}, placement="agent", files=files)
    assert isinstance(err, EvaluationError) and logs.SUMMARY in err.message, err
    assert not host.stored


@pytest.mark.integration  # builds the zoo and runs LoadGen
def test_an_agents_run_started_at_a_time_no_clock_showed_fails_naming_it(tmp_path: Path) -> None:
    """An agent's MLPerf run's logs are LoadGen's own, but its SUT says LoadGen issued
    its query at 2**62 ns of the agent's clock: the test's start on the server's clock
    would be 146 years away (stored as the run's t0, and past Int64 with an offset), so
    the run fails naming the agent instead of storing it."""
    work = tmp_path / "logs"
    work.mkdir()
    subprocess.run(  # LoadGen's own logs of a null SUT's Offline test
        [sys.executable, "-c", CHILD, "Offline", USER_CONF, str(work)],
        capture_output=True,
        timeout=120,
        check=True,
    )
    files = {name: (work / name).read_bytes() for name in logs.LOG_FILES}
    timing = io.BytesIO()
    save_timing(timing, [2**62], {}, 0)
    files[TIMING] = timing.getvalue()
    host, err = _mlperf_run(tmp_path, {}, placement="agent", files=files)
    assert isinstance(err, WireError), err
    assert "agent agent-x started its LoadGen test" in err.message and not host.stored


class _Summary(SimpleNamespace):
    """What ``_described`` uses of an EvaluationSummary."""

    def model_copy(self, *, update: dict[str, Any]) -> _Summary:
        return _Summary(**{**vars(self), **update})


def test_failed_samples_make_the_run_invalid_and_are_counted_once() -> None:
    """The summary's errors are the rows' (failed samples among them, counted there);
    LoadGen's own runtime errors stay in ``mlperf.num_errors``, not added to them."""
    summary = _Summary(errors=2, invalid_reasons=("LoadGen: 3 errors",))
    rec = SimpleNamespace(errors={0: "no response", 1: "no response"})
    job = SimpleNamespace(framework="onnxruntime", placement="server")
    agent = SimpleNamespace(
        agent_id="a", host="h", frameworks=[SimpleNamespace(name="onnxruntime", version="1")]
    )
    entry = SimpleNamespace(manifest=SimpleNamespace(name="m", version="1"))
    prep = PrepareReply.model_validate(GOOD_PREP)
    out = mlperf._described(summary, rec, 2, job, agent, entry, (0, 0), prep)  # type: ignore[arg-type]
    assert out.errors == 2 and not out.valid
    assert out.invalid_reasons[-1].startswith("2 samples failed")


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("scenario", "qps", "conf"),
    [
        ("Offline", 1e6, ""),
        ("Server", 1e6, ""),
        ("SingleStream", None, "*.SingleStream.target_latency = 0\n"),
        ("Offline", None, "*.Offline.min_query_count = 100000000000\n"),
        ("Server", 10, "*.Server.performance_sample_count_override = 100000000000\n"),
    ],
)
def test_settings_no_host_could_run_are_refused_before_loadgen_starts(
    tmp_path: Path, scenario: str, qps: float | None, conf: str
) -> None:
    lg = load_loadgen()
    spec = MLPerfSpec(scenario=scenario, target_qps=qps, user_conf=conf or None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="would generate"):
        loadgen_settings(lg, spec, "digits_cnn", tmp_path, samples=64)


CHILD = r"""
import json, sys
from pathlib import Path
import numpy as np
from mlscope.contracts import MLPerfSpec
from mlscope.mlperf import generated_samples, load_loadgen, start_test, test_settings
lg = load_loadgen()
work = Path(sys.argv[3])
spec = MLPerfSpec(scenario=sys.argv[1], user_conf=sys.argv[2], target_qps=2000)
ts = test_settings(lg, spec, "m", work, samples=64)
buf = np.zeros(1, np.int64)
def issue(samples):
    lg.QuerySamplesComplete([lg.QuerySampleResponse(s.id, buf.ctypes.data, 8) for s in samples])
start_test(lg, issue=issue, samples=64, load=lambda i: None, unload=lambda i: None,
           settings=ts, logdir=str(work), workdir=work)
kv = {}
for line in (work / "mlperf_log_detail.txt").read_text().splitlines():
    if line.startswith(":::MLLOG "):
        rec = json.loads(line[9:])
        kv[rec["key"]] = rec["value"]
made = kv["generated_query_count"] * kv["generated_samples_per_query"]
print(json.dumps({"estimate": generated_samples(lg, ts, 64) - 64, "generated": made}))
"""


@pytest.mark.parametrize(
    ("scenario", "conf"),
    [
        ("Offline", "*.Offline.min_duration = 300\n*.Offline.min_query_count = 1\n"),
        ("Server", "*.Server.min_duration = 300\n*.Server.min_query_count = 1\n"),
        (
            "SingleStream",
            "*.SingleStream.min_duration = 200\n*.SingleStream.target_latency = 1\n"
            "*.SingleStream.min_query_count = 1\n",
        ),
        (
            "MultiStream",
            "*.MultiStream.min_duration = 200\n*.MultiStream.target_latency = 2\n"
            "*.MultiStream.samples_per_query = 4\n*.MultiStream.min_query_count = 1\n",
        ),
    ],
)
def test_the_estimate_is_what_loadgen_generates(tmp_path: Path, scenario: str, conf: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, scenario, conf, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["estimate"] == pytest.approx(got["generated"], rel=0.2), got


# --------------------------------------------------------------------------- import


LINE = (
    '{"name":"Sample","ph":"b","ts":1.0,"args":{"sample_seq":0,"query_seq":%d,'
    '"sample_idx":0,"issue_start_ns":1,"complete_ns":2}},'
)


@pytest.mark.parametrize("query_seq", [2**40, 2**62])
def test_a_huge_query_seq_in_an_imported_trace_is_one_sample(query_seq: int) -> None:
    trace = logs.trace_samples(LINE % query_seq)
    rec = mlperf_record.sample_record(trace, None, 0, None)
    assert (rec.n, rec.batch_size) == (1, 1)


# --------------------------------------------------------------------------- conf files


@pytest.mark.parametrize("kind", ["fifo", "device", "huge", "latin1"])
def test_a_conf_file_that_is_no_small_utf8_file_is_one_line(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A FIFO waited forever, /dev/zero filled memory, a Latin-1 byte was a traceback."""
    import os

    from cli.main import main

    conf = tmp_path / "user.conf"
    if kind == "fifo":
        os.mkfifo(conf)
    elif kind == "huge":
        conf.write_bytes(b"# " + b"x" * (2 << 20) + b"\n")
    elif kind == "latin1":
        conf.write_bytes(b"*.Offline.min_duration = 1\n# caf\xe9\n")
    path = "/dev/zero" if kind == "device" else str(conf)
    monkeypatch.setenv("MLSCOPE_NATS_URL", "nats://127.0.0.1:1")
    flags = ["--framework", "onnxruntime", "--scenario", "Offline", "--output", str(tmp_path / "o")]
    assert main(["mlperf", "m", *flags, "--user-conf", path]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    if kind == "latin1":
        assert "byte 0xe9 on line 2, column 6 is not UTF-8" in err, err
