"""Is a run valid? Pure functions over a run's per-query arrays: its rates and issue lag,
and the verdict with its reasons; the latency percentile by MLPerf early stopping
(:mod:`mlscope.early_stopping`), a run's answers (an open loop's backlog, any loop's
gaps and final silence) by :mod:`mlscope.answering`.

Percentiles are given in percent (90, 99) as in :mod:`mlscope.stats`, whose nearest-rank
percentile is the one used here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from mlscope.answering import (
    Gap,
    Silence,
    answering_window_s,
    backlog_s,
    completion_rates,
    gaps,
    second_half_s,
    silence,
)
from mlscope.early_stopping import (
    early_stopping_min_queries,
    early_stopping_queries_needed,
    finite,
)
from mlscope.pacer import GIVE_UP_S
from mlscope.stats import percentile as nearest_rank

__all__ = [
    "ValidityPolicy",
    "Verdict",
    "achieved_rate",
    "issue_lag_ns",
    "verdict",
]

Array = npt.ArrayLike


# --- the verdict ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Verdict:
    """VALID or not, and every reason why not, in words a user can act on."""

    valid: bool
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidityPolicy:
    """What a run must meet to be VALID (defaults sized for a 10 s run on a small box)."""

    min_duration_s: float = 10.0
    """The last query must be scheduled at least this long after the start (MLPerf: 600)."""
    min_queries: int = 100
    """At least this many queries must be issued (and the duration met: both, as MLPerf)."""
    percentile: float = 99.0
    """Target latency percentile, in percent, for early stopping and the latency bound."""
    confidence: float = 0.99
    """Early-stopping confidence (MLPerf: 0.99)."""
    tolerance: float = 0.0
    """Early-stopping tolerance, a fraction subtracted from the percentile (MLPerf: 0)."""
    early_stopping: bool = True
    """Require enough completed queries for an early-stopping estimate of ``percentile``
    (off for throughput scenarios, which have no latency target: MLPerf offline)."""
    latency_bound_ns: int | None = None
    """Server scenario: the target percentile of latency must not exceed this."""
    issue_lag_percentile: float = 99.0
    """Which percentile of issue lag (issued - scheduled) is held to ``max_issue_lag_us``."""
    max_issue_lag_us: float = 500.0
    """A lagging load generator under-loads the system; this much lag is tolerated."""
    rate_tolerance: float = 0.01
    """Relative shortfall of the achieved issue rate against the scheduled rate."""
    rate_z: float = 4.0
    """Poisson allowance, in standard deviations, when the scheduled rate of a random
    schedule is compared with the requested rate (n arrivals have sd sqrt(n))."""
    max_errors: int = 0
    """Failed queries tolerated."""
    max_not_issued: int = 0
    """Queries that could not be issued (outstanding bound reached) tolerated."""
    completion_tolerance: float = 0.05
    """Overload: over the second half of an open loop's window, answered queries may
    fall short of arrivals by this fraction. A stable system answers as fast as queries
    arrive (its completions trail arrivals only by one latency, a fraction of a percent
    of a 5 s half window at millisecond latencies); an overloaded one falls behind by
    (offered - service rate) / offered and its backlog grows."""
    overload_min_queries: int = 20
    """Below this many arrivals in the second half the overload rule is not applied
    (one query more or less would be 5 %)."""
    max_silence_s: float = 1.0
    """Gap: an open or closed loop whose queries waited this long with no reply of any kind, and
    then got replies again, was paused (the agent, its host or its link), which makes
    the run INVALID and is kept out of the overload rule
    (:func:`~mlscope.answering.gaps`). A healthy agent at millisecond latencies never
    waits a second between replies with work queued (a collection or a scheduling delay
    costs milliseconds)."""
    gap_factor: float = 5.0
    """A gap must also last this many times a wait without replies that three quarters
    of the answered queries sat through (:func:`~mlscope.answering.gaps`), so that a
    slow model's ordinary wait between replies (one predict call: a batch may take
    seconds) is not one."""


def issue_lag_ns(scheduled_ns: Array, issued_ns: Array) -> npt.NDArray[np.int64]:
    """Issue lag of every issued query (``issued_ns == 0`` marks a query not issued)."""
    sched = np.asarray(scheduled_ns, dtype=np.int64)
    issued = np.asarray(issued_ns, dtype=np.int64)
    mask = issued != 0
    return np.asarray(issued[mask] - sched[mask], dtype=np.int64)


def achieved_rate(offsets_ns: Array) -> float:
    """Queries per second of offsets from the run start: ``n / last offset`` (0 if none).

    Applied to scheduled offsets it gives the scheduled rate, to the issue offsets of
    the issued queries the achieved issue rate; both count from the same run start.
    """
    arr = np.asarray(offsets_ns, dtype=np.int64)
    if arr.size == 0 or arr.max() <= 0:
        return 0.0
    return float(arr.size / (arr.max() / 1e9))


def verdict(
    *,
    scheduled_ns: Array,
    issued_ns: Array,
    latency_ns: Array,
    errors: int = 0,
    outcomes: Mapping[str, int] | None = None,
    completed_ns: Array | None = None,
    replied_ns: Array | None = None,
    predict_ns: Array | None = None,
    requested_rate: float | None = None,
    poisson: bool = True,
    duration_s: float | None = None,
    policy: ValidityPolicy | None = None,
    warmup: int = 0,
) -> Verdict:
    """Judge a run from its per-query arrays.

    ``scheduled_ns``/``issued_ns``: offsets from the run start for every query of the
    schedule (``issued_ns`` 0 for a query not issued). ``latency_ns``: latency from the
    scheduled time of each query that completed without error. ``outcomes``: the
    counts of :func:`mlscope.outcomes.count` (else ``errors`` is taken as failures).
    ``completed_ns``: an open loop's completion offset per query answered, with outputs
    or an error (0 otherwise: :meth:`mlscope.record.RunRecord.answered_ns`), for the
    overload rule (None: a closed loop, which cannot overload). ``replied_ns``: the
    offset of every query's reply of any kind, a refusal included (0 where none came:
    :attr:`mlscope.record.RunRecord.completed`), for the gap and silence rules of open
    and closed loops (:func:`~mlscope.answering.gaps`, :func:`~mlscope.answering.silence`;
    default ``completed_ns``). ``predict_ns``: each query's predict time (0 where none
    was recorded): a closed loop's wait for its first reply is a gap only for the part
    of it that the first answered query did not spend predicting (None: never a gap).
    ``requested_rate``: the rate the user asked for (None for closed loops and
    replays). ``poisson``: the schedule is random, so its realized rate may differ
    from the request by Poisson noise. ``duration_s`` defaults to the last scheduled
    offset (MLPerf's server rule); every rule compares un-rounded values. ``warmup``:
    how many queries ran as warm-up before those ``latency_ns`` holds (named when no
    measured query completed).
    """
    pol = policy or ValidityPolicy()
    sched = np.asarray(scheduled_ns, dtype=np.int64)
    issued = np.asarray(issued_ns, dtype=np.int64)
    lat = finite(latency_ns)
    if sched.shape != issued.shape:
        raise ValueError("scheduled_ns and issued_ns must have one entry per query")
    n_issued = int(np.count_nonzero(issued))
    run_s = (
        duration_s if duration_s is not None else (float(sched.max()) / 1e9 if sched.size else 0)
    )
    counts = dict(outcomes) if outcomes is not None else {"failed": errors}
    counts.setdefault("not_issued", sched.size - n_issued)
    reasons = [
        *_size_reasons(pol, run_s, n_issued),
        *_latency_reasons(pol, lat, warmup),
        *_lag_reasons(pol, issue_lag_ns(sched, issued)),
        *_rate_reasons(pol, sched, issued, requested_rate, poisson),
        *(
            _open_loop_reasons(pol, sched, issued, completed_ns, replied_ns, run_s)
            if completed_ns is not None
            else _closed_loop_reasons(pol, issued, replied_ns, predict_ns)
            if replied_ns is not None
            else []
        ),
        *_failure_reasons(pol, counts),
    ]
    return Verdict(not reasons, tuple(reasons))


def _open_loop_reasons(
    pol: ValidityPolicy,
    sched: npt.NDArray[np.int64],
    issued: npt.NDArray[np.int64],
    completed: Array,
    replied: Array | None,
    window_s: float,
) -> list[str]:
    """An open loop's answers: whether they paused (:func:`~mlscope.answering.gaps`) or stopped
    (:func:`~mlscope.answering.silence`), and whether they kept up with the arrivals while they came
    (overload, judged outside the gaps and up to the silence)."""
    anything = completed if replied is None else replied
    least = max(1, math.ceil(pol.max_silence_s * 1e9))
    paused = gaps(issued, anything, min_ns=least, factor=pol.gap_factor, taken_ns=completed)
    stop = silence(issued, anything)
    out = [*map(_gap_reason, paused), *([] if stop is None else [_silence_reason(stop)])]
    window = answering_window_s(window_s, stop)
    return [*out, *_overload_reasons(pol, sched, completed, window, paused, cut=stop is not None)]


def _closed_loop_reasons(
    pol: ValidityPolicy,
    issued: npt.NDArray[np.int64],
    replied: Array,
    predict: Array | None,
) -> list[str]:
    """A closed loop's answers: whether they paused or stopped, as an open loop's
    (:func:`~mlscope.answering.gaps`, :func:`~mlscope.answering.silence`). A closed loop
    cannot overload (it sends on answers), but a paused agent holds its queries and
    its clock: one query waits out the pause and the percentiles hardly move. The wait
    for the run's first reply is its start, and a first call at a batch size the model
    has not run yet may take seconds: that wait is a gap only when at least
    ``max_silence_s`` of it was not spent predicting the query answered first."""
    replies = np.asarray(replied, np.int64)
    least = max(1, math.ceil(pol.max_silence_s * 1e9))
    first = int(replies[replies > 0].min()) if np.any(replies > 0) else 0
    took = (
        int(np.asarray(predict, np.int64)[replies == first].max())
        if predict is not None and first > 0
        else 0
    )
    paused = [
        g
        for g in gaps(issued, replies, min_ns=least, factor=pol.gap_factor)
        if g.end_ns > first or (predict is not None and g.end_ns - g.start_ns - took >= least)
    ]
    stop = silence(issued, replies)
    return [*map(_gap_reason, paused), *([] if stop is None else [_silence_reason(stop)])]


def _gap_reason(gap: Gap) -> str:
    return (
        f"did not answer from t={gap.start_ns / 1e9:.3f} s to t={gap.end_ns / 1e9:.3f} s "
        f"({gap.sent} queries sent in that time): the agent, its host or its link "
        "paused (answers came again: not a backlog)"
    )


def _silence_reason(stop: Silence) -> str:
    why = "(the agent or its link went silent: lost, not a backlog)"
    if stop.last_reply_ns == 0:
        return (
            f"stopped answering: no query was answered; {stop.unanswered} sent got no answer {why}"
        )
    return (
        f"stopped answering at t={stop.last_reply_ns / 1e9:.3f} s (its last answer): "
        f"{stop.unanswered} queries sent after it got no answer {why}"
    )


def _overload_reasons(
    pol: ValidityPolicy,
    sched: npt.NDArray[np.int64],
    completed: Array,
    window_s: float,
    paused: tuple[Gap, ...] = (),
    *,
    cut: bool = False,
) -> list[str]:
    offered, answered = completion_rates(sched, completed, window_s, paused)
    span_s = second_half_s(window_s, paused)
    if offered * span_s < pol.overload_min_queries:
        return []
    if answered >= offered * (1 - pol.completion_tolerance):
        return []
    until = " (up to its last answer)" if cut else ""
    less = window_s / 2 - span_s
    outside = f", less {less:.3g} s without answers" if less > 0 else ""
    return [
        f"overloaded: completed {answered:.1f}/s of {offered:.1f}/s offered, backlog "
        f"{backlog_s(sched, completed, window_s):.3g} s (second half of the "
        f"{window_s:g} s window{until}{outside}; tolerance {pol.completion_tolerance:.0%})"
    ]


def _size_reasons(pol: ValidityPolicy, run_s: float, n_issued: int) -> list[str]:
    out = []
    if run_s < pol.min_duration_s:
        out.append(
            f"ran {_exact_s(run_s, pol.min_duration_s)} s < minimum {pol.min_duration_s:g} s"
        )
    if n_issued < pol.min_queries:
        out.append(f"issued {n_issued} queries < minimum {pol.min_queries}")
    return out


def _latency_reasons(pol: ValidityPolicy, lat: npt.NDArray[np.float64], warmup: int) -> list[str]:
    p = f"p{pol.percentile:g}"
    if lat.size == 0:
        return [
            f"no query completed after the {warmup} warm-up queries"
            if warmup
            else "no query completed"
        ]
    if pol.latency_bound_ns is None:
        if not pol.early_stopping:
            return []
        need = early_stopping_min_queries(pol.percentile, pol.confidence, pol.tolerance)
        if lat.size < need:
            return [
                f"early stopping: {lat.size} completed queries < {need} needed for a "
                f"{p} estimate at {pol.confidence:.0%} confidence"
            ]
        return []
    out = []
    bound = float(pol.latency_bound_ns)
    observed = nearest_rank(lat, pol.percentile)
    if observed is not None and observed > bound:
        out.append(f"{p} latency {observed / 1e6:.4g} ms > bound {bound / 1e6:.4g} ms")
    need = early_stopping_queries_needed(lat, bound, pol.percentile, pol.confidence, pol.tolerance)
    if lat.size < need:
        over = int(np.count_nonzero(lat > bound))
        out.append(
            f"early stopping: {over} of {lat.size} queries over the "
            f"{bound / 1e6:.4g} ms bound; showing {p} <= bound at "
            f"{pol.confidence:.0%} confidence needs >= {need} queries"
        )
    return out


def _lag_reasons(pol: ValidityPolicy, lag: npt.NDArray[np.int64]) -> list[str]:
    if lag.size == 0:
        return []
    out = []
    early = int(np.count_nonzero(lag < 0))
    if early:
        out.append(
            f"{early} queries issued before their scheduled time "
            f"(earliest by {-int(lag.min()) / 1e3:.3g} µs)"
        )
    worst = nearest_rank(lag, pol.issue_lag_percentile)
    if worst is not None and worst / 1e3 > pol.max_issue_lag_us:
        out.append(
            f"p{pol.issue_lag_percentile:g} issue lag {worst / 1e3:.0f} µs > "
            f"{pol.max_issue_lag_us:g} µs"
        )
    return out


def _rate_reasons(
    pol: ValidityPolicy,
    sched: npt.NDArray[np.int64],
    issued: npt.NDArray[np.int64],
    requested: float | None,
    poisson: bool,
) -> list[str]:
    out = []
    scheduled_rate, achieved = achieved_rate(sched), achieved_rate(issued[issued != 0])
    tol = pol.rate_tolerance
    if scheduled_rate > 0 and achieved < scheduled_rate * (1 - tol):
        short = 1 - achieved / scheduled_rate
        out.append(
            f"achieved {achieved:.1f} q/s is {short:.1%} below the scheduled "
            f"{scheduled_rate:.1f} q/s (tolerance {tol:.1%})"
        )
    if requested is not None and sched.size:
        noise = pol.rate_z / math.sqrt(sched.size) if poisson else 0.0
        off = abs(scheduled_rate / requested - 1)
        if off > tol + noise:
            out.append(
                f"scheduled {scheduled_rate:.1f} q/s is {off:.1%} off the requested "
                f"{requested:g} q/s (allowed {tol:.1%} + noise {noise:.1%})"
            )
    return out


def _exact_s(value: float, limit: float) -> str:
    """``value`` with enough digits to show that it differs from ``limit``."""
    for digits in range(3, 12):
        text = f"{value:.{digits}g}"
        if float(text) != float(f"{limit:.{digits}g}"):
            return text
    return repr(value)


def _failure_reasons(pol: ValidityPolicy, counts: Mapping[str, int]) -> list[str]:
    out = []
    failed, refused, lost = (int(counts.get(k, 0)) for k in ("failed", "refused", "lost"))
    if failed + refused + lost > pol.max_errors:
        allowed = f"(allowed {pol.max_errors})"
        if failed:
            out.append(f"{failed} queries failed {allowed}")
        if refused:
            out.append(
                f"{refused} queries refused by the agent (overloaded); the latency "
                f"figures cover only the answered queries {allowed}"
            )
        if lost:
            out.append(f"{lost} queries lost: issued and never answered {allowed}")
    not_issued = int(counts.get("not_issued", 0))
    if not_issued > pol.max_not_issued:
        out.append(
            f"{not_issued} queries not issued: the outstanding-query bound held them "
            f"back, the load generator fell {GIVE_UP_S:g} s behind its schedule and "
            f"gave up, or they were due after the run stopped "
            f"(allowed {pol.max_not_issued})"
        )
    return out
