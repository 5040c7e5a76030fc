"""The pacer: never early, in order, everything issued, refusals counted, clean stop.

No timing thresholds: the cores are shared and noisy. Only never-early and ordering are
asserted, which hold however loaded the machine is.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from mlscope import schedule as sch
from mlscope.errors import ConfigError, EvaluationError
from mlscope.pacer import OutstandingLimit, Pacer


def test_per_query_callback_never_early_in_order_and_complete() -> None:
    s = sch.poisson(2000.0, duration_s=0.5, seed=1)
    seen: list[tuple[int, int, int, int]] = []
    pacer: Pacer

    def issue(i: int, scheduled_ns: int, issued_ns: int) -> None:
        seen.append((i, scheduled_ns, issued_ns, time.perf_counter_ns()))

    pacer = Pacer(s, issue=issue)
    pacer.start()
    result = pacer.join(timeout=30)
    assert [x[0] for x in seen] == list(range(len(s)))
    assert result.reached == len(s) and not result.stopped and result.not_issued.size == 0
    np.testing.assert_array_equal(result.scheduled_ns, s.offsets_ns)
    assert np.all(result.issued_ns >= result.scheduled_ns)
    assert np.all(np.diff(result.issued_ns) >= 0)
    for i, scheduled, issued, wall in seen:
        assert scheduled == s.offsets_ns[i] and issued == result.issued_ns[i]
        assert wall - result.start_ns >= scheduled  # the clock itself says: not early
    assert np.all(result.lag_ns >= 0)


def test_batches_cover_every_query_once_and_issue_due_ones_together() -> None:
    # a 40 ms stall in the callback puts the pacer behind: the backlog comes in one batch
    s = sch.constant(5000.0, duration_s=0.3)
    batches: list[range] = []

    def issue_many(indices: range, issued_ns: int) -> None:
        batches.append(indices)
        for i in indices:
            assert s.offsets_ns[i] <= issued_ns
        if len(batches) == 5:
            time.sleep(0.04)

    result = Pacer(s, issue_many=issue_many, max_batch=64).run()
    flat = [i for b in batches for i in b]
    assert flat == list(range(len(s)))
    assert max(len(b) for b in batches) > 1  # the backlog after the stall was batched
    assert max(len(b) for b in batches) <= 64
    assert np.all(result.issued_ns >= result.scheduled_ns)


def test_closed_gate_records_not_issued_and_keeps_the_schedule() -> None:
    s = sch.constant(4000.0, n=400)
    limit = OutstandingLimit(10)  # nothing ever completes: only 10 can be issued
    got: list[int] = []
    result = Pacer(s, issue=lambda i, _s, _t: got.append(i), gate=limit).run()
    assert got == list(range(10))
    assert result.not_issued.tolist() == list(range(10, 400))
    assert np.all(result.issued_ns[10:] == 0) and np.all(result.issued_ns[:10] > 0)
    assert result.reached == 400 and limit.outstanding == 10


def test_gate_released_by_completions_lets_queries_through() -> None:
    s = sch.constant(2000.0, n=200)
    limit = OutstandingLimit(8)  # a batch is at most max_batch=8, all released at once

    def issue_many(indices: range, issued_ns: int) -> None:
        limit.release(len(indices))  # completes at once

    result = Pacer(s, issue_many=issue_many, gate=limit, max_batch=8).run()
    assert result.not_issued.size == 0 and np.all(result.issued_ns > 0)
    assert limit.outstanding == 0


def test_stop_event_ends_a_long_schedule_and_joins() -> None:
    s = sch.constant(10.0, n=1000)  # 100 s of schedule
    stop = threading.Event()
    count = 0

    def issue(i: int, _s: int, _t: int) -> None:
        nonlocal count
        count += 1
        if count == 2:
            stop.set()

    pacer = Pacer(s, issue=issue, stop=stop)
    pacer.start()
    result = pacer.join(timeout=30)
    assert result.stopped and result.reached == 2
    assert np.all(result.issued_ns[2:] == 0) and result.not_issued.size == 0


def test_a_pacer_too_far_behind_its_schedules_end_gives_up() -> None:
    """Issuing takes 2 ms a query against a schedule of 0.1 ms a query: once the clock
    is ``give_up_s`` past the schedule's end, the queries not reached are left not
    issued (never refused by the gate) and the pacer ends; without the limit it would
    go on for the 2 s the backlog takes."""
    s = sch.constant(10_000.0, n=1000)  # 0.1 s of schedule

    def issue(_i: int, _s: int, _t: int) -> None:
        time.sleep(0.002)

    result = Pacer(s, issue=issue, max_batch=16, give_up_s=0.2).run()
    assert result.stopped and 0 < result.reached < len(s), result.reached
    assert np.all(result.issued_ns[: result.reached] > 0)
    assert np.all(result.issued_ns[result.reached :] == 0) and result.not_issued.size == 0
    on_time = Pacer(sch.constant(10_000.0, n=1000), issue=lambda _i, _s, _t: None).run()
    assert not on_time.stopped and on_time.reached == 1000


def test_stop_wakes_a_sleeping_pacer() -> None:
    with Pacer(sch.constant(0.01, n=3), issue_many=lambda _i, _t: None) as pacer:
        time.sleep(0.05)
    result = pacer.join(timeout=5)
    assert result.stopped and result.reached == 0


def test_callback_error_is_reported_by_join() -> None:
    def boom(i: int, _s: int, _t: int) -> None:
        raise RuntimeError("agent unreachable")

    pacer = Pacer(sch.constant(1000.0, n=5), issue=boom)
    pacer.start()
    with pytest.raises(EvaluationError, match="agent unreachable"):
        pacer.join(timeout=10)


def test_shared_start_and_misuse() -> None:
    start = time.perf_counter_ns() + 20_000_000
    result = Pacer(np.array([0, 1000], np.int64), issue_many=lambda *_: None, start_ns=start).run()
    assert result.start_ns == start and np.all(result.issued_ns >= result.scheduled_ns)
    assert np.all(result.issued_ns > 0)  # offset 0 still reads as issued
    with pytest.raises(ConfigError):
        Pacer(np.zeros(3, np.int64), issue=lambda *_: None, issue_many=lambda *_: None)
    with pytest.raises(ConfigError):
        Pacer(np.array([5, 1], np.int64), issue=lambda *_: None)
    with pytest.raises(ConfigError):
        OutstandingLimit(1).release()
