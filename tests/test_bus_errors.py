"""NATS's exceptions become mlscope's in mlscope/bus.py (a real nats-server), and no
other module catches them but the two docs/ARCHITECTURE.md names."""

from __future__ import annotations

import ast
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from mlscope import bus as busmod
from mlscope import names
from mlscope.contracts import JobRequest
from mlscope.errors import BusError, BusNotFound, BusRefused, ConfigError
from mlscope.jobs import publish_job
from mlscope.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
STILL_CATCHING = frozenset({"mlscope/serving.py", "broker/ingest.py"})
"""Where nats-py's exceptions are still caught outside mlscope/bus.py (the docs say so)."""


def run(settings: Settings, body: Callable[[busmod.Bus], Awaitable[None]]) -> None:
    async def go() -> None:
        async with busmod.connect(settings, name="test") as bus:
            await busmod.ensure_infrastructure(bus)
            await body(bus)

    anyio.run(go, backend="asyncio")


def test_a_missing_key_is_none_or_bus_not_found(settings: Settings) -> None:
    async def body(bus: busmod.Bus) -> None:
        kv = await bus.kv(names.MODELS_BUCKET)
        with busmod.bus_errors("cannot read k"):
            assert await busmod.if_found(kv.get("absent")) is None
            await kv.put("present", b"v")
            entry = await busmod.if_found(kv.get("present"))
        assert entry is not None and entry.value == b"v"
        with (
            pytest.raises(BusNotFound, match="cannot read absent") as caught,
            busmod.bus_errors("cannot read absent", key="absent"),
        ):
            await kv.get("absent")
        assert isinstance(caught.value, LookupError) and caught.value.fields == {"key": "absent"}
        with pytest.raises(BusNotFound, match="does not exist"):
            await bus.kv("no_such_bucket")

    run(settings, body)


def test_a_refused_message_is_bus_refused_and_a_timeout_bus_error(settings: Settings) -> None:
    async def body(bus: busmod.Bus) -> None:
        big = b"x" * (int(bus.nc.max_payload) + 1)
        with pytest.raises(BusRefused, match="max payload"):
            await busmod.publish_persistent(bus, names.JOBS_SUBJECT, big, msg_id="big")
        with pytest.raises(BusRefused, match="cannot publish"), busmod.bus_errors("cannot publish"):
            await bus.nc.publish("mlscope.test", big)
        sub = await bus.nc.subscribe("mlscope.test.quiet")
        assert await busmod.next_msg(sub, 0.05) is None
        await bus.nc.publish("mlscope.test.quiet", b"hi")
        msg = await busmod.next_msg(sub, 2.0)
        assert msg is not None and msg.data == b"hi"
        await sub.unsubscribe()

        async def ignore(_msg: object) -> None:
            return None

        pushed = await bus.nc.subscribe("mlscope.test.pushed", cb=ignore)
        with pytest.raises(BusError, match=r"cannot read mlscope\.test\.pushed"):
            await busmod.next_msg(pushed, 0.05)  # nats-py refuses it on a callback's

    run(settings, body)


def catches_nats(source: str) -> bool:
    """Whether an ``except`` clause of ``source`` names a nats-py exception."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            caught = [node.type]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("suppress"):
            caught = list(node.args)
        else:
            continue
        if any("nats." in ast.unparse(c) for c in caught):
            return True
    return False


def test_only_the_bus_module_catches_nats_errors() -> None:
    found = {
        str(path.relative_to(ROOT))
        for package in ("mlscope", "agent", "broker", "analysis", "dashboard", "cli")
        for path in (ROOT / package).rglob("*.py")
        if catches_nats(path.read_text())
    }
    assert found - {"mlscope/bus.py"} <= STILL_CATCHING, found


def test_the_check_sees_a_catch() -> None:
    assert catches_nats("try:\n    pass\nexcept nats.errors.TimeoutError:\n    pass\n")
    assert catches_nats("with contextlib.suppress(TimeoutError, nats.errors.Error):\n    pass\n")
    assert not catches_nats("try:\n    pass\nexcept BusError:\n    pass\n")


def test_a_job_submitted_again_is_refused_at_once(settings: Settings) -> None:
    """The job stream drops a message whose id it holds: a second submission of one job
    would wait for a server that never takes it; it is refused, naming the id."""

    async def body(bus: busmod.Bus) -> None:
        job = JobRequest(model="noop", framework="noop")
        await publish_job(bus, job)
        with pytest.raises(ConfigError, match=f"job {job.job_id} was submitted before"):
            await publish_job(bus, job)
        await publish_job(bus, JobRequest(model="noop", framework="noop"))  # a new id: taken

    run(settings, body)
