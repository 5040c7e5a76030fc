"""One insert's rows: many span (or sample) batches gathered into one Arrow table.

Per fetch the ingester inserts every span of every message at once. Python lists of
strings were most of the cost: a layer span carries its layer's name and attributes
(JSON, ~300 bytes), and clickhouse-connect writes each string of a list one by one.
Here every string column is kept dictionary-encoded, as the tracer sends it
(:attr:`~mlscope.contracts.SpanBatch.dicts`: each distinct string once, an index per
row): the batches' dictionaries are merged (each distinct string looked at once per
message), their indices remapped with numpy, and chDB receives Arrow dictionary
arrays. A batch from a tracer that sends plain strings is encoded here (by Arrow, in
C). Numbers go in as typed Arrow arrays. The columns were checked against their
table's types before they get here (:func:`broker.ingest_batch.decode`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from mlscope import schema
from mlscope.contracts import SampleBatch, SpanBatch

__all__ = ["Columns", "codes_of"]

_ARROW = {
    "UInt64": pa.uint64(),
    "Int64": pa.int64(),
    "UInt8": pa.uint8(),
    "Float64": pa.float64(),
}
"""The Arrow type of each numeric ClickHouse base type (strings are dictionaries)."""
CONSTANTS = ("evaluation_id", "agent_id", "host", "batch_id")
"""Columns with one value per message (the batch's own fields)."""


class _Dictionary:
    """One string column: merged distinct values and each chunk's indices into them."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self.chunks: list[np.ndarray] = []

    def add(self, values: list[str], codes: np.ndarray) -> None:
        """Rows whose values are ``values[codes]``."""
        index = self.values
        remap = np.fromiter(
            (index.setdefault(v, len(index)) for v in values), np.int32, len(values)
        )
        self.chunks.append(remap[codes] if remap.size else codes.astype(np.int32))

    def add_plain(self, column: list[str]) -> None:
        encoded = pa.array(column, pa.string()).dictionary_encode()
        values = encoded.dictionary.to_pylist()
        self.add(values, encoded.indices.to_numpy(zero_copy_only=False))

    def constant(self, value: str, n: int) -> None:
        code = self.values.setdefault(value, len(self.values))
        self.chunks.append(np.full(n, code, np.int32))

    def arrow(self) -> pa.DictionaryArray:
        codes = np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.int32)
        return pa.DictionaryArray.from_arrays(
            pa.array(codes, pa.int32()), pa.array(list(self.values), pa.string())
        )


class Columns:
    """The rows of one table for one insert, batch by batch."""

    def __init__(self, table: schema.Table) -> None:
        self.table = table
        self.rows = 0
        self._types = {c.name: c.base_type for c in table.columns if c.written}
        self._numbers: dict[str, list[Any]] = {
            n: [] for n, t in self._types.items() if t != "String"
        }
        self._strings = {n: _Dictionary() for n, t in self._types.items() if t == "String"}
        self._fields = [n for n in self._types if n not in CONSTANTS]
        """The columns a batch carries (extra ones are ignored)."""

    def add(self, batch: SpanBatch | SampleBatch, codes: dict[str, np.ndarray]) -> None:
        """One checked batch; ``codes``: its dictionary-encoded columns as arrays."""
        n = len(batch)
        for name in CONSTANTS:
            self._strings[name].constant(str(getattr(batch, name)), n)
        for name in self._fields:
            values = batch.columns[name]
            if name in self._numbers:
                self._numbers[name].extend(values)
            elif name in codes:
                self._strings[name].add(batch.dicts[name], codes[name])
            else:
                self._strings[name].add_plain(values)
        self.rows += n

    def arrow(self) -> pa.Table:
        """Every column of the table (in its order), as Arrow arrays."""
        arrays: dict[str, pa.Array] = {}
        for name, base in self._types.items():
            if base == "String":
                arrays[name] = self._strings[name].arrow()
            else:
                arrays[name] = pa.array(self._numbers[name], _ARROW[base])
        return pa.table(arrays)


def codes_of(column: list[Any], size: int) -> np.ndarray | None:
    """A dictionary-encoded column's indices as an array, or None when they are not all
    integers in ``0 .. size - 1``."""
    try:
        codes = np.asarray(column)
    except (ValueError, OverflowError):  # ragged, nested or huge values
        return None
    if codes.ndim != 1 or (codes.size and codes.dtype.kind not in "iu"):
        return None
    if codes.size and (int(codes.min()) < 0 or int(codes.max()) >= size):
        return None
    return codes.astype(np.int32, copy=False) if codes.size else np.zeros(0, np.int32)
