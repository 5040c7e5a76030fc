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
def student_t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (real ``df`` too:
    Welch-Satterthwaite gives fractional ones); scipy's inverse of the t CDF."""
    if not 0 < p < 1 or df <= 0:
        raise ValueError(f"need 0 < p < 1 and df > 0, got p={p}, df={df}")
    from scipy import special  # ~0.25 s to import: only where an interval is computed

    return float(special.stdtrit(df, p))


def mean_ci(
    values: Iterable[float] | np.ndarray,
    confidence: float = 0.95,
    *,
    floor: float | None = None,
) -> tuple[float | None, float | None, float | None]:
    """(mean, low, high): Student's t interval of the mean of independent runs' values;
    None bounds for fewer than two values (one run cannot show run-to-run noise).

    ``floor``: the least value the quantity can take (0 for a latency or a
    throughput). The t interval is symmetric, so over two or three noisy runs its low
    end can fall below it (a negative p99); it is then cut at ``floor``, which keeps
    its coverage (the true mean is never below it)."""
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
    low = mean - half if floor is None else max(floor, mean - half)
    return mean, low, mean + half
