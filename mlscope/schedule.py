"""Seeded, reproducible query schedules: when each query is due and which samples it uses.

A schedule is a sorted ``int64`` array of offsets in nanoseconds from the run start
(:class:`Schedule`). It is computed entirely before the run, so the pacer only reads it
and a run can be reproduced from its spec alone (F1).

Randomness, MLPerf-style: each random dimension has its own stream, derived from the
one user seed (:mod:`mlscope.samples`): arrival times here (:func:`poisson`,
:func:`piecewise`) come from its arrival stream, the sample order of every query
(:class:`mlscope.samples.SampleOrder`) from its sample stream.

Changing the rate therefore never changes which samples are sent, and Poisson schedules
are drawn as unit-rate gaps scaled by ``1/rate``, so two rates with one seed share the
same arrival *pattern* (common random numbers: a peak search compares rates, not noise).

Timing conventions: the first arrival comes one gap after the start (offset > 0 for
every generator but a replay file, :mod:`mlscope.replay_file`, with a leading 0), so
``n / offsets[-1]`` estimates the rate for periodic and Poisson schedules alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from mlscope import scenario_traits
from mlscope.contracts import MAX_SCHEDULED_QUERIES, ScenarioSpec
from mlscope.errors import ConfigError
from mlscope.samples import ARRIVAL_STREAM, stream

__all__ = [
    "Arrivals",
    "Schedule",
    "build_schedule",
    "constant",
    "constant_arrivals",
    "cut",
    "deal",
    "merge",
    "merge_values",
    "multi_stream",
    "multi_stream_arrivals",
    "piecewise",
    "piecewise_arrivals",
    "poisson",
    "poisson_arrivals",
    "replay_arrivals",
]

NS_PER_S = 1_000_000_000
_CHUNK = 65_536


@dataclass(frozen=True, slots=True)
class Schedule:
    """Scheduled offsets of queries, in ns from the run start, and their global indices.

    ``index[i]`` is the position of query ``i`` in the global schedule: ``arange(n)``
    for a whole schedule, ``arange(j, n, k)`` for slice ``j`` of :func:`deal`.
    """

    offsets_ns: np.ndarray
    samples_per_query: int = 1
    index: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))

    def __post_init__(self) -> None:
        offsets = np.ascontiguousarray(self.offsets_ns, dtype=np.int64)
        if offsets.ndim != 1:
            raise ConfigError("schedule offsets must be one-dimensional")
        if offsets.size and (offsets[0] < 0 or np.any(np.diff(offsets) < 0)):
            raise ConfigError("schedule offsets must be non-negative and non-decreasing")
        if self.samples_per_query < 1:
            raise ConfigError(f"samples_per_query must be >= 1, got {self.samples_per_query}")
        index = np.asarray(self.index, dtype=np.int64)
        if index.size == 0:
            index = np.arange(offsets.size, dtype=np.int64)
        if index.shape != offsets.shape:
            raise ConfigError("schedule index and offsets differ in length")
        object.__setattr__(self, "offsets_ns", offsets)
        object.__setattr__(self, "index", index)

    def __len__(self) -> int:
        return int(self.offsets_ns.size)

    @property
    def duration_s(self) -> float:
        """Offset of the last query in seconds (0 for an empty schedule)."""
        return float(self.offsets_ns[-1]) / NS_PER_S if self.offsets_ns.size else 0.0


def _check_rate(rate: float) -> float:
    if not (math.isfinite(rate) and rate > 0):
        raise ConfigError(f"rate must be a positive finite number, got {rate!r}")
    return float(rate)


def _one_bound(duration_s: float | None, n: int | None) -> None:
    if (duration_s is None) == (n is None):
        raise ConfigError("give exactly one of duration_s and n")
    if n is not None and n < 0:
        raise ConfigError(f"n must be >= 0, got {n}")
    if duration_s is not None and not (math.isfinite(duration_s) and duration_s >= 0):
        raise ConfigError(f"duration_s must be a finite number >= 0, got {duration_s!r}")


def _within_limit(expected: float) -> None:
    """Refuse a schedule of about ``expected`` queries over :data:`MAX_SCHEDULED_QUERIES`."""
    if expected > MAX_SCHEDULED_QUERIES:
        raise ConfigError(
            f"the schedule would hold about {expected:.3g} queries, over the "
            f"{MAX_SCHEDULED_QUERIES:,} one run may have: lower the rate or the duration",
            limit=MAX_SCHEDULED_QUERIES,
        )


def _to_ns(seconds: np.ndarray) -> np.ndarray:
    ns: np.ndarray = np.rint(seconds * NS_PER_S).astype(np.int64)
    return ns


def _unit_arrivals(rng: np.random.Generator, *, until: float | None, n: int | None) -> np.ndarray:
    """Arrival times of a unit-rate Poisson process: the first n, or all up to ``until``.

    Drawn in chunks from one generator, so a prefix never depends on how many arrivals
    were asked for (``until`` and ``n`` give the same leading arrivals).
    """
    _within_limit(until if until is not None else n or 0)
    if until is None:
        return np.cumsum(rng.standard_exponential(n or 0))
    parts: list[np.ndarray] = []
    last = 0.0
    while last <= until:
        chunk = last + np.cumsum(rng.standard_exponential(_CHUNK))
        parts.append(chunk)
        last = float(chunk[-1])
    arrivals = np.concatenate(parts) if parts else np.empty(0)
    return arrivals[: np.searchsorted(arrivals, until, side="right")]


def poisson(
    rate: float, *, duration_s: float | None = None, n: int | None = None, seed: int = 0
) -> Schedule:
    """Poisson arrivals at ``rate`` queries/s: the first ``n``, or all within ``duration_s``.

    Inter-arrival gaps are ``Exp(1)/rate`` from the arrival stream of ``seed``.
    """
    rate = _check_rate(rate)
    _one_bound(duration_s, n)
    until = None if duration_s is None else duration_s * rate
    unit = _unit_arrivals(stream(seed, ARRIVAL_STREAM), until=until, n=n)
    return Schedule(_to_ns(unit / rate))


def _periodic(period_s: float, *, duration_s: float | None, n: int | None) -> np.ndarray:
    _one_bound(duration_s, n)
    if duration_s is not None:
        n = math.floor(duration_s / period_s + 1e-9)
    _within_limit(n or 0)
    return _to_ns((np.arange(n or 0, dtype=np.float64) + 1.0) * period_s)


def constant(rate: float, *, duration_s: float | None = None, n: int | None = None) -> Schedule:
    """Evenly spaced arrivals at ``rate`` queries/s, the first one period after the start."""
    return Schedule(_periodic(1.0 / _check_rate(rate), duration_s=duration_s, n=n))


def multi_stream(interval_s: float, samples_per_query: int, n: int) -> Schedule:
    """``n`` queries of ``samples_per_query`` samples each, one every ``interval_s`` seconds."""
    if not (math.isfinite(interval_s) and interval_s > 0):
        raise ConfigError(f"interval_s must be a positive finite number, got {interval_s!r}")
    return Schedule(_periodic(interval_s, duration_s=None, n=n), samples_per_query)


def piecewise(segments: Sequence[tuple[float, float, float]], *, seed: int = 0) -> Schedule:
    """Non-homogeneous Poisson arrivals for ramps and bursts, by time-rescaling.

    Each segment ``(rate_start, rate_end, seconds)`` has a rate that moves linearly from
    ``rate_start`` to ``rate_end`` (equal rates give a flat segment; 0 gives a pause).
    Time-rescaling theorem: if ``s_1 < s_2 < ...`` are unit-rate Poisson arrivals, then
    ``t_k = Λ⁻¹(s_k)`` with ``Λ(t) = ∫₀ᵗ λ(u) du`` are arrivals of the process with
    intensity ``λ``. For ``λ(t) = a + b t`` inside a segment, ``Λ(t) = a t + b t²/2`` and
    the inverse is ``t = 2u / (a + sqrt(a² + 2 b u))``, stable for ``b = 0`` and ``a = 0``.
    Exact (no thinning, no rejected draws); segment j holds Poisson(mass_j) arrivals.
    """
    if not segments:
        raise ConfigError("piecewise schedule needs at least one segment")
    seg = np.asarray(segments, dtype=np.float64)
    if seg.ndim != 2 or seg.shape[1] != 3:
        raise ConfigError("segments must be (rate_start, rate_end, seconds) triples")
    a, c, length = seg[:, 0], seg[:, 1], seg[:, 2]
    if not np.all(np.isfinite(seg)) or np.any(a < 0) or np.any(c < 0) or np.any(length <= 0):
        raise ConfigError("segment rates must be >= 0 and durations > 0 and finite")
    slope = (c - a) / length
    mass = length * (a + c) / 2.0
    mass_end = np.cumsum(mass)
    time_start = np.concatenate(([0.0], np.cumsum(length)[:-1]))
    unit = _unit_arrivals(stream(seed, ARRIVAL_STREAM), until=float(mass_end[-1]), n=None)
    j = np.minimum(np.searchsorted(mass_end, unit, side="left"), len(seg) - 1)
    u = unit - (mass_end[j] - mass[j])
    aj, bj = a[j], slope[j]
    dt = 2.0 * u / (aj + np.sqrt(aj * aj + 2.0 * bj * u))
    t = np.minimum(time_start[j] + dt, time_start[j] + length[j])
    return Schedule(np.maximum.accumulate(_to_ns(t)))


def deal(schedule: Schedule, k: int) -> list[Schedule]:
    """Deal one global schedule round-robin to ``k`` load generators (query i → slice i % k)."""
    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    return [
        Schedule(schedule.offsets_ns[j::k], schedule.samples_per_query, schedule.index[j::k])
        for j in range(k)
    ]


def merge(parts: Sequence[Schedule]) -> Schedule:
    """Restore the global schedule from dealt slices (by their global indices)."""
    if not parts:
        return Schedule(np.empty(0, np.int64))
    index = np.concatenate([p.index for p in parts])
    order = _global_order(index)
    offsets = np.concatenate([p.offsets_ns for p in parts])[order]
    return Schedule(offsets, parts[0].samples_per_query, index[order])


def merge_values(parts: Sequence[Schedule], values: Sequence[np.ndarray]) -> np.ndarray:
    """Gather per-query arrays (latencies, issue times…) from each slice into global order."""
    if len(parts) != len(values):
        raise ConfigError("each slice needs exactly one array of values")
    if any(len(p) != len(v) for p, v in zip(parts, values, strict=True)):
        raise ConfigError("each slice needs exactly one value per query")
    if not parts:
        return np.empty(0)
    order = _global_order(np.concatenate([p.index for p in parts]))
    merged: np.ndarray = np.concatenate([np.asarray(v) for v in values])[order]
    return merged


def _global_order(index: np.ndarray) -> np.ndarray:
    order = np.argsort(index, kind="stable")
    if not np.array_equal(index[order], np.arange(index.size)):
        raise ConfigError("slices do not cover the global schedule exactly once")
    return order


# --------------------------------------------------------------- arrivals of a spec
# The arrivals of the built-in open-loop scenarios (:mod:`mlscope.scenario_kinds`
# declares which scenario uses which), shared by the server and the agent's local load
# generator (``placement: agent``), which may not import the broker.

Arrivals = Callable[[ScenarioSpec], tuple[Schedule, float]]
"""A spec's open-loop schedule and the window (s) its load covers."""


def poisson_arrivals(spec: ScenarioSpec) -> tuple[Schedule, float]:
    """Poisson arrivals at ``qps`` from the seed's arrival stream (online, peak)."""
    return poisson(spec.qps, duration_s=spec.duration_s, seed=spec.seed), spec.duration_s


def constant_arrivals(spec: ScenarioSpec) -> tuple[Schedule, float]:
    """One query every ``1/qps`` s."""
    return constant(spec.qps, duration_s=spec.duration_s), spec.duration_s


def multi_stream_arrivals(spec: ScenarioSpec) -> tuple[Schedule, float]:
    """``batch_size`` samples per query, one query every ``1/qps`` s."""
    count = math.floor(spec.duration_s * spec.qps + 1e-9)
    return multi_stream(1.0 / spec.qps, spec.batch_size, count), spec.duration_s


def replay_arrivals(spec: ScenarioSpec) -> tuple[Schedule, float]:
    """Recorded inter-arrival times (``arrivals_s``)."""
    if not spec.arrivals_s:
        raise ConfigError("scenario 'replay' needs arrivals (mlscope-submit --schedule FILE)")
    gaps = np.rint(np.asarray(spec.arrivals_s, dtype=np.float64) * 1e9).astype(np.int64)
    if gaps.size and gaps.min() < 0:
        raise ConfigError("replay inter-arrival times must be >= 0")
    sched = Schedule(np.cumsum(gaps))
    return sched, sched.duration_s


def piecewise_arrivals(spec: ScenarioSpec) -> tuple[Schedule, float]:
    """Poisson with a rate that ramps and bursts (``segments``)."""
    if not spec.segments:
        raise ConfigError("scenario 'piecewise' needs segments (rate_start, rate_end, s)")
    sched = piecewise(spec.segments, seed=spec.seed)
    return sched, float(sum(s[2] for s in spec.segments))


def cut(sched: Schedule, window: float, max_queries: int | None) -> tuple[Schedule, float]:
    """``sched`` and its window, cut to the first ``max_queries`` queries when set."""
    if max_queries is not None and max_queries < len(sched):
        sched = Schedule(sched.offsets_ns[:max_queries], sched.samples_per_query)
        window = sched.duration_s
    return sched, window


def build_schedule(spec: ScenarioSpec) -> tuple[Schedule, float]:
    """The open-loop schedule of ``spec`` (its scenario's arrivals, cut to
    ``max_queries``) and the window (s) the load covers: what the server and the
    agent's local run follow alike."""
    arrivals = scenario_traits.get(spec.name).arrivals
    if arrivals is None:
        raise ConfigError(f"scenario {spec.name!r} has no open-loop schedule")
    sched, window = arrivals(spec)
    _within_limit(len(sched))  # a scenario whose arrivals are not drawn here
    return cut(sched, window, spec.max_queries)
