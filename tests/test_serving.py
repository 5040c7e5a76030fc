"""The serving boundary on a real nats-server: replies, dead letters, loops, values."""

from __future__ import annotations

import json
import logging
from typing import Any, cast

import anyio
import pytest
from nats.aio.msg import Msg

from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.contracts import CONTROL, ControlOp, PingOp, PingReply
from mlscope.errors import (
    DatabaseError,
    MLScopeError,
    ReplyTooLarge,
    ServiceError,
    WireError,
    error_from_wire,
)
from mlscope.logbudget import LOG_BURST
from mlscope.provision import provisioned
from mlscope.serving import Boundary, as_error, dead_letters, decode_json
from mlscope.settings import Settings

pytestmark = pytest.mark.timeout(60)


def test_any_exception_becomes_a_typed_error() -> None:
    assert isinstance(as_error(KeyError("x")), ServiceError)
    assert isinstance(as_error(RecursionError()), WireError)
    own = DatabaseError("disk full")
    assert as_error(own) is own
    err = as_error(ZeroDivisionError("boom"), service="server s1")
    assert err.fields == {"service": "server s1", "exception": "ZeroDivisionError"}
    assert isinstance(error_from_wire(err.to_wire()), ServiceError)


def test_values_are_limited_before_parsing() -> None:
    assert decode_json(b'{"a": [1, {"b": "[[[["}]}') == {"a": [1, {"b": "[[[["}]}
    with pytest.raises(WireError, match="over the"):
        decode_json(b"[" * 200_000 + b"]" * 200_000)
    with pytest.raises(WireError, match="deeper than 64"):
        decode_json(b"[" * 65 + b"]" * 65)
    with pytest.raises(WireError, match="not valid JSON"):
        decode_json(b"\xff\xfe")
    assert decode_json(json.dumps([[[1]]]).encode()) == [[[1]]]


def test_a_failing_handler_answers_with_its_typed_error_and_keeps_serving(
    settings: Settings,
) -> None:
    calls: list[str] = []

    async def handler(req: ControlOp, msg: Msg) -> PingReply:
        calls.append(type(req).__name__)
        if len(calls) == 1:
            raise KeyError("first call fails")
        if len(calls) == 2:
            raise DatabaseError("disk full", table="spans")
        return PingReply(t_agent=7)

    async def main() -> None:
        async with provisioned(settings, name="test") as bus:
            boundary = Boundary(bus, service="test")
            await boundary.subscribe("t.ctl", CONTROL, handler)
            replies = [
                codec.decode((await bus.nc.request("t.ctl", data, timeout=5)).data)
                for data in (codec.encode({"op": "ping"}),) * 3
                + (b"\xc1", codec.encode({"op": "nope"}))
            ]
            assert [r["kind"] for r in replies] == ["error", "error", "pong", "error", "error"]
            codes = [error_from_wire(r["error"]).code for r in replies if r["kind"] == "error"]
            assert codes == ["service", "database", "wire", "wire"]
            assert boundary.failures == {"service": 1, "database": 1, "wire": 2}
            assert boundary.handled == 1 and calls == ["PingOp"] * 3

    anyio.run(main, backend="asyncio")


def test_a_reply_too_large_for_the_bus_is_a_typed_error_not_silence(
    settings: Settings,
) -> None:
    """The requester hears why at once, instead of waiting out its timeout."""

    async def main() -> None:
        async with provisioned(settings, name="test") as bus:
            size = int(bus.nc.max_payload)

            async def handler(req: ControlOp, msg: Msg) -> bytes:
                return b"x" * (size + (1 if isinstance(req, PingOp) else -100_000))

            boundary = Boundary(bus, service="test")
            await boundary.subscribe("t.big", CONTROL, handler)
            with anyio.fail_after(5):
                reply = await bus.nc.request("t.big", codec.encode({"op": "ping"}), timeout=5)
            err = error_from_wire(codec.decode(reply.data)["error"])
            assert isinstance(err, ReplyTooLarge) and f"{size:,}" in err.message
            fits = await bus.nc.request("t.big", codec.encode({"op": "describe"}), timeout=5)
            assert len(fits.data) == size - 100_000  # one that fits is sent as it is
            assert boundary.failures == {"reply_too_large": 1}

    anyio.run(main, backend="asyncio")


def test_a_result_that_cannot_be_encoded_is_a_typed_error_not_silence(
    settings: Settings,
) -> None:
    """A handler's result msgpack cannot carry (an int past 64 bits: a client's SQL
    selecting an Int128 once was one) is answered with the encoding's WireError."""

    async def main() -> None:
        async with provisioned(settings, name="test") as bus:

            async def handler(req: ControlOp, msg: Msg) -> dict[str, Any]:
                return {"rows": [[2**70]]}

            boundary = Boundary(bus, service="test")
            await boundary.subscribe("t.wide", CONTROL, handler)
            with anyio.fail_after(5):
                reply = await bus.nc.request("t.wide", codec.encode({"op": "ping"}), timeout=5)
            err = error_from_wire(codec.decode(reply.data)["error"])
            assert isinstance(err, WireError) and "cannot encode" in err.message
            assert boundary.failures == {"wire": 1}

    anyio.run(main, backend="asyncio")


def test_a_message_that_keeps_failing_is_dead_lettered(settings: Settings) -> None:
    async def main() -> None:
        async with provisioned(settings, name="test") as bus:
            boundary = Boundary(bus, service="test")
            sub = await bus.js.pull_subscribe(
                names.JOBS_SUBJECT, durable="t", stream=names.JOBS_STREAM
            )
            await bus.js.publish(names.JOBS_SUBJECT, b"payload")
            attempts = 0

            async def fails(msg: Msg) -> None:
                nonlocal attempts
                attempts += 1
                raise OSError("read-only file system")

            while boundary.dead_lettered == 0:
                for msg in await sub.fetch(1, timeout=5):
                    await boundary.settle(
                        msg, names.JOBS_STREAM, fails, max_deliver=3, retry_s=0.05
                    )
            assert attempts == 3
            kept, dead = await dead_letters(bus)
            assert kept == 1 and dead[0].subject == names.JOBS_SUBJECT
            assert "read-only file system" in dead[0].error and dead[0].delivered == 3
            raw = await bus.js.get_msg(names.DEAD_STREAM, dead[0].seq)
            assert raw.data == b"payload"

    anyio.run(main, backend="asyncio")


def test_dead_letters_are_listed_whatever_their_headers(settings: Settings) -> None:
    """Whoever may publish on the dead-letter subjects writes their headers: a count
    that is no number is listed as 0, beside the letters the services wrote; a header
    that is not ASCII (a service's own error quoting a hostile id) is read back as the
    text it was, not as the e-mail header object nats-py parses it into, which
    ``mlscope doctor --json`` could not print."""

    async def main() -> None:
        async with provisioned(settings, name="test") as bus:
            subject = names.dead_letter(names.JOBS_STREAM)
            for delivered in ("many", "-1", "\u0663", "9" * 40, ""):
                await bus.js.publish(subject, b"x", headers={"Mlscope-Delivered": delivered})
            wide = {"Mlscope-Error": "d\u00e9j\u00e0", "Mlscope-Service": "\u670d\u52a1"}
            await bus.js.publish(subject, b"x", headers={**wide, "Mlscope-Delivered": "4"})
            kept, dead = await dead_letters(bus)
            assert kept == 6 and [d.delivered for d in dead] == [0, 0, 0, 0, 0, 4]
            assert (dead[-1].error, dead[-1].service) == ("d\u00e9j\u00e0", "\u670d\u52a1")
            json.dumps([vars(d) for d in dead])  # what ``mlscope doctor --json`` prints

    anyio.run(main, backend="asyncio")


def test_a_failing_loop_is_started_again(settings: Settings) -> None:
    runs = 0

    async def flaky(*, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        nonlocal runs
        runs += 1
        task_status.started()
        if runs < 3:
            raise MLScopeError("watch lost")
        await anyio.sleep_forever()

    async def main() -> None:
        async with busmod.connect(settings, name="test") as bus:
            boundary = Boundary(bus, service="test")
            async with anyio.create_task_group() as tg:
                await tg.start(
                    lambda **kw: boundary.keep_running("flaky", flaky, backoff_s=0.01, **kw)
                )
                with anyio.fail_after(5):
                    while runs < 3:
                        await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
            assert boundary.failures == {"error": 2}

    anyio.run(main, backend="asyncio")


def test_a_flood_of_bad_messages_is_counted_in_full_but_logged_briefly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    boundary = Boundary(cast(Any, None), service="test")  # failed() never touches the bus
    with caplog.at_level(logging.WARNING):
        for _ in range(500):
            boundary.failed(WireError("bad"), "t.subject")
    assert boundary.failures == {"wire": 500}
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == LOG_BURST


def test_a_flood_of_poison_stream_messages_is_dead_lettered_in_full_but_logged_briefly(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Each undecodable message is refused and dead-lettered: two lines a message
    without the service's one budget for its failure lines."""
    n = 3 * LOG_BURST

    async def main() -> None:
        async with provisioned(settings, name="test") as bus:
            boundary = Boundary(bus, service="test")
            sub = await bus.js.pull_subscribe(
                names.JOBS_SUBJECT, durable="t", stream=names.JOBS_STREAM
            )
            for i in range(n):
                await bus.js.publish(names.JOBS_SUBJECT, b"\xc1poison %d" % i)

            async def undecodable(msg: Msg) -> None:
                codec.decode(msg.data)

            with anyio.fail_after(60):
                while boundary.dead_lettered < n:
                    for msg in await sub.fetch(50, timeout=5):
                        await boundary.settle(msg, names.JOBS_STREAM, undecodable, max_deliver=3)
            kept, _ = await dead_letters(bus)
            assert kept == n and boundary.failures == {"wire": n}

    with caplog.at_level(logging.WARNING, logger="mlscope"):
        anyio.run(main, backend="asyncio")
    lines = [r.getMessage() for r in caplog.records if r.name == "mlscope.test"]
    # One budget for both lines of a message; a second window only on a very slow run.
    assert LOG_BURST <= len(lines) <= 2 * LOG_BURST, lines[-3:]
    assert any("gave up on a message" in line for line in lines)


def test_a_slow_wildcard_subscription_is_logged_once_whatever_the_subjects(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Messages dropped by a slow consumer are said once per subscription, not once per
    subject its publishers chose: a flood on a thousand subjects is one line, and the
    process keeps no state per subject."""

    async def main() -> None:
        async with busmod.connect(settings, name="test") as bus:
            release = anyio.Event()

            async def stuck(_msg: Msg) -> None:
                await release.wait()

            await bus.nc.subscribe("flood.>", cb=stuck, pending_msgs_limit=2)
            for i in range(1000):
                await bus.nc.publish(f"flood.{i}", b"x")
            await bus.nc.flush()
            await anyio.sleep(0.2)
            release.set()

    with caplog.at_level(logging.WARNING, logger="mlscope"):
        anyio.run(main, backend="asyncio")
    lines = [r.getMessage() for r in caplog.records if "slow consumer" in r.getMessage()]
    assert len(lines) == 1 and "dropped messages on flood.>" in lines[0], lines[:3]
    assert not [key for key in busmod._slow_logged if key.startswith("flood.") and key != "flood.>"]
