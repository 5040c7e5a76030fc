"""The one definition of every statistic mlscope reports.

* Percentile: nearest rank, as MLPerf LoadGen reports it. For sorted samples
  x_1..x_n, P_q = x_k with k = ceil(q/100 * n) (k clamped to [1, n]). Nearest rank
  always returns an observed sample, never an interpolated one.
* Trimmed mean (the paper's, section 5): drop floor(0.2 n) samples from each end of
  the sorted samples and average the rest.

Everything else (the dashboard, reports, the CLI) calls these functions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "TRIM_FRACTION",
    "describe_ms",
    "mean_ci",
    "nearest_rank",
    "percentile",
    "percentiles",
    "regularized_beta",
    "student_t_quantile",
    "trimmed_mean",
]

TRIM_FRACTION = 0.2


def _sorted(samples: Iterable[float] | np.ndarray) -> np.ndarray:
    arr = np.asarray(samples if isinstance(samples, np.ndarray) else list(samples), float)
    return np.sort(arr[~np.isnan(arr)])


def nearest_rank(n: int, q: float) -> int:
    """The 1-based rank k of the nearest-rank q-th percentile of n sorted samples:
    ceil(q/100 * n), clamped to [1, n] (n >= 1, 0 < q <= 100)."""
    if not 0 < q <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {q}")
    return min(max(math.ceil(q / 100.0 * n), 1), n)


def percentile(samples: Iterable[float] | np.ndarray, q: float) -> float | None:
    """Nearest-rank q-th percentile (0 < q <= 100); None for no samples."""
    return percentiles(samples, [q])[0]


def percentiles(samples: Iterable[float] | np.ndarray, qs: Sequence[float]) -> list[float | None]:
    data = _sorted(samples)
    n = data.size
    if n == 0:
        return [None for _ in qs]
    return [float(data[nearest_rank(n, q) - 1]) for q in qs]


def trimmed_mean(
    samples: Iterable[float] | np.ndarray, fraction: float = TRIM_FRACTION
) -> float | None:
    """Mean after dropping floor(fraction*n) samples at each end; None for no samples."""
    data = _sorted(samples)
    n = data.size
    if n == 0:
        return None
    cut = math.floor(fraction * n)
    kept = data[cut : n - cut] if n - 2 * cut > 0 else data
    return float(kept.mean())


def describe_ms(samples_ns: np.ndarray) -> dict[str, float | None]:
    """trimmed_mean, p50, p90, p99 and max of nanosecond samples, in milliseconds."""
    ms = np.asarray(samples_ns, dtype=float) / 1e6
    p50, p90, p99 = percentiles(ms, [50, 90, 99])
    finite = ms[~np.isnan(ms)]
    return {
        "trimmed_mean": trimmed_mean(ms),
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "max": float(finite.max()) if finite.size else None,
    }


# --- the regularized incomplete beta function, by Lentz's continued fraction ---------
# I_x(a, b) = x^a (1-x)^b / (a B(a, b)) * 1/(1+ d1/(1+ d2/(1+ ...))) with
# d_{2m+1} = -(a+m)(a+b+m) x / ((a+2m)(a+2m+1)),  d_{2m} = m(b-m) x / ((a+2m-1)(a+2m)),
# (DLMF 8.17.22), converging fast for x < (a+1)/(a+b+2); use I_x(a,b) = 1 - I_{1-x}(b,a)
# otherwise. Pure Python so that mlscope needs no scipy; tests check it against scipy.
# Used by early stopping (mlscope.validity) and Student's t (mean_ci).

_TINY = 1e-300


def _beta_cf(a: float, b: float, x: float) -> float:
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, 100_000):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + num / c
            c = c if abs(c) > _TINY else _TINY
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def regularized_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_cf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_cf(b, a, 1.0 - x) / b


def _t_cdf(t: float, df: float) -> float:
    """Student's t CDF: 1 - I_{df/(df+t^2)}(df/2, 1/2) / 2 for t >= 0 (DLMF 8.17)."""
    tail = 0.5 * regularized_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def student_t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection)."""
    if not 0 < p < 1 or df <= 0:
        raise ValueError(f"need 0 < p < 1 and df > 0, got p={p}, df={df}")
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def mean_ci(
    values: Iterable[float] | np.ndarray, confidence: float = 0.95
) -> tuple[float | None, float | None, float | None]:
    """(mean, low, high): Student's t interval of the mean of independent runs' values;
    None bounds for fewer than two values (one run cannot show run-to-run noise)."""
    data = _sorted(values)
    if data.size == 0:
        return None, None, None
    mean = float(data.mean())
    if data.size < 2:
        return mean, None, None
    half = (
        student_t_quantile(0.5 + confidence / 2, data.size - 1)
        * float(data.std(ddof=1))
        / math.sqrt(data.size)
    )
    return mean, mean - half, mean + half
