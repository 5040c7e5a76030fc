"""Which data-set rows each query carries: one seeded sample order for every run.

Randomness, MLPerf-style: each random dimension of a run has its own stream, derived
from the one user seed with ``np.random.SeedSequence(seed).spawn(...)`` (a child's
stream depends only on its index, so adding a stream never changes the others):

* :data:`ARRIVAL_STREAM` draws arrival times (``broker.schedule``),
* :data:`SAMPLE_STREAM` draws the sample order (:class:`SampleOrder`),
* :data:`FILL_STREAM` draws synthetic inputs for a model without a data set.

Changing the rate or the scenario therefore never changes which samples are sent.

The order walks through seeded permutations of ``range(dataset_size)``, a fresh one
per cycle: no sample repeats before every sample was used once, and each cycle is a
permutation of its own. Query ``i`` of ``b`` samples takes positions ``i*b .. i*b+b-1``
of that endless sequence, so a query's rows depend only on the seed, the data-set
size, the batch size and its global index: the server, a load-generator process on
another host or an agent computes the same rows from those four numbers.
"""

from __future__ import annotations

import numpy as np

from mlscope.errors import ConfigError

__all__ = [
    "ARRIVAL_STREAM",
    "FILL_STREAM",
    "SAMPLE_STREAM",
    "SampleOrder",
    "sample_indices",
    "stream",
]

ARRIVAL_STREAM = 0
"""Index of the arrival-time stream among the seed's children."""
SAMPLE_STREAM = 1
"""Index of the sample-order stream."""
FILL_STREAM = 2
"""Index of the stream synthetic inputs are drawn from (a model with no data set)."""
_STREAMS = 3


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
        flat = np.concatenate(self._cycles[first : last_cycle + 1])
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
