"""Span collection on the agent: a cheap level check on the hot path, batched publish.

Spans are appended to column lists (no per-span objects) and published as one
:class:`~mlscope.contracts.SpanBatch` per evaluation every ``flush_s`` seconds or
``max_spans`` spans, over JetStream with a message id so that a retried publish is
deduplicated by the stream.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import anyio

from mlscope import codec, names
from mlscope.bus import Bus, publish_persistent
from mlscope.contracts import SpanBatch, TraceLevel, new_id

__all__ = ["SpanBuffer", "Tracer"]

COLUMNS = ("span_id", "parent_id", "query_index", "level", "kind", "name",
           "start_ns", "end_ns", "attrs")


@dataclass
class SpanBuffer:
    """Spans of one evaluation not yet published, column by column (thread-safe)."""

    columns: dict[str, list[Any]] = field(default_factory=lambda: {c: [] for c in COLUMNS})
    next_id: int = 1
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, *, parent: int, query_index: int, level: TraceLevel, kind: str, name: str,
            start_ns: int, end_ns: int, attrs: dict[str, Any] | None = None) -> int:
        """Append one span; returns its id (unique within this agent and evaluation)."""
        row = (parent, query_index, int(level), kind, name, start_ns, end_ns,
               json.dumps(attrs) if attrs else "")
        with self.lock:
            sid = self.next_id
            self.next_id += 1
            for col, value in zip(COLUMNS, (sid, *row), strict=True):
                self.columns[col].append(value)
        return sid

    def __len__(self) -> int:
        return len(self.columns["span_id"])

    def take(self) -> dict[str, list[Any]]:
        with self.lock:
            out, self.columns = self.columns, {c: [] for c in COLUMNS}
        return out


class Tracer:
    """Buffers spans per evaluation and publishes them in batches."""

    def __init__(self, bus: Bus, *, agent_id: str, host: str, flush_s: float = 0.25,
                 max_spans: int = 5000) -> None:
        self.bus, self.agent_id, self.host = bus, agent_id, host
        self.flush_s, self.max_spans = flush_s, max_spans
        self.buffers: dict[str, SpanBuffer] = {}
        self._wake = anyio.Event()
        self.published = 0

    def buffer(self, evaluation_id: str) -> SpanBuffer:
        buf = self.buffers.get(evaluation_id)
        if buf is None:
            buf = self.buffers[evaluation_id] = SpanBuffer()
        if len(buf) >= self.max_spans:
            self._wake.set()
        return buf

    async def run(self) -> None:
        """Publish forever; on cancellation, publish what is left (shielded)."""
        try:
            while True:
                with anyio.move_on_after(self.flush_s):
                    await self._wake.wait()
                self._wake = anyio.Event()
                await self.flush()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await self.flush()

    async def flush(self) -> None:
        for eval_id, buf in list(self.buffers.items()):
            if not len(buf):
                continue
            batch = SpanBatch(evaluation_id=eval_id, agent_id=self.agent_id, host=self.host,
                              batch_id=new_id("sb"), columns=buf.take())
            await publish_persistent(self.bus, names.traces(eval_id),
                                     codec.encode_model(batch), msg_id=batch.batch_id)
            self.published += len(batch)
