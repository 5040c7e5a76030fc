"""MLPerf early stopping: how many queries a run needs before its latency percentile
can be claimed, and the bound it supports.

Early stopping (MLPerf LoadGen, ``early_stopping.cc`` and ``results.cc``; the idea, not
the code). Treat each query as a Bernoulli trial that is "over" a latency threshold with
probability ``1 - q``, where ``q = percentile/100 - tolerance``. If ``t`` of ``h + t``
queries are over, the chance of seeing so few overs when the true percentile is *not*
met is the binomial CDF::

    odds(h, t) = P[Binomial(h + t, 1 - q) <= t] = I_q(h, t + 1)

(``I`` is the regularized incomplete beta function; scipy's ``special.bdtr`` computes
the binomial CDF through it). ``min_passing_queries(t)`` is the
least ``h`` with ``odds(h, t) < 1 - confidence``; a run of ``n`` queries supports the
claim "the percentile is at most the ``t``-th largest latency" for the largest ``t``
with ``h(t) + t <= n``. The sample at rank ``n - t`` is itself counted as one of the
``t``, so with zero latencies *above* the estimate (``t = 1``) a run needs
``h(1) + 1`` queries: 64 for p90 and 662 for p99 at 99% confidence, MLPerf's published
"Processed at least 64 queries" figures. For a fixed bound (the server scenario) ``t``
counts latencies strictly over the bound and the run needs ``h(t) + t`` queries.

Percentiles are given in percent (90, 99) as in :mod:`mlscope.stats`, whose nearest-rank
percentile is the one used here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "EarlyStoppingEstimate",
    "early_stopping_min_queries",
    "early_stopping_percentile_bound",
    "early_stopping_queries_needed",
    "finite",
    "min_passing_queries",
]

Array = npt.ArrayLike


def _q(percentile: float, tolerance: float) -> float:
    if not 0 < percentile < 100:
        raise ValueError(f"percentile must be in (0, 100), got {percentile}")
    q = percentile / 100.0 - tolerance
    if not 0 < q < 1:
        raise ValueError(f"percentile - tolerance must be in (0, 1), got {q}")
    return q


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def min_passing_queries(
    over: int, percentile: float, confidence: float = 0.99, tolerance: float = 0.0
) -> int:
    """Least ``h`` with ``P[Binomial(h + over, 1 - q) <= over] < 1 - confidence``.

    That many queries at or under a latency, beside ``over`` queries above it, show with
    ``confidence`` that the ``percentile`` is at most that latency (MLPerf's
    ``find_min_passing``).
    """
    if over < 0:
        raise ValueError(f"over must be >= 0, got {over}")
    _check_confidence(confidence)
    q = _q(percentile, tolerance)
    alpha = 1.0 - confidence
    lo = max(1, math.floor(over * q / (1.0 - q)))  # below the mean count nothing passes
    hi = lo
    while _odds(hi, over, q) >= alpha:
        lo, hi = hi + 1, hi * 2
    while lo < hi:  # least h in [lo, hi] that passes; odds fall as h grows
        mid = (lo + hi) // 2
        if _odds(mid, over, q) < alpha:
            hi = mid
        else:
            lo = mid + 1
    return hi


def _odds(passing: int, over: int, q: float) -> float:
    """``P[Binomial(passing + over, 1 - q) <= over]``: the chance of so few overs when the
    percentile is not met (the module docstring's ``odds``)."""
    from scipy import special  # ~0.25 s to import: only where a run is judged

    return float(special.bdtr(over, passing + over, 1.0 - q))


def early_stopping_min_queries(
    percentile: float, confidence: float = 0.99, tolerance: float = 0.0
) -> int:
    """Fewest queries that give an early-stopping estimate with none above it (64 for p90)."""
    return min_passing_queries(1, percentile, confidence, tolerance) + 1


@dataclass(frozen=True, slots=True)
class EarlyStoppingEstimate:
    """A conservative percentile: the ``rank``-th smallest latency, ``discarded`` above it."""

    estimate: float
    rank: int
    discarded: int
    queries: int
    min_queries: int


def early_stopping_percentile_bound(
    latencies: Array, percentile: float, confidence: float = 0.99, tolerance: float = 0.0
) -> EarlyStoppingEstimate | None:
    """MLPerf's early-stopping estimate of the ``percentile``; None below the minimum count.

    The estimate is the ``t``-th largest latency for the largest ``t`` with
    ``min_passing_queries(t) + t <= n``: with ``confidence`` the true percentile is no
    higher. It is never below the nearest-rank percentile of the same samples.
    """
    data = np.sort(finite(latencies))
    n = int(data.size)
    need = early_stopping_min_queries(percentile, confidence, tolerance)
    if n < need:
        return None

    def fits(t: int) -> bool:
        return min_passing_queries(t, percentile, confidence, tolerance) + t <= n

    lo, hi = 1, n  # fits(1) holds; h(t) + t grows with t, so bisect for the last fit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return EarlyStoppingEstimate(float(data[n - lo]), n - lo + 1, lo - 1, n, need)


def early_stopping_queries_needed(
    latencies: Array,
    bound: float,
    percentile: float,
    confidence: float = 0.99,
    tolerance: float = 0.0,
) -> int:
    """Queries a run needs to show ``percentile <= bound`` given its latencies over ``bound``."""
    over = int(np.count_nonzero(finite(latencies) > bound))
    return min_passing_queries(over, percentile, confidence, tolerance) + over


def finite(values: Array) -> npt.NDArray[np.float64]:
    """``values`` as float64, without NaN and infinities."""
    arr = np.asarray(values, dtype=np.float64).ravel()
    return arr[np.isfinite(arr)]
