"""The stack's durable JetStream consumers: each set to its service's config when the
service starts, and the hold a service keeps on the messages it is working on.

A durable consumer outlives its services, and JetStream keeps an existing consumer's
config: a service that only bound to it would never apply a changed ack wait or
delivery limit. :func:`durable_pull` creates or updates it first. A delivered message
goes to another consumer once its ack wait passes unacknowledged; :func:`keep_holding`
renews the hold (``in_progress``) while the work lasts, so a message is delivered
again when its holder stops (killed, frozen, cut off), never because the work is slow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import anyio
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig

from mlscope.bus import Bus, bus_errors, if_found
from mlscope.errors import BusError

__all__ = ["HOLDS_PER_ACK_WAIT", "durable_pull", "keep_holding"]

HOLDS_PER_ACK_WAIT = 5
"""Renewals of a hold per ack wait: a renewal lost to a short outage is not the last."""
_UPDATABLE = ("ack_wait", "max_deliver", "max_ack_pending")
"""What of a consumer's config :func:`durable_pull` brings to the service's."""
log = logging.getLogger("mlscope.consumers")


async def durable_pull(bus: Bus, stream: str, name: str, config: ConsumerConfig) -> Any:
    """A pull subscription bound to ``stream``'s durable consumer ``name``, created
    with ``config``, or updated where its ack wait, delivery limit or pending limit
    differs from ``config``'s (a change is logged)."""
    config = dataclasses.replace(config, name=name, durable_name=name)
    what = f"cannot set up the consumer {name} of {stream}"
    with bus_errors(what):
        info = await if_found(bus.js.consumer_info(stream, name))
    before = None if info is None else info.config
    changed = [
        f"{k} {getattr(before, k)} -> {getattr(config, k)}"
        for k in _UPDATABLE
        if before is not None
        and getattr(config, k) is not None
        and getattr(before, k) != getattr(config, k)
    ]
    with bus_errors(what):
        if before is None or changed:
            await bus.js.add_consumer(stream, config=config)
        if changed:
            log.info("consumer %s of %s updated: %s", name, stream, ", ".join(changed))
        return await bus.js.pull_subscribe_bind(durable=name, stream=stream)


async def keep_holding(held: Callable[[], Iterable[Msg]], ack_wait_s: float) -> None:
    """Renew the hold on each message ``held()`` names, :data:`HOLDS_PER_ACK_WAIT` times
    per ack wait, until cancelled. A renewal that fails (a bus outage) is skipped, and
    the next one resumes the hold."""
    while True:
        await anyio.sleep(ack_wait_s / HOLDS_PER_ACK_WAIT)
        for m in list(held()):
            with (
                anyio.move_on_after(2),
                contextlib.suppress(BusError, OSError),
                bus_errors("in progress"),
            ):
                await m.in_progress()
