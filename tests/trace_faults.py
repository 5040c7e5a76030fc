"""Faults in a stack's trace ingest that the tests provoke: a server frozen while it
holds trace batches it has not acknowledged, and the trace consumer's state."""

from __future__ import annotations

import signal
import subprocess
import time

import anyio
import pytest
from nats.js.api import ConsumerInfo

from mlscope import bus as busmod
from mlscope import names
from mlscope.settings import Settings


async def traces_consumer(settings: Settings) -> ConsumerInfo:
    async with busmod.connect(settings, name="test") as bus:
        info: ConsumerInfo = await bus.js.consumer_info(names.TRACES_STREAM, names.TRACES_CONSUMER)
        return info


def freeze_holding_batches(settings: Settings, server: subprocess.Popen[bytes]) -> int:
    """SIGSTOP ``server`` at a moment it holds delivered, unacknowledged trace batches.

    Stopped inside an insert, it holds that fetch; stopped while its pull request is
    open, the batches published meanwhile are delivered to it. Stopped between two
    fetches it holds nothing: let it go on and try again. An acknowledgement the
    server wrote just before it stopped can still be on its way to nats-server, so a
    count is read again half a second later, when such an acknowledgement has landed.
    Returns how many it holds.
    """

    def ack_pending() -> int:
        return anyio.run(traces_consumer, settings, backend="asyncio").num_ack_pending or 0

    for _ in range(20):
        server.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            held = ack_pending()
            if held:
                time.sleep(0.5)
                held = ack_pending()
                if held:
                    return held
            time.sleep(0.05)
        server.send_signal(signal.SIGCONT)
        time.sleep(0.1)
    pytest.fail("the server never held an unacknowledged trace batch")
