"""Shared fixtures: a real nats-server per test, the zoo built once per session, and
a real stack (nats-server + server + agents as processes) per module."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import time
import types
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from cli.stack import Stack
from mlscope.contracts import AgentDescription, FrameworkInfo, LoadgenDescription
from mlscope.natsserver import NatsServer
from mlscope.registry import list_agents
from mlscope.settings import Settings

pytest_plugins = [
    "tests.analysis_fixtures",
    "tests.loadgen_fixtures",
    "tests.pipeline_fixtures",
]
"""Fixture modules shared across test modules, registered here so tests name a fixture
as a parameter and never import it: analysis, report and dashboard runs (one stack per
test session), a noop-agent stack per module, and digits_cnn with its held-out samples
(``model``, ``samples``)."""

REPO = Path(__file__).resolve().parent.parent

LOOSE: dict[str, Any] = {"min_duration_s": 0.0, "min_queries": 1, "max_issue_lag_us": 1e6}
"""Validity rules a short run on a shared machine can meet, for the scenario of a test
that is not about speed: the defaults' 500 µs p99 issue lag is missed on a 2-core
machine that runs the suite's other stacks beside the test's."""
LOOSE_FLAGS = ("--min-duration", "0", "--min-queries", "1", "--max-issue-lag-us", "1000000")
""":data:`LOOSE` as ``mlscope-submit`` flags."""

PROCESS_FIXTURES = frozenset(
    {
        "nats_server",
        "settings",
        "stack",
        "zoo_dir",
        "analysis_runs",
        "span_db",
        "noop_stack",
        "cluster",
        "farm",
        "four",
        "secured",
        "server",
        "tstack",
        "dashboard_url",
        "effnet_zoo",
        "other_zoo",
        "fresh_agent",
        "db",
        "fresh_db",
        "model",
        "models",
        "predictor",
    }
)
"""Fixtures that start processes, build the zoo, open a database or load a runtime."""
PROCESS_MODULES = frozenset(
    {
        "tests.test_zoo",
        "tests.test_predictors",
        "tests.test_live_models",
        "tests.test_compose",
        "tests.test_operators",
        "tests.test_edge",
        "tests.test_cluster",
        "tests.test_auth",
        "tests.test_divergence",
        "tests.test_tracing",
    }
)
"""Modules whose tests start processes or runtimes without one of those fixtures."""


STARTERS = frozenset(
    {"NatsServer", "Stack", "subprocess", "chdb", "Database", "built"}
    | {"onnxruntime", "torch", "tensorflow"}
)
"""Names that, when a test, one of its fixtures or a helper of the tests' own they call
refers to them, mean it starts a process or a server, opens chDB, loads a runtime or
builds the zoo: found in the code itself, so a new test that starts one is never
counted ``unit``."""


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _starts_things(func: Any, seen: set[int]) -> bool:
    """Whether ``func``, or a function from the tests it names, refers to a starter."""
    func = inspect.unwrap(func)
    code = getattr(func, "__code__", None)
    if code is None or id(code) in seen:
        return False
    seen.add(id(code))
    names = set(_code_names(code))
    if names & STARTERS:
        return True
    scope = getattr(func, "__globals__", {})
    return any(
        _starts_things(scope[name], seen)
        for name in names
        if name in scope
        and callable(scope[name])
        and str(getattr(scope[name], "__module__", "")).startswith("tests.")
    )


def _fixture_funcs(item: pytest.Item) -> Iterator[Any]:
    info = getattr(item, "_fixtureinfo", None)
    for defs in getattr(info, "name2fixturedefs", {}).values():
        for fixturedef in defs:
            yield fixturedef.func


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test is ``unit`` (pure, under a minute for all of them: ``make test-fast``) or
    ``integration`` (real processes, the zoo, runtimes, and whatever is marked ``slow``:
    a fresh virtualenv's install is no unit test); ``make test`` runs both."""
    for item in items:
        seen: set[int] = set()
        costly = (
            PROCESS_FIXTURES & set(getattr(item, "fixturenames", ()))
            or item.get_closest_marker("gpu")
            or item.get_closest_marker("slow")
            or item.get_closest_marker("integration")  # said so by the test itself
            or getattr(getattr(item, "module", None), "__name__", "") in PROCESS_MODULES
            or any(
                _starts_things(func, seen)
                for func in (getattr(item, "function", None), *_fixture_funcs(item))
            )
        )
        item.add_marker(pytest.mark.integration if costly else pytest.mark.unit)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from tests.zoo_fixtures import remove_session_zoo

    remove_session_zoo()


@pytest.fixture(scope="session")
def zoo_dir() -> Path:
    """The zoo models that agents in the tests serve, built once per session (or reused
    from MLSCOPE_TEST_ZOO); the same directory as ``tests.zoo_fixtures``, so a model a
    test builds later with ``built(name)`` lands beside them."""
    from tests.zoo_fixtures import built, zoo_dir

    for name in STACK_MODELS:
        built(name)
    return zoo_dir()


STACK_MODELS = ("digits_cnn", "efficientnet_lite0")
"""Built before any agent starts (agents advertise what is present when they start)."""


def make_data_dir(base: Path, zoo_dir: Path) -> Path:
    base.mkdir(parents=True, exist_ok=True)
    (base / "zoo").symlink_to(zoo_dir, target_is_directory=True)
    return base


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    with NatsServer(store_dir=tmp_path / "nats") as server:
        yield server


@pytest.fixture
def settings(tmp_path: Path, nats_server: NatsServer, zoo_dir: Path) -> Settings:
    return Settings(nats_url=nats_server.url, data_dir=make_data_dir(tmp_path / "data", zoo_dir))


def child_env(settings: Settings) -> dict[str, str]:
    env = {**os.environ, **settings.as_env()}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


async def wait_agents(
    settings: Settings, count: int, timeout: float = 60.0
) -> list[AgentDescription]:
    from mlscope import bus as busmod

    deadline = time.monotonic() + timeout
    async with busmod.connect(settings, name="test") as bus:
        while time.monotonic() < deadline:
            try:
                agents = await list_agents(bus)
            except Exception:  # bucket not created yet
                agents = []
            if len(agents) >= count:
                return agents
            await anyio.sleep(0.2)
    raise TimeoutError(f"{count} agent(s) did not register within {timeout}s")


@asynccontextmanager
async def server_in_process(settings: Settings) -> AsyncIterator[None]:
    """An mlscope server in this process (its logs to this process's loggers), ready
    for the block and stopped after it."""
    from broker.server import Server  # the server's imports only where one runs here

    async with anyio.create_task_group() as tg:
        await tg.start(Server(settings).run)
        yield
        tg.cancel_scope.cancel()


@contextmanager
def running_stack(
    base: Path,
    zoo_dir: Path,
    frameworks: list[str],
    *,
    timeout: float = 60.0,
    settings: Settings | None = None,
) -> Iterator[Stack]:
    """``mlscope up`` as child processes under ``base`` (with ``settings``, their data
    dir ``base``): returns once every agent is registered and the server answers
    database requests."""
    make_data_dir(base, zoo_dir)
    os.environ.setdefault("PYTHONPATH", str(REPO))
    s = Stack((settings or Settings()).with_(data_dir=base), nats_port=0, frameworks=frameworks)
    s.start()
    try:
        anyio.run(wait_agents, s.settings, len(frameworks), timeout)
        anyio.run(wait_server, s.settings, timeout)
        yield s
    finally:
        s.stop()
        shutil.rmtree(base / "nats", ignore_errors=True)


@contextmanager
def noop_step_stack(base: Path, zoo_dir: Path, *, name: str, steps: str) -> Iterator[Stack]:
    """nats-server, server and a noop agent (custom code allowed) serving ``name``: the
    built-in noop model whose first input step is ``step(env, data)`` of the module
    ``steps`` (its source), written under ``base``."""
    import yaml

    module = f"{name}_steps"
    (base / "steps").mkdir()
    (base / "steps" / f"{module}.py").write_text(steps)
    builtin = REPO / "manifests" / "models" / "builtin"
    doc = yaml.safe_load((builtin / "noop.yaml").read_text())
    doc["name"] = name
    doc["inputs"][0]["steps"] = [{"python": {"module": module, "function": "step"}}]
    (base / "manifests").mkdir()
    (base / "manifests" / f"{name}.yaml").write_text(yaml.safe_dump(doc))
    shutil.copytree(builtin / "noop", base / "manifests" / "noop")
    make_data_dir(base / "data", zoo_dir)
    settings = Settings(
        data_dir=base / "data", manifests_dir=base / "manifests", allow_custom_code=True
    )
    with pytest.MonkeyPatch.context() as mp:  # the step's module, for the agent
        mp.setenv("PYTHONPATH", os.pathsep.join([str(base / "steps"), str(REPO)]))
        s = Stack(settings, nats_port=0, frameworks=["noop"])
        s.start()
    try:
        anyio.run(wait_agents, s.settings, 1, 60.0)
        anyio.run(wait_server, s.settings, 60.0)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[Settings]:
    """A real local stack: nats-server, the server process and an onnxruntime agent."""
    with running_stack(tmp_path_factory.mktemp("stack"), zoo_dir, ["onnxruntime"]) as s:
        yield s.settings


def python() -> str:
    return sys.executable


def agent_description(agent_id: str = "a1", **fields: Any) -> AgentDescription:
    """An agent's registry entry with plain facts (``fields`` override any of them)."""
    facts: dict[str, Any] = {
        "host": "h",
        "arch": "x86_64",
        "os": "linux",
        "cpu_model": "cpu",
        "cpu_cores": 2,
        "memory_bytes": 1 << 30,
        "frameworks": (FrameworkInfo(name="noop", version="0"),),
        "pid": 1,
        "mlscope_version": "0",
        "started_at": 0.0,
        "heartbeat_at": 0.0,
        "heartbeat_s": 1.0,
    }
    return AgentDescription(agent_id=agent_id, **{**facts, **fields})


@contextmanager
def agent_and_server(
    settings: Settings, *agent_args: str
) -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """``mlscope agent AGENT_ARGS`` and ``mlscope server`` as child processes on
    ``settings``' bus, once the agent is registered; both stopped after (a test may
    have killed either)."""
    env = child_env(settings)
    agent = subprocess.Popen([python(), "-m", "cli.main", "agent", *agent_args], env=env)
    server = subprocess.Popen([python(), "-m", "cli.main", "server"], env=env)
    try:
        anyio.run(wait_agents, settings, 1)
        yield agent, server
    finally:
        for p in (agent, server):
            if p.poll() is None:
                p.terminate()
                p.wait(20)


async def wait_loadgens(
    settings: Settings, count: int, timeout: float = 60.0
) -> list[LoadgenDescription]:
    """Until ``count`` load-generator services are registered; their descriptions."""
    from mlscope import bus as busmod
    from mlscope.errors import MLScopeError
    from mlscope.loadgens import list_loadgens

    deadline = time.monotonic() + timeout
    async with busmod.connect(settings, name="test") as bus:
        while time.monotonic() < deadline:
            try:
                got = await list_loadgens(bus)
            except MLScopeError:  # the bucket is not there yet
                got = []
            if len(got) >= count:
                return got
            await anyio.sleep(0.2)
    raise TimeoutError(f"{count} load generator(s) did not register within {timeout}s")


async def evaluations_of(settings: Settings, job_id: str) -> list[str]:
    """The evaluations stored for a job (one, however often it was run)."""
    from mlscope import bus as busmod
    from mlscope import remote

    async with busmod.connect(settings, name="test") as bus:
        _, rows = await remote.sql(
            bus,
            "SELECT evaluation_id FROM evaluations FINAL WHERE job_id = {j:String}",
            {"j": job_id},
        )
    return [r[0] for r in rows]


async def wait_server(settings: Settings, timeout: float = 60.0) -> None:
    """Until a server answers database requests."""
    from mlscope import bus as busmod
    from mlscope import remote
    from mlscope.errors import BusError

    deadline = time.monotonic() + timeout
    async with busmod.connect(settings, name="test") as bus:
        while time.monotonic() < deadline:
            try:
                await remote.sql(bus, "SELECT 1", timeout=2)
                return
            except BusError:
                await anyio.sleep(0.2)
    raise TimeoutError(f"no server answered within {timeout}s")
