"""The open-loop pacer: issues each query at its scheduled time, never before it.

The pacer runs in a thread of its own so that the event loop's millisecond timer
rounding never reaches the schedule (asyncio's ``call_at`` fires 0.5–1.2 ms late,
uvloop's can fire early). For each query it sleeps until ``spin_s`` before the deadline
(``Event.wait``, so a stop interrupts it), then spins on ``time.perf_counter_ns()``
(CLOCK_MONOTONIC), calling ``time.sleep(0)`` on each turn to hand the GIL to the
threads that receive replies, and issues once the clock has reached the deadline.

``time.sleep(0)`` is not free on Linux: it sleeps for the thread's timer slack (50 µs by
default; ~58 µs measured on the dev box), so a spin made only of ``sleep(0)`` issues
~35 µs late at the median. The last ``busy_s`` (default 70 µs) before a deadline are
therefore a tight spin that holds the GIL: p50 lag fell from ~35 µs to ~0.3 µs in
``bench/bench_pacer.py``, at the cost of holding the GIL for at most ``busy_s`` per
query. ``busy_s=0`` gives the pure ``sleep(0)`` spin.

Behind schedule it issues every query already due at once, in order, as one batch: with
``issue_many(indices, issued_ns)`` the caller handles a batch in one call (the load
generator writes it to its socket in one system call), which is what lets one process
issue tens of thousands of queries per second. Outstanding queries are bounded by a
*gate* the caller supplies (:class:`OutstandingLimit`, or anything with
``try_acquire``): a query the gate refuses is recorded as not issued, with its index,
and the schedule moves on; it never blocks.

Every time is an offset in ns from ``start_ns`` (a ``perf_counter_ns`` value), the same
clock the caller must use for completions so that latency = completed - start_ns -
scheduled. ``issued_ns`` is 0 for a query that was not issued.
"""

from __future__ import annotations

import os
import threading
import time
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from mlscope.errors import ConfigError, EvaluationError
from mlscope.schedule import Schedule

__all__ = [
    "DEFAULT_BUSY_S",
    "DEFAULT_SPIN_S",
    "GIVE_UP_S",
    "Gate",
    "OutstandingLimit",
    "Pacer",
    "PacerResult",
    "RealtimeThread",
    "RealtimeThreads",
]

DEFAULT_SPIN_S = 300e-6
DEFAULT_BUSY_S = 70e-6
GIVE_UP_S = 10.0
"""A pacer this far behind the end of its schedule stops: every query it would still
issue is that late, so it has not delivered its schedule (the run is INVALID), and the
queries not reached are not issued. Without it an overloaded run whose queries are
refused one by one (an agent's local run) would go on for as long as refusing the
whole backlog takes, long after its schedule."""
SHORT_SLEEP_NS = 5_000_000
"""A wait up to this long is a plain ``time.sleep`` (a stop waits for it to end);
a longer one an ``Event.wait`` that a stop interrupts."""
IssueOne = Callable[[int, int, int], None]
"""``issue(i, scheduled_ns, issued_ns)`` for one query."""
IssueMany = Callable[[range, int], None]
"""``issue_many(indices, issued_ns)`` for a batch of due queries, all issued at once."""


class Gate(Protocol):
    """A non-blocking bound on outstanding queries."""

    def try_acquire(self, n: int) -> int:
        """Take up to ``n`` slots without blocking; return how many were taken."""
        ...


class OutstandingLimit:
    """A thread-safe count of outstanding queries with a limit.

    The pacer takes slots as it issues; the caller calls :meth:`release` (from any
    thread, e.g. the event loop) as each query completes or fails.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ConfigError(f"outstanding limit must be >= 1, got {limit}")
        self.limit = limit
        self._outstanding = 0
        self._lock = threading.Lock()

    def try_acquire(self, n: int = 1) -> int:
        with self._lock:
            granted = max(0, min(n, self.limit - self._outstanding))
            self._outstanding += granted
            return granted

    def release(self, n: int = 1) -> None:
        with self._lock:
            if n > self._outstanding:
                raise ConfigError(f"released {n} slots but only {self._outstanding} are taken")
            self._outstanding -= n

    @property
    def outstanding(self) -> int:
        return self._outstanding


@dataclass(frozen=True, slots=True)
class PacerResult:
    """What the pacer did, per query, in preallocated arrays (offsets from ``start_ns``)."""

    start_ns: int
    scheduled_ns: np.ndarray
    issued_ns: np.ndarray
    """Issue offset of each query; 0 for a query not issued (refused, or never reached)."""
    not_issued: np.ndarray
    """Indices of the queries the gate refused (the outstanding bound was reached)."""
    reached: int
    """Queries the pacer got to; fewer than the schedule when it was stopped."""
    stopped: bool

    @property
    def lag_ns(self) -> np.ndarray:
        """Issue lag (issued - scheduled) of every issued query."""
        mask = self.issued_ns != 0
        lag: np.ndarray = self.issued_ns[mask] - self.scheduled_ns[mask]
        return lag


class Pacer:
    """Issues a schedule in a dedicated thread: ``start()``, then ``join()`` or ``stop()``.

    Give exactly one of ``issue`` (called per query, each with its own issue time) and
    ``issue_many`` (called once per batch of due queries). ``spin_s``: how long before a
    deadline the coarse sleep ends; ``busy_s``: how much of the spin holds the GIL.
    ``start_ns`` is the ``perf_counter_ns`` value of offset 0 (default: when the pacer
    starts running), so several pacers can share one start. ``max_batch`` caps one
    batch, so a long stall is issued in several hops rather than one huge one.
    ``give_up_s``: how far behind its schedule's end the pacer stops (:data:`GIVE_UP_S`).
    """

    def __init__(
        self,
        schedule: Schedule | np.ndarray,
        *,
        issue: IssueOne | None = None,
        issue_many: IssueMany | None = None,
        gate: Gate | None = None,
        spin_s: float = DEFAULT_SPIN_S,
        busy_s: float = DEFAULT_BUSY_S,
        max_batch: int = 1024,
        start_ns: int | None = None,
        stop: threading.Event | None = None,
        realtime: bool = False,
        give_up_s: float = GIVE_UP_S,
    ) -> None:
        if (issue is None) == (issue_many is None):
            raise ConfigError("give exactly one of issue and issue_many")
        if spin_s < 0 or busy_s < 0 or max_batch < 1 or give_up_s < 0:
            raise ConfigError("spin_s, busy_s and give_up_s must be >= 0 and max_batch >= 1")
        offsets = schedule.offsets_ns if isinstance(schedule, Schedule) else schedule
        self._offsets = Schedule(offsets).offsets_ns  # validates: int64, sorted, >= 0
        self._issue, self._issue_many, self._gate = issue, issue_many, gate
        self._spin_ns = int(spin_s * 1e9)
        self._busy_ns = int(busy_s * 1e9)
        self._max_batch = max_batch
        self._give_up_ns = int(give_up_s * 1e9)
        self._start_ns = start_ns
        self._stop = stop if stop is not None else threading.Event()
        self._issued = np.zeros(self._offsets.size, dtype=np.int64)
        self._refused: list[int] = []
        self._reached = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._realtime = realtime
        self.realtime = False
        """Whether the pacer thread got a real-time (SCHED_FIFO) priority."""
        self.cpu_s = 0.0
        """CPU time of the thread the schedule ran on (sleeping, spinning, issuing),
        set when it ends: the load generator's own cost, whatever else its process
        does meanwhile (an embedded database's merges, other runs)."""

    @property
    def start_ns(self) -> int | None:
        """``perf_counter_ns`` at offset 0; None until the pacer has started."""
        return self._start_ns

    def start(self) -> None:
        """Run the schedule in a new thread."""
        if self._thread is not None:
            raise ConfigError("a pacer runs once")
        self._thread = threading.Thread(target=self._guarded, name="mlscope-pacer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the pacer to stop after the current batch (wakes it from its sleep)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> PacerResult:
        """Wait for the pacer to finish; raise what its callback raised, as EvaluationError."""
        if self._thread is None:
            raise ConfigError("the pacer was not started")
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"pacer still running after {timeout} s")
        return self._result()

    def run(self) -> PacerResult:
        """Run the schedule in the calling thread (what :meth:`start` runs in its thread)."""
        self._guarded()
        return self._result()

    def __enter__(self) -> Pacer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self._thread is not None:
            self._thread.join()

    def _result(self) -> PacerResult:
        if self._error is not None:
            raise EvaluationError(f"issue callback failed: {self._error!r}") from self._error
        return PacerResult(
            start_ns=self._start_ns or 0,
            scheduled_ns=self._offsets,
            issued_ns=self._issued,
            not_issued=np.asarray(self._refused, dtype=np.int64),
            reached=self._reached,
            stopped=self._reached < self._offsets.size,
        )

    def _guarded(self) -> None:
        cpu0 = time.thread_time()
        if self._realtime:
            self.realtime = _make_realtime()
        try:
            self._loop()
        except Exception as exc:  # handed to join() as an EvaluationError
            self._error = exc
        finally:
            self.cpu_s = time.thread_time() - cpu0

    def _loop(self) -> None:
        offsets: list[int] = self._offsets.tolist()  # Python ints compare ~10x faster
        n, stop, clock, max_batch = len(offsets), self._stop, time.perf_counter_ns, self._max_batch
        if self._start_ns is None:
            self._start_ns = clock()
        t0 = self._start_ns
        give_up = t0 + (offsets[-1] if n else 0) + self._give_up_ns
        i = 0
        while i < n and not stop.is_set():
            due = t0 + offsets[i]
            now = clock()
            if now < due:
                if not self._wait_until(due):
                    break
                now = clock()
            elif now > give_up:
                break
            j = bisect_right(offsets, now - t0, i, min(n, i + max_batch))  # every j' < j is due
            self._issue_batch(offsets, i, j, now - t0 or 1)
            i = self._reached = j

    def _wait_until(self, due: int) -> bool:
        """Sleep until ``spin`` before ``due``, then spin to it; False if stopped meanwhile."""
        clock, stop, busy = time.perf_counter_ns, self._stop, self._busy_ns
        coarse = due - clock() - self._spin_ns
        if 0 < coarse <= SHORT_SLEEP_NS:
            time.sleep(coarse / 1e9)  # ~15 µs closer to the deadline than Event.wait
        elif coarse > 0 and stop.wait(coarse / 1e9):
            return False
        while (now := clock()) < due:
            if due - now > busy:
                time.sleep(0)  # releases the GIL: the reply-receiving threads keep running
            if stop.is_set():
                return False
        return True

    def _issue_batch(self, offsets: list[int], i: int, j: int, now: int) -> None:
        k = j if self._gate is None else i + self._gate.try_acquire(j - i)
        if self._issue_many is not None:
            if k > i:
                self._issued[i:k] = now
                self._issue_many(range(i, k), now)
        elif self._issue is not None:
            issue, clock, t0 = self._issue, time.perf_counter_ns, self._start_ns or 0
            for idx in range(i, k):
                at = max(clock() - t0, now)  # each query's own issue time, >= the batch's
                self._issued[idx] = at
                issue(idx, offsets[idx], at)
        if k < j:
            self._refused.extend(range(k, j))


REALTIME_PRIORITY = 2
"""The pacer's SCHED_FIFO priority: above the event loop's (:class:`RealtimeThread`)."""


class RealtimeThreads:
    """Other threads (by native id) in SCHED_FIFO priority 1 until :meth:`restore`.

    For the threads a pacer takes the GIL from in an agent's local run (its executor's
    predict and pre-processing threads): one preempted while it holds the GIL stalls
    the pacer until it runs again. No effect without CAP_SYS_NICE.
    """

    def __init__(self, thread_ids: list[int], *, enable: bool = True) -> None:
        self.saved: list[tuple[int, int, os.sched_param]] = []
        if not enable:
            return
        for tid in thread_ids:
            try:
                before = (tid, os.sched_getscheduler(tid), os.sched_getparam(tid))
                os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(1))
            except (OSError, AttributeError):
                continue
            self.saved.append(before)

    @property
    def active(self) -> bool:
        return bool(self.saved)

    def restore(self) -> None:
        for tid, policy, param in self.saved:
            try:
                os.sched_setscheduler(tid, policy, param)
            except OSError:  # the thread has ended
                continue
        self.saved = []


class RealtimeThread:
    """The calling thread in SCHED_FIFO (priority 1) until :meth:`restore`.

    For the event-loop thread during a run: a thread that holds the GIL and is
    preempted by another process stalls the pacer until it runs again, so the thread
    the pacer hands the GIL to and from must not be preempted either. No effect
    without CAP_SYS_NICE.
    """

    def __init__(self, *, enable: bool = True) -> None:
        self.policy = os.sched_getscheduler(0)
        self.param = os.sched_getparam(0)
        self.active = enable and _make_realtime(1)

    def restore(self) -> None:
        if self.active:
            os.sched_setscheduler(0, self.policy, self.param)


def _make_realtime(priority: int = REALTIME_PRIORITY) -> bool:
    """Put the calling thread in SCHED_FIFO at the lowest real-time priority.

    A woken SCHED_FIFO thread preempts every normal task at once, so the pacer's
    wake-up before a deadline is not delayed by the scheduler's time slices when
    the cores are busy. It sleeps between deadlines, so it cannot starve the host
    (and the kernel caps real-time threads at 95% of a core). Needs CAP_SYS_NICE
    (or an RLIMIT_RTPRIO); without it the pacer runs at normal priority.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except (OSError, AttributeError):
        return False
    return True
