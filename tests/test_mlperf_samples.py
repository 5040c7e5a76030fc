"""The samples an agent holds (MLPerf LoadGen's sample library, a local run's data set),
and what an agent refuses.

The library alone (a real digits_cnn pipeline, compiled from its manifest), then a real
stack (nats-server, server, onnxruntime agent) sent every hostile sample request: each
gets a typed error reply and the agent goes on serving.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import numpy as np
import pytest

from agent.samplelib import CHUNK, MemoryBudget, SampleLibrary, preprocess_all
from agent.worker import compile_model
from cli.stack import Stack
from mlscope import bus as busmod
from mlscope import codec, names, samples
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.contracts import MAX_SAMPLE_INDICES, MLPerfRunOp, MLPerfSpec, new_id
from mlscope.errors import ConfigError, EvaluationError, MLScopeError, error_from_wire
from mlscope.registry import list_agents
from mlscope.settings import Settings
from tests.conftest import agent_and_server, child_env, running_stack

pytestmark = pytest.mark.timeout(300)
MLSCOPE = Path(sys.executable).parent / "mlscope"


def digits(zoo_dir: Path) -> tuple[Any, np.ndarray]:
    """digits_cnn's compiled pipeline (as the executor sees a model) and its data set."""
    entry = Catalog.load(default_manifest_dirs()).find("digits_cnn", framework="onnxruntime")
    pre, post = compile_model(entry)
    model = SimpleNamespace(name="digits_cnn", pre=pre, post=post, batch_axes=(0,))
    data = samples.dataset(entry, zoo_dir)
    assert data is not None
    return model, data[0]


def test_library_holds_preprocessed_samples_and_refuses_misuse(zoo_dir: Path) -> None:
    model, x = digits(zoo_dir)
    budget = MemoryBudget(limit=1 << 30)
    lib = SampleLibrary("ev-1", x, model, budget)
    assert lib.preprocessed
    lib.load([3, 1, 3])
    assert sorted(lib.held) == [1, 3] and budget.used == lib.bytes > 0
    got = lib.take(np.array([3, 1]))
    np.testing.assert_array_equal(got, model.pre[0](x[[3, 1]]))  # pre-processed once
    lib.unload([1, 99])  # one not held: ignored
    with pytest.raises(EvaluationError, match="sample 1 is not loaded"):
        lib.take(np.array([1]))
    for bad in ([len(x)], [-1], [0, 10**12]):
        with pytest.raises(ConfigError, match="outside the data set"):
            lib.load(bad)
    with pytest.raises(ConfigError):
        lib.take(np.array([0.5]))
    with pytest.raises(ConfigError):
        lib.take(np.array([], np.int64))
    lib.clear()
    assert not lib.held and budget.used == 0


def test_a_load_over_the_memory_limit_is_refused_and_leaves_the_library(zoo_dir: Path) -> None:
    model, x = digits(zoo_dir)
    per_sample = model.pre[0](x[:1]).nbytes
    budget = MemoryBudget(limit=per_sample * (CHUNK + 10))
    lib = SampleLibrary("ev-2", x, model, budget)
    lib.load(range(5))
    with pytest.raises(ConfigError, match="over this agent's limit") as info:
        lib.load(range(len(x)))  # the second chunk passes the limit
    assert info.value.fields["limit_bytes"] == budget.limit
    assert sorted(lib.held) == list(range(5)) and budget.used == 5 * per_sample
    other = SampleLibrary("ev-3", x, model, budget)  # one budget for every library
    with pytest.raises(ConfigError):
        other.load(range(CHUNK + 6))
    lib.clear()
    other.load(range(CHUNK))
    assert budget.used == CHUNK * per_sample


def test_raw_samples_when_the_pipeline_cannot_batch(zoo_dir: Path) -> None:
    model, x = digits(zoo_dir)
    model.batch_axes = (1,)  # batch not on axis 0: held raw, pre-processed per query
    lib = SampleLibrary("ev-4", x, model, MemoryBudget(limit=1 << 30))
    lib.load([0, 1])
    assert not lib.preprocessed
    np.testing.assert_array_equal(lib.take(np.array([1, 0])), x[[1, 0]])


def test_a_local_run_holds_its_whole_data_set_pre_processed_on_the_budget(
    zoo_dir: Path,
) -> None:
    model, x = digits(zoo_dir)
    per_sample = model.pre[0](x[:1]).nbytes
    budget = MemoryBudget(limit=per_sample * len(x))
    held = preprocess_all("ev-5", x, model, budget)
    assert held is not None and held.shape[0] == len(x) and budget.used == held.nbytes
    np.testing.assert_array_equal(held, model.pre[0](x))  # every chunk, in order
    with pytest.raises(ConfigError, match="over this agent's limit"):
        preprocess_all("ev-6", x, model, budget)  # the first one's bytes are still held
    assert budget.used == held.nbytes  # the refused one took nothing
    budget.release(held.nbytes)
    model.batch_axes = (1,)  # cannot be held pre-processed: the caller runs timed
    assert preprocess_all("ev-7", x, model, budget) is None and budget.used == 0


def test_held_samples_follow_the_servers_sample_order(zoo_dir: Path) -> None:
    """The agent feeds its pre-processed rows in the order the server scores: query i's
    inputs are the pre-processing of the raw rows the server's feeders give it."""
    model, x = digits(zoo_dir)
    held = preprocess_all("ev-8", x, model, MemoryBudget(limit=1 << 30))
    assert held is not None
    raw, _ = samples.feeders((x, np.zeros(len(x))), x.shape[1:], 32, seed=7)
    fed, labels = samples.feed(held, None, 32, seed=7)
    assert labels is None
    for i in (0, 1, 11, 12, 40):  # 360 rows: query 11 spans the first cycle's end
        np.testing.assert_array_equal(fed(i), model.pre[0](raw(i)))


# ----------------------------------------------------------------- a real stack


@pytest.fixture(scope="module")
def ort(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("samples"), zoo_dir, ["onnxruntime"]) as s:
        yield s


async def ask(bus: busmod.Bus, subject: str, doc: Any) -> Any:
    msg = await bus.nc.request(subject, codec.encode(doc), timeout=30)
    return codec.decode(msg.data)


def assert_typed_error(reply: Any) -> MLScopeError:
    assert isinstance(reply, dict) and reply.get("kind") == "error", reply
    err = error_from_wire(reply["error"])
    assert err.code != "error", reply
    return err


def hostile_ops(ev: str, size: int) -> list[dict[str, Any]]:
    load = {"op": "load_samples", "evaluation_id": ev}
    return [
        {**load, "indices": ["1", "2"]},
        {**load, "indices": [0.5]},
        {**load, "indices": [True]},
        {**load, "indices": [[1, 2]]},
        {**load, "indices": {"a": 1}},
        {**load, "indices": 7},
        {**load, "indices": [-1]},
        {**load, "indices": [size]},
        {**load, "indices": [2**63 - 1]},
        {**load, "indices": [0] * (MAX_SAMPLE_INDICES + 1)},
        {**load, "indices": [1], "evaluation_id": "ev-never-prepared"},
        {**load, "indices": [1], "evaluation_id": {"x": 1}},
        {"op": "unload_samples", "evaluation_id": ev, "indices": [size + 5]},
        {"op": "unload_samples", "evaluation_id": "ev-never-prepared", "indices": [1]},
        {"op": "mlperf_fetch", "evaluation_id": ev, "name": "../../etc/passwd"},
        {"op": "mlperf_fetch", "evaluation_id": ev, "name": "mlperf_log_summary.txt"},
        {"op": "mlperf_fetch", "evaluation_id": ev, "name": "x", "offset": -1},
        {"op": "mlperf_fetch", "evaluation_id": ev, "name": "x", "max_bytes": 2**40},
    ]


def hostile_queries(ev: str) -> list[dict[str, Any]]:
    q = {"kind": "samples_query", "evaluation_id": ev, "index": 0}
    return [
        {**q, "samples": np.array([5], np.int64)},  # not loaded
        {**q, "samples": np.array([0.5])},
        {**q, "samples": np.zeros((2, 2), np.int64)},
        {**q, "samples": np.array([], np.int64)},
        {**q, "samples": [1, 2]},
        {**q, "samples": np.array([1]), "evaluation_id": "ev-never-prepared"},
        {"kind": "samples_query"},
    ]


async def _hostile(settings: Settings) -> None:
    async with busmod.connect(settings, name="test") as bus:
        agent = (await list_agents(bus))[0]
        offer = next(o for o in agent.models if o.name == "digits_cnn")
        ctl, query = names.agent_ctl(agent.agent_id), names.agent_samples(agent.agent_id)
        ev = new_id("ev")
        prepare = {"op": "prepare", "evaluation_id": ev, "model": "digits_cnn"}
        await ask(bus, ctl, {**prepare, "model_version": offer.version})
        for op in hostile_ops(ev, 360):
            assert_typed_error(await ask(bus, ctl, op))
        held = await ask(bus, ctl, {"op": "load_samples", "evaluation_id": ev, "indices": [0, 1]})
        assert held["held"] == 2 and held["preprocessed"]
        for q in hostile_queries(ev):
            assert_typed_error(await ask(bus, query, q))
        missing = {"kind": "samples_query", "evaluation_id": ev, "index": 42}
        err = assert_typed_error(await ask(bus, query, {**missing, "samples": np.array([5])}))
        assert err.fields["index"] == 42 and err.fields["sample"] == 5  # the SUT's key
        # The agent goes on: a good query is answered from the held samples.
        good = {
            "kind": "samples_query",
            "evaluation_id": ev,
            "index": 9,
            "samples": np.array([1, 0]),
        }
        reply = await ask(bus, query, good)
        assert reply["ok"] and reply["index"] == 9 and len(reply["outputs"]) == 2
        await ask(bus, ctl, {"op": "release", "evaluation_id": ev})
        # Released: the samples are gone with the evaluation.
        err = assert_typed_error(await ask(bus, query, good))
        assert ev in err.message
        assert (await ask(bus, ctl, {"op": "ping"}))["kind"] == "pong"


def test_hostile_sample_requests_get_typed_errors_and_the_agent_goes_on(ort: Stack) -> None:
    anyio.run(_hostile, ort.settings, backend="asyncio")


def test_an_agent_without_loadgen_placement_is_refused_by_name(
    settings: Settings, tmp_path: Path
) -> None:
    with agent_and_server(settings, "--framework", "onnxruntime", "--no-local-runs"):
        out = subprocess.run(
            [
                str(MLSCOPE),
                "mlperf",
                "digits_cnn",
                "--framework",
                "onnxruntime",
                "--scenario",
                "Offline",
                "--placement",
                "agent",
                "--output",
                str(tmp_path / "out"),
            ],
            env=child_env(settings),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 1, out.stderr
        assert "'mlperf-loadgen' feature" in out.stderr and "--placement server" in out.stderr
        anyio.run(_refused_by_the_agent, settings, backend="asyncio")


async def _refused_by_the_agent(settings: Settings) -> None:
    """The agent itself refuses a LoadGen run it was sent anyway, by the feature's name."""
    async with busmod.connect(settings, name="test") as bus:
        agent = (await list_agents(bus))[0]
        op = {
            "op": "mlperf",
            "evaluation_id": "ev-x",
            "spec": {"scenario": "Offline"},
            "conf_model": "digits_cnn",
        }
        err = assert_typed_error(await ask(bus, names.agent_ctl(agent.agent_id), op))
        assert isinstance(err, ConfigError) and "'mlperf-loadgen'" in err.message


async def _released_mid_run(settings: Settings) -> None:
    async with busmod.connect(settings, name="test") as bus:
        agent = (await list_agents(bus))[0]
        offer = next(o for o in agent.models if o.name == "digits_cnn")
        ctl = names.agent_ctl(agent.agent_id)
        ev = new_id("ev")
        prepare = {"op": "prepare", "evaluation_id": ev, "model": "digits_cnn"}
        await ask(bus, ctl, {**prepare, "model_version": offer.version})
        sub = await bus.nc.subscribe(names.agent_rows(agent.agent_id, ev))
        run = MLPerfRunOp(
            evaluation_id=ev,
            spec=MLPerfSpec(
                scenario="Server",
                target_qps=50,
                user_conf="*.Server.min_duration = 600000\n*.Server.target_latency = 1000\n",
            ),
            conf_model="digits_cnn",
        )
        started = await ask(bus, ctl, run.dump())
        assert started["kind"] == "mlperf_started", started
        again = assert_typed_error(await ask(bus, ctl, run.dump()))  # one run at a time
        assert "already running" in again.message
        await anyio.sleep(2)  # LoadGen is under way (a 10-minute test)
        await ask(bus, ctl, {"op": "release", "evaluation_id": ev})
        done = codec.decode((await sub.next_msg(timeout=30)).data)
        assert done["kind"] == "mlperf_done" and done["error"] is not None, done
        with pytest.raises(ProcessLookupError):
            os.kill(int(started["pid"]), 0)  # LoadGen's process is gone
        assert (await ask(bus, ctl, {"op": "ping"}))["kind"] == "pong"


def test_release_ends_the_agents_loadgen_run(ort: Stack) -> None:
    anyio.run(_released_mid_run, ort.settings, backend="asyncio")
