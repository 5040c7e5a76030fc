"""mlscope's statistics as ClickHouse expressions, so the database computes them.

The definitions are :mod:`mlscope.stats`' and :mod:`mlscope.outcomes`'; this module
only writes them in SQL, once, and ``tests/test_sqlstats.py`` checks that chDB's
answers equal the Python functions' on random data (ties, n = 1, n = 2, p = 1 included):

* percentile, nearest rank: for sorted samples x_1..x_n, P_q = x_k with
  k = ceil(q/100 * n) clamped to [1, n] (:func:`mlscope.stats.nearest_rank`).
  ClickHouse's ``quantileExact`` picks another rank for some n and q, so it is not
  used: the samples are gathered into one sorted array per group and indexed at k,
  with the same float64 arithmetic as Python's ``math.ceil(q / 100.0 * n)``;
* trimmed mean: floor(0.2 n) samples dropped at each end of the sorted samples, the
  rest averaged (:func:`mlscope.stats.trimmed_mean`); the average is summed in
  another order than numpy's, so it agrees to rounding (~1e-15 relative), not bits;
* a query's outcome (:func:`mlscope.outcomes.classify`): the stored ``outcome``, or,
  for rows stored before outcomes were recorded (255), derived from the times.

An expression takes the name of a *sorted* array column (:func:`sorted_ms`), so a
query sorts the samples of a group once and reads every statistic from that array.
"""

from __future__ import annotations

from mlscope.outcomes import UNKNOWN_OUTCOME, Outcome
from mlscope.stats import TRIM_FRACTION

__all__ = ["OUTCOME", "percentile", "sorted_ms", "trimmed_mean"]

OUTCOME = (
    f"if(outcome != {UNKNOWN_OUTCOME}, outcome, "
    f"if(issued_ns > 0 OR completed_ns > 0, "
    f"if(completed_ns > 0, if(ok != 0, {int(Outcome.OK)}, {int(Outcome.FAILED)}), "
    f"{int(Outcome.LOST)}), {int(Outcome.NOT_ISSUED)}))"
)
"""A ``queries`` row's :class:`~mlscope.outcomes.Outcome` (UInt8): stored, or for rows
stored before outcomes were recorded classified from the times like
:func:`mlscope.outcomes.classify` without refusals (they then count as failed)."""


def _number(x: float) -> str:
    """A float literal ClickHouse reads as the same float64 (``repr`` round-trips)."""
    return repr(float(x))


def sorted_ms(ns_expr: str, condition: str = "1") -> str:
    """Aggregate: the values of ``ns_expr`` (nanoseconds) where ``condition`` holds,
    sorted, in milliseconds (each value / 1e6, as Python's ``ns / 1e6``)."""
    return f"arrayMap(x -> x / 1e6, arraySort(groupArrayIf({ns_expr}, {condition})))"


def percentile(array: str, q: float) -> str:
    """Nearest-rank ``q``-th percentile (0 < q <= 100) of the sorted array column
    ``array``; NULL for an empty array."""
    if not 0 < q <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {q}")
    n = f"length({array})"
    k = f"least(greatest(toUInt64(ceil({_number(q)} / 100.0 * {n})), 1), {n})"
    return f"if({n} = 0, NULL, toFloat64({array}[{k}]))"


def trimmed_mean(array: str, fraction: float = TRIM_FRACTION) -> str:
    """Mean of the sorted array column ``array`` after dropping floor(fraction * n)
    values at each end (all of them kept when that would leave none); NULL when
    empty."""
    n = f"toInt64(length({array}))"
    cut = f"toInt64(floor({_number(fraction)} * {n}))"
    kept = f"if({n} - 2 * {cut} > 0, arraySlice({array}, {cut} + 1, {n} - 2 * {cut}), {array})"
    return f"if({n} = 0, NULL, arrayAvg({kept}))"
