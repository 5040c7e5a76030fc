"""Span and system-sample batches on the trace stream."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
)

from mlscope.contracts._base import Ident, _Message
from mlscope.schema import STRING_BOUNDS


class _ColumnBatch(_Message):
    """Rows of one evaluation from one agent, column by column (lists of one length).

    Every string column is bounded (:data:`mlscope.schema.STRING_BOUNDS`, dictionary
    words included): the ingester dead-letters a batch with a longer string, so an
    agent fits its strings before it sends them (``agent/tracer.py``)."""

    evaluation_id: Ident
    agent_id: Ident
    host: Annotated[str, Field(max_length=STRING_BOUNDS["host"])]
    batch_id: Ident
    columns: dict[str, list[Any]]
    dicts: dict[str, list[str]] = Field(default_factory=dict)
    """Dictionary-encoded string columns: a column named here holds, per row, the index
    of its value in this list (a layer's name and attributes repeat on every query, so
    a batch carries each distinct string once)."""

    def __len__(self) -> int:
        first = next(iter(self.columns.values()), [])
        return len(first)

    def values(self, name: str) -> list[Any]:
        """Column ``name`` with its values, dictionary-encoded or not (a reader's view;
        the ingester checks the indices before it trusts them)."""
        column = self.columns[name]
        words = self.dicts.get(name)
        return column if words is None else [words[int(i)] for i in column]


class SpanBatch(_ColumnBatch):
    """Many spans in one message, column by column (one list per field, same length).

    Columns: :data:`mlscope.schema.SPAN_FIELDS` (span_id, parent_id, query_index, level,
    kind, name, start_ns, end_ns, attrs as JSON text). Times are the agent's monotonic
    clock in ns and are stored so; readers put them on the load generator's clock with
    the evaluation's stored ``clock_offset_ns`` (``mlscope trace`` does).
    """

    kind: Literal["spans"] = "spans"


class SampleBatch(_ColumnBatch):
    """System samples of one evaluation, column by column (trace level ``system``+).

    Columns: :data:`mlscope.schema.SAMPLE_FIELDS`: ts_ns (agent monotonic clock, like
    spans), metric (``cpu.util``,
    ``proc.rss_bytes``, ``gpu.power_w``, ``perf.cycles`` ...), device (``all``,
    ``cpu3``, ``proc``, ``gpu0``), value (float). Published on the same stream as
    spans; the ingester stores them in ``system_samples``.
    """

    kind: Literal["samples"] = "samples"
