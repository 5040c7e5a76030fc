"""Agent history: every change of the ``mlscope_agents`` bucket, kept in ``agent_history``.

The server watches the bucket (a KV watch from the current values on) and records
one row per revision: ``registered`` (a description whose heartbeat is its start),
``heartbeat`` (a refreshed description) or ``removed`` (deleted or purged: the agent
withdrew, or its entry expired). Rows are keyed by (agent_id, revision) in a
ReplacingMergeTree, so several server replicas watching the same bucket, or a server
that restarts and sees the current values again, never duplicate a row. Rows are
inserted at most once per ``flush_s``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import anyio

from broker.db import AGENT_HISTORY_COLUMNS, Database
from mlscope import codec, names
from mlscope.bus import Bus
from mlscope.contracts import AgentDescription
from mlscope.errors import WireError
from mlscope.kvread import BucketWatch

__all__ = ["AgentHistory", "history_row"]


class AgentHistory:
    def __init__(self, bus: Bus, db: Database, *, flush_s: float = 1.0) -> None:
        self.bus, self.db, self.flush_s = bus, db, flush_s
        self.recorded = 0
        self._rows: list[tuple[Any, ...]] = []

    async def run(self) -> None:
        try:
            async with (
                BucketWatch(self.bus, names.AGENTS_BUCKET) as watch,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(self._flusher)
                async for entry in watch:
                    if entry is None:  # end of the initial values
                        continue
                    self._rows.append(
                        history_row(
                            entry.key, int(entry.revision or 0), entry.operation, entry.value
                        )
                    )
        finally:
            with anyio.CancelScope(shield=True):
                await self._flush()

    async def _flusher(self) -> None:
        while True:
            await anyio.sleep(self.flush_s)
            await self._flush()

    async def _flush(self) -> None:
        rows, self._rows = self._rows, []
        if not rows:
            return
        cols = [list(c) for c in zip(*rows, strict=True)]
        await anyio.to_thread.run_sync(self.db.insert, "agent_history", cols, AGENT_HISTORY_COLUMNS)
        self.recorded += len(rows)


def history_row(
    key: str, revision: int, operation: str | None, value: bytes | None
) -> tuple[Any, ...]:
    """One ``agent_history`` row (columns as AGENT_HISTORY_COLUMNS) from a KV entry."""
    if operation in ("DEL", "PURGE") or not value:
        return (key, revision, datetime.now(UTC), "removed", "", 0, "", 0, "")
    try:
        desc = codec.decode_model(AgentDescription, value)
    except WireError:
        return (key, revision, datetime.now(UTC), "invalid", "", 0, "", 0, "")
    fresh = desc.heartbeat_at - desc.started_at < desc.heartbeat_s / 2
    frameworks = ",".join(f"{f.name}=={f.version}" for f in desc.frameworks)
    return (
        key,
        revision,
        datetime.fromtimestamp(desc.heartbeat_at, UTC),
        "registered" if fresh else "heartbeat",
        desc.host,
        desc.pid,
        frameworks,
        len(desc.models),
        json.dumps(desc.model_dump(mode="json", by_alias=True)),
    )
