"""Did a run's system keep answering? Pure functions over its per-query offsets
from the run start (ns; 0 where a query was not sent or got no reply): the rates at
which it answered, its backlog, the gaps in its answers and the silence that ends
them. What :func:`mlscope.validity.verdict` reads for its overload, gap and silence
rules.

Three ways for answers to fall behind the arrivals, told apart because each points
somewhere else:

* **overload**: replies keep coming, too slowly (the model or its host is too slow);
* **a gap**: for a while queries waited and no reply of any kind came, then replies
  came again (the agent, its host or its link paused: SIGSTOP, a healed network
  partition, a pause of seconds);
* **silence**: no reply came after the last one, though queries were sent after it
  (the agent was killed, or its link cut for good).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "ORDINARY",
    "Gap",
    "Silence",
    "answering_window_s",
    "backlog_s",
    "completion_rates",
    "gaps",
    "sat_through",
    "second_half_s",
    "silence",
]

Array = npt.ArrayLike
_NEVER = np.iinfo(np.int64).max


@dataclass(frozen=True, slots=True)
class Gap:
    """From ``start_ns`` to ``end_ns`` queries waited for an answer and no reply of any
    kind came; ``sent`` queries were sent in that time. ``start_ns`` is the last reply
    before the gap when a query was waiting then, else the first query sent into the
    gap; ``end_ns`` is the next reply."""

    start_ns: int
    end_ns: int
    sent: int


ORDINARY = 0.75
"""A wait without any reply that this fraction of the answered queries sat through is
an ordinary part of the run (see :func:`gaps`)."""


def gaps(
    issued_ns: Array,
    replied_ns: Array,
    *,
    min_ns: int,
    factor: float = 5.0,
    taken_ns: Array | None = None,
) -> tuple[Gap, ...]:
    """The gaps in a system's answers, in time order: waits of at least ``min_ns``
    without any reply while a query waited, ended by a reply, and ``factor`` times
    longer than the run's ordinary wait.

    ``issued_ns``: each query's issue offset (0: not sent); ``replied_ns``: the offset
    of its reply of any kind (outputs, an error, a refusal), 0 where none came; in any
    order. Between two replies the system owes an answer from the moment a query is
    waiting (sent and not answered): an idle system, nothing waiting between sparse
    arrivals, has no gap. A busy one's replies come at most one predict call apart, so
    a slow model's (a batch of seconds) are seconds apart while it is overloaded; but
    then nearly every query sat through such a wait, between its issue and its reply.
    So a wait is a gap only when it is ``factor`` times longer than a wait that
    :data:`ORDINARY` (three quarters) of the answered queries sat through: a pause's
    own queries raise that bar only when they are three quarters of the run. The
    silence after the last reply is :func:`silence`'s, not a gap.

    ``taken_ns``: the reply offsets of the queries the system took (answered with
    outputs or an error; 0 for one refused at once, or none), the queries whose waits
    set that bar (default ``replied_ns``). A refusal is a reply, so it ends a wait (the
    system was there); but an overloaded system refuses most queries the moment they
    come, and their waits of nothing would make each wait of the queries it did take,
    a slow model's call apart, look like a pause.
    """
    if min_ns <= 0:
        raise ValueError("min_ns must be positive")
    issued = np.asarray(issued_ns, np.int64).ravel()
    replied = np.asarray(replied_ns, np.int64).ravel()
    if issued.shape != replied.shape:
        raise ValueError("issued_ns and replied_ns must have one entry per query")
    hi = _reply_times(replied)  # each wait ends at a reply ...
    lo = np.concatenate(([0], hi[:-1])).astype(np.int64)  # ... and follows the one before
    hi, lo = hi[hi - lo >= min_ns], lo[hi - lo >= min_ns]
    start = np.maximum(lo, _first_waiting(issued, replied, hi))
    wait = hi - start
    hi, start, wait = hi[wait >= min_ns], start[wait >= min_ns], wait[wait >= min_ns]
    taken = replied if taken_ns is None else np.asarray(taken_ns, np.int64).ravel()
    if taken.shape != issued.shape:
        raise ValueError("issued_ns and taken_ns must have one entry per query")
    pause = ~_ordinary(issued, replied, taken, wait, factor)
    sent = np.sort(issued[issued > 0])
    n = np.searchsorted(sent, hi[pause]) - np.searchsorted(sent, start[pause])
    return tuple(
        Gap(int(a), int(b), int(c)) for a, b, c in zip(start[pause], hi[pause], n, strict=True)
    )


def _reply_times(replied: np.ndarray) -> np.ndarray:
    """The distinct reply times, sorted (a sort and a compare: numpy's hashed
    ``unique`` takes seconds on millions of integers)."""
    times = np.sort(replied[replied > 0])
    return times[np.concatenate(([True], times[1:] != times[:-1]))] if times.size else times


def _first_waiting(issued: np.ndarray, replied: np.ndarray, at: np.ndarray) -> np.ndarray:
    """For each time of ``at``, the earliest issue of a query sent before it and not
    answered until then (a query waits from its issue to its reply); ``at`` itself
    where none was waiting."""
    sent = issued > 0
    until = np.where(replied > 0, replied, _NEVER)[sent]
    order = np.argsort(until, kind="stable")
    # earliest issue among the queries answered at or after each ``until``
    earliest = np.minimum.accumulate(issued[sent][order][::-1])[::-1]
    earliest = np.append(earliest, _NEVER)
    first = earliest[np.searchsorted(until[order], at, side="left")]
    return np.where(first < at, first, at)


def _ordinary(
    issued: np.ndarray, replied: np.ndarray, taken: np.ndarray, waits: np.ndarray, factor: float
) -> np.ndarray:
    """For each of ``waits``, whether :data:`ORDINARY` of the queries taken and answered
    sat through a wait without any reply of a ``factor``-th of it (:func:`sat_through`):
    found by bisection over the sorted waits, as fewer queries sit through longer
    waits."""
    out = np.zeros(waits.shape, bool)
    if factor <= 0 or waits.size == 0:
        return out
    enough = ORDINARY * int(np.count_nonzero((issued > 0) & (taken >= issued)))
    order = np.argsort(waits, kind="stable")
    lo, hi = 0, waits.size  # waits[order[:lo]] ordinary, waits[order[hi:]] not
    while lo < hi:
        mid = (lo + hi) // 2
        wait = max(1, int(waits[order[mid]] / factor))
        if sat_through(issued, replied, wait, taken_ns=taken) >= enough:
            lo = mid + 1
        else:
            hi = mid
    out[order[:lo]] = True
    return out


def sat_through(
    issued_ns: Array, replied_ns: Array, wait_ns: int, *, taken_ns: Array | None = None
) -> int:
    """How many answered queries sat through at least ``wait_ns`` without any reply
    (to any query) between their issue and their reply; with ``taken_ns``, of the
    queries answered there only (their reply offsets, 0 for the others: see
    :func:`gaps`).

    A reply-free stretch inside ``[issue, reply]`` of a query ends at a reply time
    ``h`` (the query's own reply at the latest): the one from the previous reply time
    ``l`` (or the issue, if later) to ``h``. It is ``wait_ns`` long when ``h - l >=
    wait_ns`` and ``h - issue >= wait_ns``: so a query sat through one when some reply
    time ``h`` in ``[issue + wait_ns, reply]`` follows ``wait_ns`` or more without one.
    """
    issued = np.asarray(issued_ns, np.int64).ravel()
    replied = np.asarray(replied_ns, np.int64).ravel()
    times = _reply_times(replied)
    before = np.concatenate(([0], times[:-1])).astype(np.int64)
    ends = times[times - before >= wait_ns]
    own = replied if taken_ns is None else np.asarray(taken_ns, np.int64).ravel()
    answered = (issued > 0) & (own >= issued)
    i, r = issued[answered], own[answered]
    first = np.searchsorted(ends, i + wait_ns, side="left")
    return int(np.count_nonzero(first < np.searchsorted(ends, r, side="right")))


def second_half_s(window_s: float, without: Sequence[Gap] = ()) -> float:
    """Seconds of the second half of a ``window_s`` window outside the gaps ``without``:
    the time over which :func:`completion_rates` counts."""
    lo, end = int(window_s * 1e9) // 2, int(window_s * 1e9)
    return max(window_s / 2 - _overlap_ns(without, lo, end) / 1e9, 0.0)


def completion_rates(
    scheduled_ns: Array, completed_ns: Array, window_s: float, without: Sequence[Gap] = ()
) -> tuple[float, float]:
    """(offered, completed) queries/s over the second half of a ``window_s`` window,
    outside the gaps ``without``.

    ``completed_ns``: the completion offset of each query the system answered, with
    outputs or an error (0 for the others: refused, lost, not issued). Arrivals and
    completions are counted in ``(window/2, window]``: the first half lets a stable
    system reach its steady state, and a system that keeps up completes there as many
    queries as arrive. The time of a gap and the queries that arrived in it are left
    out (it answered none then); what it answered after a gap counts, so a system that
    keeps up, catching up on a gap's queries, completes at least as many as arrive
    outside the gap, and one too slow completes fewer whatever the gap.
    """
    sched = np.asarray(scheduled_ns, np.int64)
    done = np.asarray(completed_ns, np.int64)
    end = int(window_s * 1e9)
    span_s = second_half_s(window_s, without)
    if end <= 0 or span_s <= 0:
        return 0.0, 0.0
    lo = end // 2
    inside = (sched > lo) & (sched <= end)
    for g in without:
        inside &= (sched < g.start_ns) | (sched >= g.end_ns)
    arrived = int(np.count_nonzero(inside))
    answered = int(np.count_nonzero((done > lo) & (done <= end)))
    return arrived / span_s, answered / span_s


def _overlap_ns(spans: Sequence[Gap], lo: int, hi: int) -> int:
    """Nanoseconds of ``(lo, hi]`` inside the (disjoint) ``spans``."""
    return sum(max(0, min(g.end_ns, hi) - max(g.start_ns, lo)) for g in spans)


def backlog_s(scheduled_ns: Array, completed_ns: Array, window_s: float) -> float:
    """Work queued at the end of the load window, in seconds of offered load: queries
    that arrived by then and were not answered, over the run's offered rate. A stable
    system's backlog is about one mean latency (Little's law); an overloaded one's
    grows with the length of the run."""
    sched = np.asarray(scheduled_ns, np.int64)
    done = np.asarray(completed_ns, np.int64)
    end = int(window_s * 1e9)
    arrived = int(np.count_nonzero(sched <= end))
    if end <= 0 or arrived == 0:
        return 0.0
    waiting = arrived - int(np.count_nonzero((done > 0) & (done <= end)))
    return max(waiting, 0) / (arrived / window_s)


@dataclass(frozen=True, slots=True)
class Silence:
    """No reply of any kind came after ``last_reply_ns`` (an offset from the run start;
    0: none came at all), and ``unanswered`` queries sent after it got none."""

    last_reply_ns: int
    unanswered: int


def silence(issued_ns: Array, replied_ns: Array) -> Silence | None:
    """Whether the agent stopped answering: queries sent after its last reply got none
    (None when every query sent after it was answered: the replies went on to the end).

    ``issued_ns``: each query's issue offset (0: not sent); ``replied_ns``: the offset
    of its reply, any reply (outputs, an error, a refusal "overloaded"), 0 where none
    came. A backlogged system answers every query it took, ever later, and goes on
    answering after the load ends while the load generator waits for it: its last reply
    comes after the last query was sent. A system that stopped (killed, paused, cut off
    by the network) leaves every query sent after its last reply unanswered.
    """
    issued = np.asarray(issued_ns, np.int64)
    replied = np.asarray(replied_ns, np.int64)
    last = int(replied.max()) if replied.size else 0
    after = int(np.count_nonzero((issued > last) & (replied == 0)))
    return Silence(last, after) if after else None


def answering_window_s(window_s: float, stop: Silence | None) -> float:
    """The part of a ``window_s`` load window in which the system answered: up to its
    last reply when it stopped answering (``stop``), the whole window otherwise. What
    is judged for overload and counted as backlog: queries sent to a system that had
    stopped are lost, not queued."""
    if stop is None:
        return window_s
    return min(window_s, stop.last_reply_ns / 1e9)
