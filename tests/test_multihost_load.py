"""Distributed load over load-generator services: two ``mlscope loadgen`` processes,
registered on the bus like agents, take one dealt schedule from the server and their
results merge into one evaluation (two noop agents, each driven once)."""

from __future__ import annotations

import concurrent.futures
import io
import subprocess
import threading
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

from broker.lgresults import load_result, save_result
from broker.lgservice import LoadgenService
from broker.lgwork import pack_slice, work_bucket
from mlscope import bus as busmod
from mlscope import codec, names, remote, schedule
from mlscope.api import cancel_job
from mlscope.contracts import (
    EvaluationSummary,
    JobEvent,
    JobRequest,
    LoadgenDescription,
    LoadgenLoadOp,
    LoadgenStartOp,
    LoadgenStopOp,
    ScenarioSpec,
)
from mlscope.errors import BusNotFound, ConfigError, EvaluationError, MLScopeError, WireError
from mlscope.jobs import submit
from mlscope.provision import provisioned
from mlscope.record import RunRecord
from mlscope.schedule import Schedule
from mlscope.settings import Settings
from tests.conftest import LOOSE, child_env, python, wait_agents, wait_loadgens, wait_server

pytestmark = pytest.mark.timeout(240)

LOADGENS = ("lg-a", "lg-b")


@pytest.fixture
def services(settings: Settings) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """The server, two noop agents and two load-generator services, each a process."""
    env = child_env(settings)
    cmd = [python(), "-m", "cli.main"]
    procs = {"server": subprocess.Popen([*cmd, "server"], env=env)}
    try:
        anyio.run(wait_server, settings)
        for a in ("noop-a", "noop-b"):
            procs[a] = subprocess.Popen(
                [*cmd, "agent", "--framework", "noop", "--agent-id", a], env=env
            )
        for lg in LOADGENS:
            procs[lg] = subprocess.Popen([*cmd, "loadgen", "--id", lg], env=env)
        anyio.run(wait_agents, settings, 2)
        anyio.run(wait_loadgens, settings, 2)
        yield procs
    finally:
        for p in reversed(procs.values()):
            p.terminate()
        for p in procs.values():
            p.wait(20)


def rows(settings: Settings, evaluation_id: str) -> np.ndarray:
    async def go() -> list[list[object]]:
        async with busmod.connect(settings, name="test") as bus:
            return (
                await remote.sql(
                    bus,
                    "SELECT query_index, scheduled_ns, issued_ns, completed_ns, ok, "
                    "agent_received_ns FROM queries FINAL WHERE evaluation_id = {e:String} "
                    "ORDER BY query_index",
                    {"e": evaluation_id},
                )
            )[1]

    return np.asarray(anyio.run(go, backend="asyncio"), dtype=np.int64)


def run(
    settings: Settings, agent: str, hosts: tuple[str, ...], progress: list[int] | None = None
) -> EvaluationSummary:
    spec = ScenarioSpec(
        name="online", qps=300, duration_s=2.5, seed=5, loadgen_hosts=hosts, **LOOSE
    )
    job = JobRequest(
        model="noop", framework="noop", agent_id=agent, scenario=spec, trace_level="none"
    )

    def seen(event: JobEvent) -> None:
        if event.event == "progress" and progress is not None:
            progress.append(event.queries_done)

    return anyio.run(lambda: submit(settings, job, on_event=seen, timeout=120), backend="asyncio")


@pytest.mark.timeout(420)
def test_loadgen_services_share_one_schedule_and_merge_into_one_evaluation(
    settings: Settings, services: dict[str, subprocess.Popen[bytes]]
) -> None:
    listed = anyio.run(wait_loadgens, settings, 2)
    assert [d.loadgen_id for d in listed] == list(LOADGENS)
    assert all(isinstance(d, LoadgenDescription) for d in listed)
    whole = schedule.poisson(300, duration_s=2.5, seed=5)  # enough for early stopping
    for agent in ("noop-a", "noop-b"):
        progress: list[int] = []
        s = run(settings, agent, LOADGENS, progress)
        assert s.agent_id == agent
        assert s.valid and s.errors == 0, s.invalid_reasons
        assert s.loadgens == 2 and s.queries == len(whole)
        assert s.scenario["loadgen_hosts"] == list(LOADGENS)
        # Each slice ran in its own service process ...
        assert s.loadgen_cost is not None
        ran = s.loadgen_cost["services"]
        assert [r["loadgen_id"] for r in ran] == list(LOADGENS)
        assert [r["pid"] for r in ran] == [services[lg].pid for lg in LOADGENS]
        assert [r["queries"] for r in ran] == [len(p) for p in schedule.deal(whole, 2)]
        assert all(r["completed"] == r["queries"] > 0 for r in ran)
        # The services' counts, summed into the job's progress while they run.
        assert progress == sorted(progress) and 0 < max(progress) <= len(whole), progress
        assert any(0 < p < len(whole) for p in progress), progress
        # ... and the stored rows are the one global schedule, every query answered.
        got = rows(settings, s.evaluation_id)
        assert got.shape[0] == len(whole)
        np.testing.assert_array_equal(got[:, 0], np.arange(len(whole)))
        np.testing.assert_array_equal(got[:, 1], whole.offsets_ns)
        assert (got[:, 2] >= got[:, 1]).all() and (got[:, 3] > got[:, 2]).all()
        assert got[:, 4].all()
        # The agent's times, converted through each service's clock, fall between
        # issue and completion on the merged clock (to within the offsets' error).
        slack = 5_000_000
        assert (got[:, 5] >= got[:, 2] - slack).all() and (got[:, 5] <= got[:, 3] + slack).all()
    # A job naming a load generator that is not there fails and names the live ones.
    with pytest.raises(MLScopeError, match=r"no live load generator lg-z.*lg-a, lg-b"):
        run(settings, "noop-a", ("lg-a", "lg-z"))
    # A cancelled job stops its slices: the services take the next job at once (each
    # runs one slice at a time, and the cancelled one had ten minutes to go).
    long = ScenarioSpec(name="online", qps=50, duration_s=600, seed=5, loadgen_hosts=LOADGENS)
    job = JobRequest(model="noop", framework="noop", agent_id="noop-a", scenario=long)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = threading.Event()

        def seen(event: JobEvent) -> None:
            if event.event == "progress" and event.queries_done > 0:
                started.set()

        waiting = pool.submit(
            lambda: anyio.run(
                lambda: submit(settings, job, on_event=seen, timeout=900), backend="asyncio"
            )
        )
        assert started.wait(120)
        reply = anyio.run(lambda: cancel_job(settings, job.job_id, timeout=30), backend="asyncio")
        assert reply is not None
        cancelled = waiting.result(timeout=60)
        assert cancelled.status == "cancelled"
    # Its rows are what the services had issued when stopped: both slices, no gap.
    got = rows(settings, cancelled.evaluation_id)
    assert cancelled.queries > 0 and len(got) == cancelled.queries, cancelled
    assert got[:, 0].tolist() == list(range(cancelled.queries))
    sent = cancelled.queries - cancelled.not_issued
    answered = sent - cancelled.lost
    assert answered > 0, cancelled
    assert f"{answered} of {sent} issued queries answered" in cancelled.invalid_reasons[0]
    # ... and the CPU time each service's load used up to its stop.
    cost = cancelled.loadgen_cost
    assert cost is not None and cost["loadgens"] == 2, cost
    assert [r["loadgen_id"] for r in cost["services"]] == list(LOADGENS), cost
    assert all(r["cpu_s"] > 0 for r in cost["services"]), cost
    assert cost["cpu_s"] == pytest.approx(sum(r["cpu_s"] for r in cost["services"]))
    s = run(settings, "noop-b", LOADGENS)
    assert s.status == "completed" and s.errors == 0


def test_a_service_killed_mid_slice_ends_the_run_in_seconds_naming_it(
    settings: Settings, services: dict[str, subprocess.Popen[bytes]]
) -> None:
    """A killed service's slice request would be waited on until its timeout (duration
    x 3 + 2 min): its registry entry expiring ends the run, with an error naming it."""
    spec = ScenarioSpec(name="online", qps=100, duration_s=20, seed=5, loadgen_hosts=LOADGENS)
    job = JobRequest(
        model="noop", framework="noop", agent_id="noop-a", scenario=spec, trace_level="none"
    )
    killed: list[float] = []

    def seen(event: JobEvent) -> None:
        if event.event == "progress" and event.queries_done >= 50 and not killed:
            services["lg-a"].kill()
            killed.append(time.monotonic())

    with pytest.raises(EvaluationError, match="load-generator service lg-a was lost"):
        anyio.run(lambda: submit(settings, job, on_event=seen, timeout=120), backend="asyncio")
    # Its slice was not waited out (its request timeout: 20 s x 3 + 2 min), on any load.
    assert killed and time.monotonic() - killed[0] < 90


def test_loadgen_hosts_are_distinct_and_set_the_count() -> None:
    spec = ScenarioSpec(name="online", qps=10, loadgen_hosts=("lg-a", "lg-b"))
    assert spec.loadgens == 2
    with pytest.raises(ValueError, match="twice"):
        ScenarioSpec(name="online", qps=10, loadgen_hosts=("lg-a", "lg-a"))
    with pytest.raises(ValueError, match="loadgen_hosts"):
        ScenarioSpec(name="online", qps=10, loadgens=3, loadgen_hosts=("lg-a", "lg-b"))


def _stop(run_id: str) -> bytes:
    return codec.encode_model(LoadgenStopOp(run_id=run_id))


def _load_op(run_id: str, slice_object: str, spec: ScenarioSpec) -> bytes:
    """A load of ``slice_object`` whose queries go to an agent nobody serves."""
    op = LoadgenLoadOp(
        run_id=run_id,
        evaluation_id=f"ev-{run_id}",
        subject=names.agent_query("nobody"),
        spec=spec,
        offset_ns=0,
        trace_level=0,
        has_labels=False,
        slice_object=slice_object,
    )
    return codec.encode_model(op)


def test_a_service_refuses_slices_and_starts_no_run_could_have(settings: Settings) -> None:
    """Anyone who may write the work bucket or send a start: a slice whose last query is
    years away, or a start far in the future, would hold the service (it runs one start
    at a time); each is refused with its typed error, and the service goes on."""
    spec = ScenarioSpec(name="online", qps=10, duration_s=1)
    service = LoadgenService(settings, loadgen_id="lg-bounds")

    async def main() -> None:
        async with (
            provisioned(settings, name="test") as bus,
            anyio.create_task_group() as tg,
        ):
            await tg.start(service.run)
            ctl, start = names.loadgen_ctl("lg-bounds"), names.loadgen_run("lg-bounds")
            obs = await work_bucket(bus)
            far = Schedule(np.array([0, 10**17], np.int64))
            await obs.put("far", pack_slice(far, [b"q", b"q"], None))
            with pytest.raises(ConfigError, match="over what one run may have"):
                await busmod.request(bus, ctl, _load_op("lr-far", "far", spec), timeout=30)
            near = Schedule(np.array([0, 1000], np.int64))
            await obs.put("near", pack_slice(near, [b"q", b"q"], None))
            await busmod.request(bus, ctl, _load_op("lr-near", "near", spec), timeout=30)
            op = LoadgenStartOp(
                run_id="lr-near", start_ns=time.perf_counter_ns() + 10**17, result_object="r"
            )
            with anyio.fail_after(20), pytest.raises(EvaluationError, match="would start"):
                await busmod.request(bus, start, codec.encode_model(op), timeout=15)
            ping = await busmod.request(bus, ctl, codec.encode({"op": "ping"}), timeout=10)
            assert ping["kind"] == "pong"
            tg.cancel_scope.cancel()

    anyio.run(main, backend="asyncio")


def test_a_load_or_start_whose_numbers_no_run_has_is_refused_at_once(settings: Settings) -> None:
    """A load whose trace level no query carries, or whose clock offset is past any two
    hosts' (every answer's time would overflow its Int64 row); a start minutes past
    (every query issued at once, each that late) or before any clock: each is refused
    with its typed error where it arrives, never loaded to fail at its run, and the
    service goes on."""
    spec = ScenarioSpec(name="online", qps=10, duration_s=1)
    service = LoadgenService(settings, loadgen_id="lg-numbers")

    async def main() -> None:
        async with (
            provisioned(settings, name="test") as bus,
            anyio.create_task_group() as tg,
        ):
            await tg.start(service.run)
            ctl, start = names.loadgen_ctl("lg-numbers"), names.loadgen_run("lg-numbers")
            obs = await work_bucket(bus)
            await obs.put(
                "near", pack_slice(Schedule(np.array([0, 1000], np.int64)), [b"q"] * 2, None)
            )
            load = codec.decode(_load_op("lr-near", "near", spec))
            for bad in ({"trace_level": 99}, {"offset_ns": 2**64 - 1}, {"offset_ns": -(2**63)}):
                with pytest.raises(WireError, match=f"{next(iter(bad))}.*than"):
                    await busmod.request(bus, ctl, codec.encode({**load, **bad}), timeout=30)
            refusals = {time.perf_counter_ns() - 120 * 10**9: "would start", -(2**63): "start_ns"}
            for start_ns, why in refusals.items():
                await busmod.request(bus, ctl, codec.encode(load), timeout=30)
                op = {"op": "start", "run_id": "lr-near", "start_ns": start_ns}
                with anyio.fail_after(20), pytest.raises((EvaluationError, WireError), match=why):
                    await busmod.request(
                        bus, start, codec.encode({**op, "result_object": "r"}), timeout=15
                    )
            ping = await busmod.request(bus, ctl, codec.encode({"op": "ping"}), timeout=10)
            assert ping["kind"] == "pong"
            tg.cancel_scope.cancel()

    anyio.run(main, backend="asyncio")


def test_a_malformed_slice_is_refused_as_such_and_the_service_goes_on(settings: Settings) -> None:
    """A slice not shaped as the server packs it (or not there at all) is refused at
    ``load`` with what is wrong with it (a WireError, BusNotFound), not as a failure of
    the service (a TypeError from deep inside), nor loaded to fail at its start."""
    spec = ScenarioSpec(name="online", qps=10, duration_s=1)
    service = LoadgenService(settings, loadgen_id="lg-slices")
    good: dict[str, Any] = {
        "offsets": np.array([0, 1000], np.int64),
        "index": np.array([0, 1], np.int64),
        "samples_per_query": 1,
        "payloads": [b"q", b"q"],
        "labels": None,
    }
    bad: dict[str, tuple[Any, type[MLScopeError]]] = {
        "never-put": (None, BusNotFound),
        "a-list": ([1, 2, 3], WireError),
        "text-offsets": ({**good, "offsets": np.array(["a", "b"])}, WireError),
        "int-payloads": ({**good, "payloads": [1, 2]}, WireError),
        "short-labels": ({**good, "labels": np.zeros((1, 1), np.int64)}, WireError),
        "text-spq": ({**good, "samples_per_query": "1"}, WireError),
        "more-payloads": ({**good, "payloads": [b"q"] * 3}, ConfigError),
    }

    async def main() -> None:
        async with (
            provisioned(settings, name="test") as bus,
            anyio.create_task_group() as tg,
        ):
            await tg.start(service.run)
            ctl = names.loadgen_ctl("lg-slices")
            obs = await work_bucket(bus)
            for name, (doc, error) in bad.items():
                if doc is not None:
                    await obs.put(name, codec.encode(doc))
                with pytest.raises(error):
                    await busmod.request(bus, ctl, _load_op(f"lr-{name}", name, spec), timeout=30)
            await obs.put("good", codec.encode(good))
            loaded = await busmod.request(bus, ctl, _load_op("lr-good", "good", spec), timeout=30)
            assert loaded["queries"] == 2
            tg.cancel_scope.cancel()

    anyio.run(main, backend="asyncio")


def _result(queries: int, **arrays: np.ndarray) -> io.BytesIO:
    rec = RunRecord(n=queries, batch_size=1)
    rec.errors = {1: "x" * 5000}
    buf = io.BytesIO()
    save_result(rec, buf)
    if arrays:  # the same members, some replaced
        with np.load(io.BytesIO(buf.getvalue())) as z:
            members = {name: z[name] for name in z.files}
        buf = io.BytesIO()
        np.savez_compressed(buf, **{**members, **arrays})
    buf.seek(0)
    return buf


def test_a_slices_result_is_read_only_in_the_shape_its_slice_has() -> None:
    """A result comes from the work bucket: a small compressed object that claims
    gigabytes is refused from its headers, before anything is allocated."""
    rec, errors = load_result(_result(5), 5)
    assert rec.n == 5 and len(errors[1]) == codec.MAX_ERROR_CHARS  # cut when saved
    with pytest.raises(EvaluationError, match="slice of 4 queries"):
        load_result(_result(5), 4)
    bombs = [
        _result(5, **bomb)
        for bomb in (
            {"scheduled": np.zeros(25_000_000, np.int64)},  # 200 MB of zeros
            {"error_message": np.array(["y" * 100_000])},
            {"t0_ns": np.zeros((5000, 5000), np.int64)},
            {"ok": np.array(["text"] * 5)},
        )
    ]
    tracemalloc.start()
    try:
        for data in bombs:
            with pytest.raises(EvaluationError, match="result array"):
                load_result(data, 5)
        assert tracemalloc.get_traced_memory()[1] < 20_000_000
    finally:
        tracemalloc.stop()


def test_a_stopped_run_ends_at_once_and_the_service_goes_on(settings: Settings) -> None:
    """A server whose job was cancelled stops its services' slices: the running one
    ends now (its start is answered with why), not at the end of its schedule."""
    service = LoadgenService(settings, loadgen_id="lg-stop")
    spec = ScenarioSpec(name="online", qps=10, duration_s=600)
    long = Schedule(np.arange(0, 600 * 10**9, 10**8, dtype=np.int64))  # 10 min at 10/s

    async def main() -> None:
        async with (
            provisioned(settings, name="test") as bus,
            anyio.create_task_group() as tg,
        ):
            await tg.start(service.run)
            ctl = names.loadgen_ctl("lg-stop")
            obs = await work_bucket(bus)
            await obs.put("long", pack_slice(long, [b"q"] * len(long), None))
            await busmod.request(bus, ctl, _load_op("lr-long", "long", spec), timeout=30)
            start = LoadgenStartOp(
                run_id="lr-long", start_ns=time.perf_counter_ns(), result_object="r-long"
            )
            answer: list[BaseException] = []

            async def run() -> None:
                try:
                    await busmod.request(
                        bus, names.loadgen_run("lg-stop"), codec.encode_model(start), timeout=600
                    )
                except MLScopeError as exc:
                    answer.append(exc)

            async with anyio.create_task_group() as runs:
                runs.start_soon(run)
                await anyio.sleep(1.0)
                stop = _stop("lr-long")
                stopped = await busmod.request(bus, ctl, stop, timeout=10)
                assert stopped["running"] is True
                with anyio.fail_after(60):  # far less than the slice's 10 minutes
                    while not answer:
                        await anyio.sleep(0.1)
            assert isinstance(answer[0], EvaluationError) and "stopped" in str(answer[0])
            again = await busmod.request(bus, ctl, stop, timeout=10)
            assert again["running"] is False and again["run_ids"] == []
            # A restarted job's server stops every run of its evaluation, only those.
            for run_id in ("lr-a", "lr-b"):
                await busmod.request(bus, ctl, _load_op(run_id, "long", spec), timeout=30)
            by_eval = codec.encode_model(LoadgenStopOp(evaluation_id="ev-lr-a"))
            stopped = await busmod.request(bus, ctl, by_eval, timeout=10)
            assert stopped["run_ids"] == ["lr-a"] and stopped["running"] is False
            left = await busmod.request(bus, ctl, _stop("lr-b"), timeout=10)
            assert left["run_ids"] == ["lr-b"]
            for neither_or_both in ({}, {"run_id": "lr-a", "evaluation_id": "ev-lr-a"}):
                with pytest.raises(WireError, match="either a run_id or an evaluation_id"):
                    await busmod.request(
                        bus, ctl, codec.encode({"op": "stop", **neither_or_both}), timeout=10
                    )
            tg.cancel_scope.cancel()

    anyio.run(main, backend="asyncio")
