"""The difference of a latency statistic between two runs, its interval and verdict.

The difference of a statistic (median, p99) between a baseline run A and a candidate
run B is ``stat(B) - stat(A)``. Its confidence interval is the percentile bootstrap:
resample A and B independently with replacement ``n_boot`` times, compute the
difference each time, take the (α/2, 1-α/2) quantiles of those differences (Efron &
Tibshirani, *An Introduction to the Bootstrap*, ch. 13), with mlscope's nearest-rank
percentile as the statistic. A resample's percentile is drawn from its exact
bootstrap distribution (an order statistic's, :func:`bootstrap_percentiles`: one Beta
draw) rather than by resampling n values ``n_boot`` times: the same interval in
distribution, checked against ``scipy.stats.bootstrap`` with ``method="percentile"``,
``paired=False``, at a cost that does not grow with n times ``n_boot``. The verdict:

* ``slower`` — the interval lies above 0 and the point difference is at least
  ``min_effect`` of A's statistic;
* ``faster`` — the interval lies below 0, same effect-size rule;
* ``no significant change`` — otherwise.

The effect-size floor keeps two runs of the same system from being called different
for a statistically real but meaningless 0.1 % (long runs make every CI narrow). The
floor is higher for the tail (p99): the percentile bootstrap of an extreme quantile
is known to under-cover (its resamples can only repeat the few largest samples), so
a tail difference must also be large to count.

Over repeated runs, :func:`run_level_difference` takes each run's statistic as one
sample and gives Welch's t interval of the difference of the means over runs, with
the same verdict rule. Which runs are compared, and how they are read from the
evaluation database, is :mod:`analysis.compare`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mlscope.stats import nearest_rank, percentile, student_t_quantile

__all__ = [
    "FASTER",
    "SAME",
    "SLOWER",
    "Difference",
    "bootstrap_difference",
    "bootstrap_percentiles",
    "resampled_percentile",
    "run_level_difference",
]

FASTER, SLOWER, SAME = "faster", "slower", "no significant change"


@dataclass(frozen=True)
class Difference:
    statistic: str
    a: float
    b: float
    diff: float
    rel: float
    ci_low: float
    ci_high: float
    verdict: str


def resampled_percentile(samples: np.ndarray, q: float, idx: np.ndarray) -> np.ndarray:
    """The nearest-rank percentile (mlscope.stats' definition) of each resample.

    ``idx`` is (replicates, n) indices into ``samples``; row r's result equals
    ``mlscope.stats.percentile(samples[idx[r]], q)`` (tested), vectorized.
    """
    return _nearest_rank(samples[idx], q, axis=1)


def _nearest_rank(x: np.ndarray, q: float, axis: int) -> np.ndarray:
    """:func:`mlscope.stats.nearest_rank`'s percentile along ``axis`` (rows of
    resamples), vectorized."""
    k = nearest_rank(x.shape[axis], q)
    return np.asarray(np.take(np.sort(x, axis=axis), k - 1, axis=axis))


def bootstrap_percentiles(
    sorted_samples: np.ndarray, q: float, n_boot: int, rng: np.random.Generator
) -> np.ndarray:
    """``n_boot`` draws of the nearest-rank ``q``-th percentile of a bootstrap resample
    of ``sorted_samples`` (n values, ascending), without resampling.

    A resample draws n indices floor(n U_i), U_i uniform on [0, 1); floor is
    monotone, so its k-th smallest index (k the nearest rank) is floor(n U_(k)), and
    the k-th smallest of n uniforms is Beta(k, n - k + 1) distributed. One Beta draw
    per replicate therefore has the statistic's exact bootstrap distribution (ties
    included: equal values are equal outcomes), in O(n_boot) where resampling costs
    O(n_boot n log n) (tested against resampling)."""
    n = sorted_samples.size
    k = nearest_rank(n, q)
    at = (rng.beta(k, n - k + 1, size=n_boot) * n).astype(np.int64)
    return np.asarray(sorted_samples[np.minimum(at, n - 1)])


def bootstrap_difference(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    q: float = 50.0,
    *,
    n_boot: int = 2000,
    confidence: float = 0.95,
    min_effect: float = 0.02,
    seed: int = 0,
    statistic: str | None = None,
) -> Difference:
    """CI of percentile_q(b) - percentile_q(a) and the verdict (see module docstring)."""
    xa, xb = np.asarray(a, float), np.asarray(b, float)
    xa, xb = np.sort(xa[~np.isnan(xa)]), np.sort(xb[~np.isnan(xb)])
    if xa.size == 0 or xb.size == 0:
        raise ValueError("both runs need at least one latency sample")
    pa, pb = float(percentile(xa, q) or 0.0), float(percentile(xb, q) or 0.0)
    rng = np.random.default_rng(seed)
    # A and B resampled independently: each replicate's statistic drawn from its own
    # exact bootstrap distribution, then the differences' percentile interval.
    diffs = bootstrap_percentiles(xb, q, n_boot, rng) - bootstrap_percentiles(xa, q, n_boot, rng)
    alpha = (1 - confidence) / 2
    lo, hi = np.percentile(diffs, [100 * alpha, 100 * (1 - alpha)])
    return _difference(statistic or f"p{q:g}", pa, pb, float(lo), float(hi), min_effect)


def run_level_difference(
    a: Sequence[float],
    b: Sequence[float],
    *,
    statistic: str,
    confidence: float = 0.95,
    min_effect: float = 0.02,
) -> Difference:
    """mean(b) - mean(a) over independent runs, Welch's t interval (unequal variances,
    Welch-Satterthwaite degrees of freedom); the verdict rule of the module docstring.
    Each side needs at least two runs."""
    xa, xb = np.asarray(a, float), np.asarray(b, float)
    if xa.size < 2 or xb.size < 2:
        raise ValueError("run-level statistics need at least two runs on each side")
    ma, mb = float(xa.mean()), float(xb.mean())
    va, vb = xa.var(ddof=1) / xa.size, xb.var(ddof=1) / xb.size
    se = math.sqrt(va + vb)
    diff = mb - ma
    if se == 0:
        lo = hi = diff
    else:
        df = (va + vb) ** 2 / (
            (va**2 / (xa.size - 1) if va else 0.0) + (vb**2 / (xb.size - 1) if vb else 0.0)
        )
        half = student_t_quantile(0.5 + confidence / 2, df) * se
        lo, hi = diff - half, diff + half
    return _difference(statistic, ma, mb, float(lo), float(hi), min_effect)


def _difference(
    statistic: str, a: float, b: float, lo: float, hi: float, min_effect: float
) -> Difference:
    """B - A with its interval ``lo .. hi`` and the verdict of the module docstring:
    slower or faster only when the interval excludes 0 and the change is at least
    ``min_effect`` of A."""
    diff = b - a
    rel = diff / a if a else float("inf") if diff else 0.0
    big = abs(rel) >= min_effect
    verdict = SLOWER if lo > 0 and big else FASTER if hi < 0 and big else SAME
    return Difference(statistic, a, b, diff, rel, lo, hi, verdict)
