"""Reaching the evaluation database through the process that owns it (over the bus).

chDB allows one process per data directory; the server owns it and answers
read-only SQL on ``mlscope.db.sql``. With a ClickHouse server, clients may instead
connect directly with clickhouse-connect; these functions work in both cases.
"""

from __future__ import annotations

import json
from typing import Any

from mlscope import codec, names
from mlscope.bus import Bus, request

__all__ = ["evaluation", "sql"]


async def sql(
    bus: Bus, query: str, parameters: dict[str, Any] | None = None, *, timeout: float = 30.0
) -> tuple[list[str], list[list[Any]]]:
    """Run one read-only statement; returns (column names, rows)."""
    reply = await request(
        bus,
        names.SQL_SUBJECT,
        codec.encode({"sql": query, "parameters": parameters or {}}),
        timeout=timeout,
    )
    return list(reply["columns"]), [list(r) for r in reply["rows"]]


async def evaluation(
    bus: Bus, evaluation_id: str, *, timeout: float = 10.0
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(specification, summary) of one stored evaluation."""
    reply = await request(
        bus,
        names.EVALUATION_SUBJECT,
        codec.encode({"evaluation_id": evaluation_id}),
        timeout=timeout,
    )
    return json.loads(reply["spec"]), json.loads(reply["summary"])
