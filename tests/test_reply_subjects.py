"""A responder answers only to inboxes, on a real nats-server: a requester that names
a subject of the stack or of nats-server's APIs as its reply subject gets no answer
there, so the server never publishes (with its own permissions) in its stead."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from nats.aio.msg import Msg

from broker.agentrun import _read
from mlscope import bus as busmod
from mlscope import codec
from mlscope.bus import answerable
from mlscope.contracts import EvaluationRequest
from mlscope.errors import ConfigError
from mlscope.settings import Settings
from tests.conftest import server_in_process

pytestmark = pytest.mark.timeout(120)

STREAM = "MLSCOPE_JOBS"


def test_only_inboxes_are_answerable() -> None:
    assert answerable("_INBOX.abc.def") and answerable("_INBOX_reader.x")
    for hostile in (
        "",
        f"$JS.API.STREAM.DELETE.{STREAM}",
        "$KV.mlscope_agents.a1",
        "$SYS.REQ.SERVER.PING",
        "mlscope.jobs",
        "mlscope.job.j1.events",
    ):
        assert not answerable(hostile), hostile
    with pytest.raises(ConfigError, match=r"inbox prefix .\$JS\.API"):
        busmod.connect_options(Settings(nats_inbox_prefix="$JS.API"))


def test_the_server_answers_no_request_whose_reply_subject_is_no_inbox(
    settings: Settings,
) -> None:
    """Requests to the server's database responder whose reply subject is a job's
    events or the job stream's delete: nothing lands there and the stream stays; the
    same request with an inbox is answered."""
    spy = "mlscope.job.deputy.events"

    async def main() -> tuple[list[bytes], bool, Any]:
        async with (
            server_in_process(settings),
            busmod.connect(settings, name="test requester") as bus,
        ):
            landed: list[bytes] = []

            async def heard(msg: Msg) -> None:
                landed.append(msg.data)

            await bus.nc.subscribe(spy, cb=heard)
            ask = codec.encode_model(EvaluationRequest(evaluation_id="ev-000000000000"))
            for reply in (spy, f"$JS.API.STREAM.DELETE.{STREAM}"):
                await bus.nc.publish("mlscope.db.evaluation", ask, reply=reply)
            await bus.nc.flush()
            answered = await bus.nc.request("mlscope.db.evaluation", ask, timeout=10)
            await anyio.sleep(1.0)  # anything misdirected has landed by now
            stream = await busmod.if_found(bus.js.stream_info(STREAM))
        return landed, stream is not None, codec.decode(answered.data)

    landed, stream_kept, answered = anyio.run(main, backend="asyncio")
    assert landed == [] and stream_kept
    assert answered["error"]["code"] == "evaluation_not_found"


def test_rows_asking_to_be_answered_on_a_stream_api_get_no_answer(settings: Settings) -> None:
    """The server says it has read an agent's rows by an empty answer, which on
    ``$JS.API.STREAM.DELETE.<stream>`` would delete the stream."""

    async def main() -> bool:
        async with busmod.connect(settings, name="test server") as bus:
            await bus.js.add_stream(name="VICTIM", subjects=["victim.>"])
            subject = "mlscope.agent.a1.rows.ev-x"
            sub = await bus.nc.subscribe(subject)
            await bus.nc.publish(subject, b"rows", reply="$JS.API.STREAM.DELETE.VICTIM")
            rows = await busmod.next_msg(sub, 10)  # as an agent's rows reach the server
            assert rows is not None
            await _read(bus, rows)
            await bus.nc.flush()
            await anyio.sleep(0.5)
            return await busmod.if_found(bus.js.stream_info("VICTIM")) is not None

    assert anyio.run(main, backend="asyncio")
