"""A service's heartbeat in a TTL-expired registry bucket (agents in
``mlscope_agents``, load-generator services in ``mlscope_loadgens``).

The service puts its description once it is ready; :func:`heartbeat` puts it again
every interval with a fresh ``heartbeat_at``, so the entry lives while the service
does and expires :data:`mlscope.provision.AGENT_TTL_S` after it stops beating.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
from nats.js.kv import KeyValue

from mlscope.provision import AGENT_TTL_S

__all__ = ["heartbeat"]

log = logging.getLogger("mlscope.presence")


async def heartbeat(
    kv: KeyValue, key: str, beat: Callable[[], bytes], *, interval_s: float, who: str
) -> None:
    """Put ``beat()`` under ``key`` every ``interval_s`` (until cancelled). At most one
    beat per put: a put stuck in a leader election (cluster failover) or a cut edge
    link is abandoned, and the next beat tries again, so heartbeats resume as soon as
    the bucket answers, well inside the TTL. A failed beat is logged (the first, then
    every 30th, and the first stored after them), never raised."""
    failing = 0
    while True:
        await anyio.sleep(interval_s)
        error: BaseException | None = TimeoutError("no answer within a beat")
        with anyio.move_on_after(interval_s):
            try:
                await kv.put(key, beat())
                error = None
            except Exception as exc:  # a full or read-only store, a lost link
                error = exc
        failing = _logged(who, failing, error)


def _logged(who: str, failing: int, error: BaseException | None) -> int:
    """Log a heartbeat that failed (first, then every 30th) and the first after; returns
    the run of failed beats so far."""
    if error is None:
        if failing:
            log.warning("%s: heartbeats stored again after %d failed", who, failing)
        return 0
    if failing % 30 == 0:
        log.error(
            "%s: heartbeat not stored (%d in a row): %r; the registry drops it after "
            "%.0f s without one. If nats-server's store ran out of space, JetStream "
            "stays disabled after space returns until nats-server is restarted",
            who,
            failing + 1,
            error,
            AGENT_TTL_S,
        )
    return failing + 1
