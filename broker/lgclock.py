"""The load generator's clock, and its offset to another process's clock.

``now`` is the clock every load generator stamps queries with (``perf_counter_ns``);
:func:`estimate_offset` measures an agent's (or a load-generator service's) clock
against it over request/reply pings, so the agent's timestamps of a query can be read
in the load generator's clock.
"""

from __future__ import annotations

import time
from typing import Any

from mlscope import codec, names
from mlscope.bus import Bus, request
from mlscope.contracts import MAX_CLOCK_OFFSET_NS, PingReply
from mlscope.errors import ConfigError, WireError

__all__ = ["estimate_offset", "now", "on_our_clock"]

now = time.perf_counter_ns


async def estimate_offset(
    bus: Bus, agent_id: str, *, rounds: int = 9, subject: str | None = None
) -> tuple[int, int]:
    """(agent clock - our clock, round trip) in ns from the ping with the smallest RTT
    (the first of equals) among ``rounds`` pings (at least one). A responder whose clock
    is :data:`MAX_CLOCK_OFFSET_NS` or more from ours is a WireError naming it.

    NTP-style: offset = t_agent - (t_send + t_recv) / 2, error bounded by RTT / 2.
    ``subject``: another responder's control subject (a load-generator service's).
    """
    if rounds < 1:
        raise ConfigError(f"rounds must be at least 1, got {rounds}")
    target = subject or names.agent_ctl(agent_id)
    payload = codec.encode({"op": "ping"})
    pings = [await _ping(bus, target, payload) for _ in range(rounds)]
    offset, rtt = min(pings, key=lambda ping: ping[1])
    if abs(offset) >= MAX_CLOCK_OFFSET_NS:
        raise WireError(
            f"the ping reply on {target}: its clock is {offset / 1e9:.3g} s from ours, "
            f"not under the {MAX_CLOCK_OFFSET_NS / 1e9:.3g} s two hosts' uptimes allow",
            subject=target,
            offset_ns=offset,
        )
    return offset, rtt


async def _ping(bus: Bus, subject: str, payload: bytes) -> tuple[int, int]:
    """One ping: (agent clock - our clock, round trip) in ns. The reply is checked
    once it is timed: anything but a :class:`PingReply` is a WireError naming where
    it came from (a load-generator service is a peer on any host)."""
    t1 = now()
    raw = await request(bus, subject, payload, timeout=5.0)
    t2 = now()
    try:
        reply = codec.validate(PingReply, raw)
    except WireError as exc:
        raise WireError(f"the ping reply on {subject}: {exc.message}", subject=subject) from exc
    return reply.t_agent - (t1 + t2) // 2, t2 - t1


def on_our_clock(
    t_agent: int, offset_ns: int, *, since_ns: int, slack_s: float, what: str, **fields: Any
) -> int:
    """``t_agent``, an instant a responder read on its clock, on ours (less the measured
    ``offset_ns``), once it falls between ``since_ns`` (when we asked for what it
    times) and now, give or take ``slack_s``: any other is no clock the ping measured,
    and could be past the Int64 that stores it. ``what`` says which instant, as in
    "agent a1 started its run" (a WireError with ``fields``)."""
    t = t_agent - offset_ns
    slack = int(slack_s * 1e9)
    if not since_ns - slack <= t <= now() + slack:
        raise WireError(
            f"{what} at {t_agent} ns of its clock, {(t - since_ns) / 1e9:.3g} s from when "
            f"it was asked for (clock offset {offset_ns} ns)",
            **fields,
        )
    return t
