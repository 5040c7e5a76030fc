"""Span collection on the agent: a cheap level check on the hot path, batched publish.

Spans are appended to column lists (no per-span objects) and published as one
:class:`~mlscope.contracts.SpanBatch` per evaluation every ``flush_s`` seconds or
``max_spans`` spans, its repeating string columns dictionary-encoded, over JetStream
with a message id so that a retried publish is deduplicated by the stream. A batch the
stream refuses (the agent's trace budget is full) is counted per evaluation
(:attr:`Tracer.refused`) and the next one tried as usual.

Span ids start at a random base per buffer (below 2**53, so JSON viewers keep them
exact): an agent restarted with the same ``--agent-id`` in the middle of an evaluation,
or a buffer evicted and created again, never reuses the ids under which the database
already keeps (evaluation, agent, span) rows. A buffer that has been empty for
``idle_s`` seconds is dropped, so a long-running agent does not keep one per past
evaluation, unless its id is held (:meth:`Tracer.hold`: an evaluation still prepared,
and its runs, whose buffers a profiler may write into when it is released).

Every string is fitted to its bound (:data:`mlscope.schema.STRING_BOUNDS`) as it is
buffered, since the ingester dead-letters a batch with a longer one: a name past the
bound keeps its start and end around a hash of the whole (:func:`fit`), attributes past
theirs lose their largest values (:func:`attrs_text`). A span is never dropped for its
strings; the cost of a string within its bound is one length check.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

import anyio

from mlscope import codec, names, schema
from mlscope.bus import Bus, publish_persistent
from mlscope.contracts import SampleBatch, SpanBatch, TraceLevel, new_id
from mlscope.errors import BusRefused
from mlscope.provision import AGENT_TRACE_BATCHES, TRACE_BATCH_MAX_BYTES

__all__ = ["SAMPLE_COLUMNS", "SampleBuffer", "SpanBuffer", "Tracer", "attrs_text", "fit"]

log = logging.getLogger("mlscope.tracer")
COLUMNS = tuple(c.name for c in schema.SPAN_FIELDS)
"""The fields of one span (:class:`~mlscope.contracts.SpanBatch` columns)."""
SAMPLE_COLUMNS = tuple(c.name for c in schema.SAMPLE_FIELDS)
SPAN_ID_BLOCK = 1 << 32
"""Each buffer owns ids ``base + 1 .. base + 2**32`` with ``base`` a random multiple of this."""


_NAME = schema.STRING_BOUNDS["name"]
_KIND = schema.STRING_BOUNDS["kind"]
_ATTRS = schema.STRING_BOUNDS["attrs"]
_METRIC = schema.STRING_BOUNDS["metric"]
_DEVICE = schema.STRING_BOUNDS["device"]


def fit(text: str, limit: int) -> str:
    """``text`` when it has at most ``limit`` characters, else its start and its end
    joined by ``…<hash>…``, ``limit`` characters in all: the start names the scope (a
    node path, a kernel's template), the end the op, and the 8 hex digits of the whole
    name's BLAKE2b keep two long names that share both ends distinct."""
    if len(text) <= limit:
        return text
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
    marker = f"…{digest}…"
    keep = max(limit - len(marker), 0)
    head = keep - keep // 2
    return (text[:head] + marker + (text[-(keep - head) :] if keep > head else ""))[:limit]


def attrs_text(attrs: dict[str, Any] | None) -> str:
    """A span's attributes as JSON text within their bound: when they would not fit,
    their largest values are left out, largest first, and their keys listed under
    ``attrs_cut`` (``true`` instead when even that list would not fit)."""
    if not attrs:
        return ""
    text = json.dumps(attrs)
    if len(text) <= _ATTRS:
        return text
    kept = dict(attrs)
    cut: list[str] = []
    for key in sorted(kept, key=lambda k: len(json.dumps(kept[k])), reverse=True):
        del kept[key]
        cut.append(fit(str(key), _KIND))
        text = json.dumps({**kept, "attrs_cut": cut})
        if len(text) <= _ATTRS:
            return text
    return json.dumps({"attrs_cut": True})


def span_id_base() -> int:
    """A random id block below 2**53 (one in 2**21 chance that two buffers share it)."""
    return secrets.randbits(21) * SPAN_ID_BLOCK


@dataclass
class SpanBuffer:
    """Spans of one evaluation not yet published, column by column (thread-safe)."""

    columns: dict[str, list[Any]] = field(default_factory=lambda: {c: [] for c in COLUMNS})
    next_id: int = field(default_factory=lambda: span_id_base() + 1)
    idle_flushes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(
        self,
        *,
        parent: int,
        query_index: int,
        level: TraceLevel,
        kind: str,
        name: str,
        start_ns: int,
        end_ns: int,
        attrs: dict[str, Any] | None = None,
    ) -> int:
        """Append one span; returns its id (unique within this agent and evaluation).
        Its strings are fitted to their bounds (:func:`fit`, :func:`attrs_text`)."""
        row = (
            parent,
            query_index,
            int(level),
            kind if len(kind) <= _KIND else fit(kind, _KIND),
            name if len(name) <= _NAME else fit(name, _NAME),
            start_ns,
            end_ns,
            attrs_text(attrs),
        )
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


@dataclass
class SampleBuffer:
    """System samples of one evaluation not yet published (thread-safe)."""

    columns: dict[str, list[Any]] = field(default_factory=lambda: {c: [] for c in SAMPLE_COLUMNS})
    idle_flushes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, ts_ns: int, metric: str, device: str, value: float) -> None:
        """Append one sample; ``metric`` and ``device`` fitted to their bounds."""
        if len(metric) > _METRIC or len(device) > _DEVICE:
            metric, device = fit(metric, _METRIC), fit(device, _DEVICE)
        with self.lock:
            c = self.columns
            c["ts_ns"].append(ts_ns)
            c["metric"].append(metric)
            c["device"].append(device)
            c["value"].append(value)

    def __len__(self) -> int:
        return len(self.columns["ts_ns"])

    def take(self) -> dict[str, list[Any]]:
        with self.lock:
            out, self.columns = self.columns, {c: [] for c in SAMPLE_COLUMNS}
        return out


_ENCODED: dict[type[SpanBatch] | type[SampleBatch], tuple[str, ...]] = {
    SpanBatch: ("kind", "name", "attrs"),
    SampleBatch: ("metric", "device"),
}
"""The string columns sent dictionary-encoded: their values repeat (a layer's name and
attributes on every query, a metric's name on every sample)."""


def dictionary_encode(
    columns: dict[str, list[Any]], names_: tuple[str, ...]
) -> tuple[dict[str, list[Any]], dict[str, list[str]]]:
    """``columns`` with each of ``names_`` as indices into its distinct values
    (:attr:`SpanBatch.dicts`): 5,000 spans, 90 % of them layer spans with ~300-byte
    attributes, take 84 KB instead of ~1.5 MB (``bench/bench_tracing.py``), which the
    bus, the ingester's decoding and chDB's insert all feel."""
    out, dicts = dict(columns), {}
    for name in names_:
        index: dict[str, int] = {}
        out[name] = [index.setdefault(v, len(index)) for v in columns[name]]
        dicts[name] = list(index)
    return out, dicts


class Tracer:
    """Buffers spans per evaluation and publishes them in batches."""

    def __init__(
        self,
        bus: Bus,
        *,
        agent_id: str,
        host: str,
        flush_s: float = 0.25,
        max_spans: int = 5000,
        idle_s: float = 300.0,
    ) -> None:
        self.bus, self.agent_id = bus, agent_id
        self.host = fit(host, schema.STRING_BOUNDS["host"])
        self.flush_s, self.max_spans = flush_s, max_spans
        self.idle_flushes = max(2, round(idle_s / flush_s))
        """Empty flushes in a row after which a buffer is dropped. ``buffer()`` and the
        flush both run on the event loop, so no new reference appears while dropping; a
        worker thread holds its reference only while its query is in flight, far shorter
        than ``idle_s``."""
        self.buffers: dict[str, SpanBuffer] = {}
        self.sample_buffers: dict[str, SampleBuffer] = {}
        self.held: set[str] = set()
        """Evaluations whose buffers (and their runs') are kept however long they are
        empty (:meth:`hold`)."""
        self._wake = anyio.Event()
        self.published = 0
        self.samples_published = 0
        self.refused: dict[str, int] = {}
        """Batches per evaluation that the traces stream refused (the agent's trace
        budget was full, :data:`mlscope.provision.AGENT_TRACE_BATCHES`): their rows are
        not stored; the evaluation's release reports the count."""

    def hold(self, evaluation_id: str) -> None:
        """Keep the buffers of ``evaluation_id`` and of its runs (``<id>-<k>``) until
        :meth:`let_go`: a sweep's earlier run is idle while the later ones run, and a
        profiler that holds back layer spans (ONNX Runtime's) writes them into its
        run's buffer when the evaluation is released."""
        self.held.add(evaluation_id)

    def let_go(self, evaluation_id: str) -> None:
        """The buffers of ``evaluation_id`` and its runs are dropped once idle."""
        self.held.discard(evaluation_id)

    def buffer(self, evaluation_id: str) -> SpanBuffer:
        buf = self.buffers.get(evaluation_id)
        if buf is None:
            buf = self.buffers[evaluation_id] = SpanBuffer()
        if len(buf) >= self.max_spans:
            self._wake.set()
        return buf

    def samples(self, evaluation_id: str) -> SampleBuffer:
        buf = self.sample_buffers.get(evaluation_id)
        if buf is None:
            buf = self.sample_buffers[evaluation_id] = SampleBuffer()
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
            if len(buf):
                buf.idle_flushes = 0
                self.published += await self._publish(SpanBatch, eval_id, buf.take())
            elif self._idle(buf, eval_id):
                del self.buffers[eval_id]
        for eval_id, sbuf in list(self.sample_buffers.items()):
            if len(sbuf):
                sbuf.idle_flushes = 0
                self.samples_published += await self._publish(SampleBatch, eval_id, sbuf.take())
            elif self._idle(sbuf, eval_id):
                del self.sample_buffers[eval_id]

    def _idle(self, buf: SpanBuffer | SampleBuffer, eval_id: str) -> bool:
        buf.idle_flushes += 1
        if buf.idle_flushes < self.idle_flushes:
            return False
        return eval_id not in self.held and eval_id.rpartition("-")[0] not in self.held

    async def _publish(
        self, cls: type[SpanBatch] | type[SampleBatch], eval_id: str, columns: dict[str, list[Any]]
    ) -> int:
        """Publish one batch, halved until each message fits the server's max payload."""
        wire, dicts = dictionary_encode(columns, _ENCODED[cls])
        batch = cls.model_construct(  # built here from our own columns: no validation
            evaluation_id=eval_id,
            agent_id=self.agent_id,
            host=self.host,
            batch_id=new_id("sb" if cls is SpanBatch else "ss"),
            columns=wire,
            dicts=dicts,
        )
        data = codec.encode_model(batch)
        n = len(batch)
        if len(data) > self.max_bytes() and n > 1:
            half = n // 2
            return await self._publish(
                cls, eval_id, {k: v[:half] for k, v in columns.items()}
            ) + await self._publish(cls, eval_id, {k: v[half:] for k, v in columns.items()})
        try:
            await publish_persistent(
                self.bus, names.traces(eval_id, self.agent_id), data, msg_id=batch.batch_id
            )
        except BusRefused as exc:  # a full budget: the next batches may fit again
            self.refused[eval_id] = self.refused.get(eval_id, 0) + 1
            if self.refused[eval_id] == 1:
                log.warning(
                    "evaluation %s: %s; its refused span batches are counted, not stored "
                    "(trace budget %d batches not yet stored)",
                    eval_id,
                    exc,
                    AGENT_TRACE_BATCHES,
                )
            return 0
        return n

    def max_bytes(self) -> int:
        """The largest message to publish: the server's max payload, or the traces
        stream's largest batch where that is smaller, less headroom for headers."""
        payload = int(getattr(self.bus.nc, "max_payload", 1 << 20))
        return min(payload, TRACE_BATCH_MAX_BYTES) - 4096
