"""An agent's entry in the registry (the agents bucket): put once the agent is ready
and again whenever what it serves changes (:meth:`Registration.advertise`), refreshed by
the heartbeat (:meth:`Registration.heartbeat`).

The description is fitted to one bus message (:func:`fit_description`); a put that still
fails is logged and retried by the heartbeat, never fatal: the models bucket is written
by others, and what it holds must not stop an agent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.bus import Bus
from mlscope.contracts import AgentDescription
from mlscope.errors import BusRefused, MLScopeError
from mlscope.presence import heartbeat

__all__ = ["Registration", "fit_description"]

log = logging.getLogger("mlscope.agent")


class Registration:
    """One agent's registry entry."""

    def __init__(
        self, agent_id: str, describe: Callable[[], AgentDescription], *, heartbeat_s: float
    ) -> None:
        """``describe``: the agent's description now (its ``heartbeat_at`` now too)."""
        self.agent_id = agent_id
        self.heartbeat_s = heartbeat_s
        self._describe = describe
        self._description: AgentDescription | None = None
        """What the last advertise stored in the registry (None: it was not stored)."""

    async def advertise(self, bus: Bus) -> None:
        """Put this agent's description in the registry. A failure is logged, never
        raised: the agent goes on serving, and until an advertise is stored again each
        heartbeat describes the agent afresh (see :meth:`heartbeat`)."""
        kv = await bus.kv(names.AGENTS_BUCKET)
        try:
            desc, payload = fit_description(self._describe(), bus.payload_budget())
            with busmod.bus_errors(f"cannot advertise agent {self.agent_id}"):
                await kv.put(self.agent_id, payload)
        except MLScopeError as exc:
            self._description = None
            log.error("agent %s: not advertised (the heartbeat retries): %s", self.agent_id, exc)
            return
        self._description = desc

    async def heartbeat(self, bus: Bus) -> None:
        """Refresh the registry entry: the description last stored, with a new
        ``heartbeat_at``; a fresh one while the last advertise is not stored (a failed
        beat is logged by :func:`mlscope.presence.heartbeat` and tried again)."""
        kv = await bus.kv(names.AGENTS_BUCKET)
        budget = bus.payload_budget()

        def beat() -> bytes:
            if self._description is None:
                return fit_description(self._describe(), budget)[1]
            desc = self._description.model_copy(update={"heartbeat_at": time.time()})
            return codec.encode_model(desc)

        await heartbeat(
            kv,
            self.agent_id,
            beat,
            interval_s=self.heartbeat_s,
            who=f"agent {self.agent_id}",
        )


def fit_description(desc: AgentDescription, max_bytes: int) -> tuple[AgentDescription, bytes]:
    """``desc`` and its encoding, at most ``max_bytes`` long: refusals are dropped (the
    later half each time, counted in ``refused_more``) until it fits. BusRefused when
    it does not fit even without them: a put over the bus's max payload is refused, and
    an agent whose entry is never stored is invisible while it runs."""
    payload = codec.encode_model(desc)
    while len(payload) > max_bytes and desc.refused:
        keep = len(desc.refused) // 2
        desc = desc.model_copy(
            update={
                "refused": desc.refused[:keep],
                "refused_more": desc.refused_more + len(desc.refused) - keep,
            }
        )
        payload = codec.encode_model(desc)
    if len(payload) > max_bytes:
        raise BusRefused(
            f"agent {desc.agent_id}'s description of its {len(desc.models)} models is "
            f"{len(payload)} bytes, over the {max_bytes} a registry entry may take",
            agent_id=desc.agent_id,
            bytes=len(payload),
            max_bytes=max_bytes,
        )
    return desc, payload
