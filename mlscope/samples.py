"""Which data-set rows each query carries: one seeded sample order for every run.

Randomness, MLPerf-style: each random dimension of a run has its own stream, derived
from the one user seed with ``np.random.SeedSequence(seed).spawn(...)`` (a child's
stream depends only on its index, so adding a stream never changes the others):

* :data:`ARRIVAL_STREAM` draws arrival times (``mlscope.schedule``),
* :data:`SAMPLE_STREAM` draws the sample order (:class:`SampleOrder`),
* :data:`FILL_STREAM` draws synthetic inputs for a model without a data set.

Changing the rate or the scenario therefore never changes which samples are sent.

The order walks through seeded permutations of ``range(dataset_size)``, a fresh one
per cycle: no sample repeats before every sample was used once, and each cycle is a
permutation of its own. Query ``i`` of ``b`` samples takes positions ``i*b .. i*b+b-1``
of that endless sequence, so a query's rows depend only on the seed, the data-set
size, the batch size and its global index: the server, a load-generator process on
another host or an agent computes the same rows from those four numbers.

What a run feeds is defined here too, once for every place a load is generated (the
server's load generator, ``placement: server``, and the agent's local one,
``placement: agent``): the data set (:func:`dataset`, :func:`table`), query ``i``'s
inputs and labels (:func:`feeders`, :func:`feed`), which models are scored
(:func:`scored`) and how a reply's top-1 is read (:func:`top1`).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import numpy as np

from mlscope.catalog import Entry
from mlscope.errors import ConfigError

__all__ = [
    "ARRIVAL_STREAM",
    "FILL_ROWS",
    "FILL_STREAM",
    "SAMPLE_STREAM",
    "Feeders",
    "QueryRows",
    "SampleOrder",
    "dataset",
    "feed",
    "feeders",
    "sample_indices",
    "scored",
    "stream",
    "table",
    "top1",
]

ARRIVAL_STREAM = 0
"""Index of the arrival-time stream among the seed's children."""
SAMPLE_STREAM = 1
"""Index of the sample-order stream."""
FILL_STREAM = 2
"""Index of the stream synthetic inputs are drawn from (a model with no data set)."""
_STREAMS = 3
FILL_ROWS = 64
"""Synthetic rows (from :data:`FILL_STREAM`) a model without a data set is fed."""
FILL_MAX_BYTES = 256 << 20
"""Most memory the synthetic rows' draw may take (float64): a manifest with a large
input gets fewer rows, the first ones of the same stream, rather than GBs."""


class QueryRows:
    """The rows of an array (inputs or labels) the queries of one batch size carry:
    ``rows(i)`` those of query ``i`` (one per sample); ``block(first, end)`` those of
    queries ``first .. end-1`` at once, query after query on axis 0, and ``span(first,
    end)`` the same as one row per query (a collector scores thousands of queries a
    second, an agent's stream gathers its inputs ahead: one gather instead of a call
    each). Thread-safe: the order is drawn under ``lock``."""

    def __init__(self, a: np.ndarray, order: SampleOrder, lock: threading.Lock, batch: int) -> None:
        self.a, self.order, self.lock, self.batch = a, order, lock, batch
        self._width = batch * int(np.prod(a.shape[1:], dtype=np.int64))

    def __call__(self, i: int) -> np.ndarray:
        with self.lock:
            rows = self.order.rows(i, self.batch)
        got: np.ndarray = self.a[rows]
        return got

    def indices(self, first: int, end: int) -> np.ndarray:
        """The rows of queries ``first .. end-1``, query after query."""
        n = max(end - first, 0)
        with self.lock:
            return self.order.positions(first * self.batch, n * self.batch)

    def block(self, first: int, end: int) -> np.ndarray:
        got: np.ndarray = self.a[self.indices(first, end)]
        return got

    def span(self, first: int, end: int) -> np.ndarray:
        return self.block(first, end).reshape(max(end - first, 0), self._width)


Feeders = tuple[QueryRows, QueryRows | None]
"""(inputs(i), labels or None) for the queries of one batch size."""


def stream(seed: int, which: int) -> np.random.Generator:
    """The generator of one random dimension (``which``) of ``seed``."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    return np.random.default_rng(np.random.SeedSequence(int(seed)).spawn(_STREAMS)[which])


class SampleOrder:
    """The endless seeded sample order of one data set (see the module docstring).

    Permutations are drawn lazily, in order, from the sample stream and kept, so a
    query's rows cost one slice once its cycle was drawn. Not thread-safe: one owner
    (the load generator's event loop, or the code building payloads before a run).
    """

    def __init__(self, dataset_size: int, seed: int) -> None:
        if dataset_size < 1:
            raise ConfigError(f"dataset_size must be >= 1, got {dataset_size}")
        self.dataset_size = int(dataset_size)
        self.seed = seed
        self._rng = stream(seed, SAMPLE_STREAM)
        self._cycles: list[np.ndarray] = []

    def positions(self, start: int, count: int) -> np.ndarray:
        """Rows at positions ``start .. start+count-1`` of the order (``int64``)."""
        if start < 0 or count < 0:
            raise ConfigError(f"need start >= 0 and count >= 0, got {start} and {count}")
        n = self.dataset_size
        last_cycle = (start + count - 1) // n if count else -1
        while len(self._cycles) <= last_cycle:
            self._cycles.append(self._rng.permutation(n).astype(np.int64))
        pos = np.arange(start, start + count, dtype=np.int64)
        if not count:
            return pos
        first = start // n
        # A query within one cycle (the usual case, on every query's path) indexes
        # that cycle; only one that spans a cycle's end joins the two.
        cycles = self._cycles[first : last_cycle + 1]
        flat = cycles[0] if len(cycles) == 1 else np.concatenate(cycles)
        rows: np.ndarray = flat[pos - first * n]
        return rows

    def rows(self, query: int, samples_per_query: int = 1) -> np.ndarray:
        """The data-set rows query ``query`` (its global index) carries."""
        if samples_per_query < 1:
            raise ConfigError(f"samples_per_query must be >= 1, got {samples_per_query}")
        return self.positions(query * samples_per_query, samples_per_query)


def sample_indices(
    n_queries: int, dataset_size: int, seed: int = 0, *, samples_per_query: int = 1
) -> np.ndarray:
    """The rows of queries ``0 .. n_queries-1``: ``n_queries * samples_per_query``
    indices, query ``i`` using ``out[i*spq:(i+1)*spq]`` (:class:`SampleOrder`)."""
    if dataset_size < 1 or n_queries < 0 or samples_per_query < 1:
        raise ConfigError("need dataset_size >= 1, n_queries >= 0 and samples_per_query >= 1")
    return SampleOrder(dataset_size, seed).positions(0, n_queries * samples_per_query)


def dataset(entry: Entry, zoo_dir: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """The manifest's labelled data set (inputs, labels), or None when it names none."""
    path = entry.dataset(zoo_dir)
    if path is None:
        return None
    with np.load(path) as npz:
        return npz["x"], npz["y"]


def table(
    data: tuple[np.ndarray, np.ndarray] | None, shape: tuple[int, ...], seed: int
) -> tuple[np.ndarray, np.ndarray | None]:
    """The rows a run draws from: the data set (inputs, labels), or for a model with
    none :data:`FILL_ROWS` synthetic rows from the seed's fill stream (fewer for an input
    so large their draw would pass :data:`FILL_MAX_BYTES`) and no labels."""
    if data is None:
        per_row = math.prod(shape) * np.dtype(np.float64).itemsize
        rows = max(1, min(FILL_ROWS, FILL_MAX_BYTES // max(1, per_row)))
        x = stream(seed, FILL_STREAM).standard_normal((rows, *shape))
        return x.astype(np.float32), None
    return data


def feeders(
    data: tuple[np.ndarray, np.ndarray] | None, shape: tuple[int, ...], batch: int, seed: int
) -> Feeders:
    """Query i's raw inputs (and labels) from the run's rows (:func:`table`)."""
    x, y = table(data, shape, seed)
    return feed(x, y, batch, seed)


def feed(x: np.ndarray, y: np.ndarray | None, batch: int, seed: int) -> Feeders:
    """Query i's rows of ``x`` (and ``y``): the rows :class:`SampleOrder` gives it
    (seeded permutations of the rows, a fresh one per cycle; the sample order has its
    own seed stream, independent of the arrival schedule's). ``x`` may be the rows
    pre-processed (an agent holding its samples): the order depends only on their
    number, so it is the same.

    Both functions may be called from several threads (an agent's local closed loop
    issues from its predict threads): the order is drawn under a lock.
    """
    order = SampleOrder(len(x), seed)
    lock = threading.Lock()
    inputs = QueryRows(x, order, lock, batch)
    return inputs, (None if y is None else QueryRows(y, order, lock, batch))


def scored(feed: Feeders, manifest: Any) -> Feeders:
    """Labels only for a model scored by top-k: a detector's or a latency-only model's
    top-1 would be a meaningless number (it shows none)."""
    ok = manifest.dataset is not None and manifest.dataset.metric in ("top1", "top5")
    return feed if ok else (feed[0], None)


_INT32_EXACT = frozenset(
    np.dtype(t) for t in (np.bool_, np.int8, np.int16, np.int32, np.uint8, np.uint16)
)
"""Element types whose every value is an int32 as it is."""
_INT32_MIN, _INT32_END = -(2**31), 2**31


def top1(outputs: Any) -> np.ndarray | None:
    """Each sample's predicted class (int32): the first value of its post-processed
    output (argmax or the first of top-k), as the load generator scores it, -1 where
    that value can be no class index (not a number, infinite, past int32, not a real
    number: a model's outputs are whatever it computes, and an agent's are untrusted);
    None when the outputs have no per-sample values. A served load generator scores
    each reply on its reader thread: top-k's int32 and one sample take ~1-3 µs, numpy's
    checks of a whole column ~10."""
    if not (isinstance(outputs, np.ndarray) and outputs.size and outputs.ndim >= 1):
        return None
    first = outputs.reshape(outputs.shape[0], -1)[:, 0]
    if first.dtype in _INT32_EXACT:  # top-k and argmax: no copy, no checks
        return first.astype(np.int32, copy=False)
    if len(first) == 1:
        v = first[0].item()  # NaN fails both comparisons; complex, bytes, str are no index
        fits = isinstance(v, int | float) and _INT32_MIN <= v < _INT32_END
        return np.array([int(v) if fits else -1], np.int32)  # toward zero, as int() is
    out = np.full(len(first), -1, np.int32)
    kind = first.dtype.kind
    if kind in "iuf":
        if kind == "f" and first.dtype.itemsize < 4:  # int32's bounds are past float16's
            first = first.astype(np.float32)
        ok = first < _INT32_END if kind == "u" else (first >= _INT32_MIN) & (first < _INT32_END)
        out[ok] = first[ok].astype(np.int32)
    return out
