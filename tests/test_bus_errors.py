"""NATS's exceptions become mlscope's in mlscope/bus.py (a real nats-server), and no
other module catches them but the two docs/ARCHITECTURE.md names."""

from __future__ import annotations

import ast
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import nats.errors
import nats.js.errors
import pytest

from mlscope import bus as busmod
from mlscope import names
from mlscope.contracts import JobRequest
from mlscope.errors import BusError, BusNotFound, BusRefused, ConfigError
from mlscope.jobs import publish_job
from mlscope.natsserver import NatsServer
from mlscope.provision import ensure_infrastructure
from mlscope.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
STILL_CATCHING = frozenset({"mlscope/serving.py", "broker/ingest.py"})
"""Where nats-py's exceptions are still caught outside mlscope/bus.py (the docs say so)."""


def run(settings: Settings, body: Callable[[busmod.Bus], Awaitable[None]]) -> None:
    async def go() -> None:
        async with busmod.connect(settings, name="test") as bus:
            await ensure_infrastructure(bus)
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
        # A JetStream refusal says what the server said, not only its class name.
        refused = busmod.bus_errors("cannot make a stream")
        with (
            pytest.raises(BusRefused, match=r"maximum replicas is 5 \(JetStream error \d+"),
            refused,
        ):
            await bus.js.add_stream(name="TOO_MANY", subjects=["mlscope.test.r9"], num_replicas=9)
        silent = await bus.nc.subscribe("mlscope.test.silent")  # hears, never answers
        step = busmod.bus_errors("a step")
        with pytest.raises(BusError, match=r"^a step: no answer in time$"), step:
            await bus.nc.request("mlscope.test.silent", b"", timeout=0.05)
        await silent.unsubscribe()
        step = busmod.bus_errors("a step")
        with pytest.raises(BusError, match=r"^a step: connection closed$"), step:
            raise nats.errors.ConnectionClosedError

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


def test_provisioners_started_together_all_succeed(tmp_path: Path) -> None:
    """``mlscope up`` starts the server and its agents at once, and each provisions the
    bus. One that found a bucket missing and then creates it after another process
    created and bounded it (the cancels bucket's stream is updated after its creation)
    is refused by JetStream: it takes the bucket as created. Also six at once."""

    async def go() -> None:
        with NatsServer(store_dir=tmp_path / "nats") as ns:
            settings = Settings(nats_url=ns.url, data_dir=tmp_path / "data")
            async with (
                busmod.connect(settings, name="first") as first,
                busmod.connect(settings, name="late") as late,
            ):
                await ensure_infrastructure(first)
                looked: set[str] = set()
                real = late.js.key_value

                async def before_it_was_made(bucket: str) -> Any:
                    if bucket not in looked:  # its first look predates the creation
                        looked.add(bucket)
                        raise nats.js.errors.BucketNotFoundError()
                    return await real(bucket)

                late.js.key_value = before_it_was_made  # type: ignore[method-assign]
                await ensure_infrastructure(late)
                assert names.CANCELS_BUCKET in looked
        with NatsServer(store_dir=tmp_path / "nats6") as ns:
            settings = Settings(nats_url=ns.url, data_dir=tmp_path / "data6")

            async def provision(k: int) -> None:
                async with busmod.connect(settings, name=f"p{k}") as bus:
                    await ensure_infrastructure(bus)

            async with anyio.create_task_group() as tg:
                for k in range(6):
                    tg.start_soon(provision, k)

    anyio.run(go, backend="asyncio")


def test_messages_a_slow_subscription_drops_are_logged(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """nats-py drops what comes past a subscription's pending limit and says so only
    to the error callback: mlscope logs it (once in a while), or the loss is silent."""

    async def body(bus: busmod.Bus) -> None:
        sub = await bus.nc.subscribe("test.slow.dropped", pending_bytes_limit=1000)
        for _ in range(20):
            await bus.nc.publish("test.slow.dropped", b"x" * 200)
        await bus.nc.flush()
        await anyio.sleep(0.3)
        await sub.unsubscribe()

    with caplog.at_level("WARNING", logger="mlscope.bus"):
        run(settings, body)
    dropped = [r for r in caplog.records if "dropped messages on test.slow.dropped" in r.message]
    assert len(dropped) == 1, [r.message for r in caplog.records]
