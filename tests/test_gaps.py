"""Gaps in an open loop's answers: a system paused for a while mid-run (SIGSTOP, a
healed partition, a pause of seconds) is said to have paused, from when to when, not
to be overloaded; one overloaded besides is both. Pure functions over hostile arrays,
without a stack."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from broker.summary import judge
from mlscope import schedule as sch
from mlscope import validity as v
from mlscope.answering import Gap, completion_rates, gaps, sat_through, second_half_s, silence
from mlscope.contracts import ScenarioSpec
from mlscope.record import RunRecord

S = 1_000_000_000
MS = 1_000_000


def served(
    issued: np.ndarray,
    service_s: float,
    pauses: Sequence[tuple[float, float]] = (),
    batch: int = 1,
) -> np.ndarray:
    """Reply times of one FIFO server taking ``service_s`` per call of up to ``batch``
    queries in issue order, frozen during each ``(from_s, to_s)`` of ``pauses`` (a
    call under way when a pause begins ends that much later)."""
    order = np.argsort(issued, kind="stable")
    done = np.zeros_like(issued)
    free, service = 0, int(service_s * S)
    for i in range(0, len(order), batch):
        group = order[i : i + batch]
        start = max(int(issued[group].max()), free)
        end = start + service
        for a, b in ((int(a * S), int(b * S)) for a, b in pauses):
            if a <= start < b:
                start, end = b, b + service
            elif start < a < end:
                end += b - a
        done[group] = free = end
    return done


def poisson_issued(rate: float, duration_s: float, seed: int = 3) -> np.ndarray:
    issued: np.ndarray = sch.poisson(rate, duration_s=duration_s, seed=seed).offsets_ns + 2_000
    return issued


def judged(
    issued: np.ndarray, replied: np.ndarray, window_s: float, **kw: object
) -> tuple[str, ...]:
    return v.verdict(
        scheduled_ns=issued - 2_000,
        issued_ns=issued,
        latency_ns=(replied - issued)[replied > 0],
        completed_ns=replied,
        duration_s=window_s,
        policy=v.ValidityPolicy(min_duration_s=0, min_queries=1, early_stopping=False, **kw),  # type: ignore[arg-type]
    ).reasons


def starting(reasons: Sequence[str], prefix: str) -> list[str]:
    return [r for r in reasons if r.startswith(prefix)]


# --- the gaps of hostile arrays ------------------------------------------------------


def test_nothing_sent_or_nothing_answered_has_no_gap() -> None:
    empty = np.zeros(0, np.int64)
    assert gaps(empty, empty, min_ns=S) == ()
    assert sat_through(empty, empty, 1) == 0
    issued = poisson_issued(100, 5)
    lost = np.zeros_like(issued)
    assert gaps(issued, lost, min_ns=S) == ()  # all lost: the final silence's
    stop = silence(issued, lost)
    assert stop is not None and stop.last_reply_ns == 0 and stop.unanswered == len(issued)
    none_sent = np.zeros(10, np.int64)
    assert gaps(none_sent, none_sent, min_ns=1) == ()


def test_queries_not_sent_or_never_answered_do_not_make_a_gap() -> None:
    issued = poisson_issued(100, 5)
    replied = served(issued, 0.002)
    issued[::7] = 0  # not sent: zeros in both arrays
    replied[::7] = 0
    assert gaps(issued, replied, min_ns=S) == ()
    replied[5] = 0  # one lost mid-run: it waits forever, but replies keep coming
    assert gaps(issued, replied, min_ns=S) == ()


def test_a_pause_mid_run_is_one_gap_in_any_order() -> None:
    issued = poisson_issued(100, 10)
    replied = served(issued, 0.002, pauses=[(3.0, 6.0)])
    (gap,) = gaps(issued, replied, min_ns=S)
    sent = int(np.count_nonzero((issued >= gap.start_ns) & (issued < gap.end_ns)))
    assert 2.9 * S < gap.start_ns <= issued[issued >= 3 * S].min()  # waiting from then
    assert gap.end_ns == replied[replied > 3 * S].min()
    assert gap.sent == sent and 250 < sent < 350
    shuffled = np.random.default_rng(0).permutation(len(issued))
    assert gaps(issued[shuffled], replied[shuffled], min_ns=S) == (gap,)


def test_a_gap_at_the_start_begins_with_the_first_query() -> None:
    issued = poisson_issued(100, 10)
    replied = served(issued, 0.002, pauses=[(0.0, 2.5)])
    (gap,) = gaps(issued, replied, min_ns=S)
    assert gap == Gap(
        int(issued.min()), int(replied.min()), int(np.count_nonzero(issued < 2.5 * S))
    )


def test_a_silence_at_the_end_is_not_a_gap_but_the_final_silence() -> None:
    issued = poisson_issued(100, 10)
    replied = served(issued, 0.002)
    replied[replied > 7 * S] = 0
    assert gaps(issued, replied, min_ns=S) == ()
    stop = silence(issued, replied)
    assert stop is not None and stop.last_reply_ns <= 7 * S and stop.unanswered > 250


def test_several_gaps_are_each_found() -> None:
    issued = poisson_issued(100, 12)
    replied = served(issued, 0.002, pauses=[(2.0, 3.5), (6.0, 8.0), (9.0, 9.5)])
    found = gaps(issued, replied, min_ns=S)
    assert [(round(g.start_ns / S, 1), round(g.end_ns / S, 1)) for g in found] == [
        (2.0, 3.5),
        (6.0, 8.0),
    ]  # the 0.5 s pause is below the threshold
    assert len(gaps(issued, replied, min_ns=S // 4)) == 3


def test_sparse_arrivals_to_an_idle_system_are_no_gap() -> None:
    issued = np.arange(1, 11, dtype=np.int64) * 3 * S  # one query every 3 s
    replied = issued + MS
    assert gaps(issued, replied, min_ns=S) == ()


def test_the_waits_queries_sat_through_by_hand() -> None:
    """Replies at 5 and 12: the first query waited 1..5 (4 without a reply), the
    second 5..12 (7), the third 10..12 (2); a query never sent or answered sat
    through nothing."""
    issued, replied = [1, 2, 10, 0, 3], [5, 12, 12, 0, 0]
    assert [sat_through(issued, replied, w) for w in (1, 2, 3, 4, 5, 7, 8)] == [3, 3, 2, 2, 1, 1, 0]


def test_a_gap_needs_a_positive_threshold_and_matching_arrays() -> None:
    with pytest.raises(ValueError, match="positive"):
        gaps([1], [2], min_ns=0)
    with pytest.raises(ValueError, match="one entry per query"):
        gaps([1, 2], [2], min_ns=1)


def test_a_slow_model_s_wait_between_replies_is_no_gap() -> None:
    """Batches of 32 taking 1.6 s each, offered twice what they serve: the replies come
    1.6 s apart while queries wait, but every query waits at least that long."""
    issued = poisson_issued(40, 20)
    replied = served(issued, 1.6, batch=32)
    answered = int(np.count_nonzero(replied))
    assert sat_through(issued, replied, int(1.5 * S)) > 0.9 * answered
    assert gaps(issued, replied, min_ns=S) == ()
    assert len(gaps(issued, replied, min_ns=S, factor=0)) > 5  # by length alone
    reasons = judged(issued, replied, 20)
    assert starting(reasons, "overloaded") and not starting(reasons, "did not answer"), reasons


def admitting(issued: np.ndarray, service_s: float, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """One FIFO server taking ``service_s`` per query that holds at most ``capacity``
    unanswered queries and refuses one past it at once (50 µs later): the reply times
    of the queries it took (0 for a refused one) and of every query."""
    taken, replied = np.zeros_like(issued), np.zeros_like(issued)
    free, service = 0, int(service_s * S)
    held: list[int] = []
    for q in np.argsort(issued, kind="stable"):
        t = int(issued[q])
        held = [end for end in held if end > t]
        if len(held) >= capacity:
            replied[q] = t + 50_000
            continue
        free = max(t, free) + service
        held.append(free)
        taken[q] = replied[q] = free
    return taken, replied


def test_a_slow_model_refusing_most_queries_has_no_gap_but_is_overloaded() -> None:
    """An agent in an overloaded run refuses most queries at once and takes the rest a
    slow model's call apart (batches of 64 images, 1.5 s each). The refused queries
    sat through no wait, and counted among the answered ones they made each wait
    between two answers look like a pause ("the agent, its host or its link paused"),
    from the first reply to the end of the drain. The waits are judged against the
    queries the agent took; a real pause (no reply, not even a refusal) still is one."""
    issued = poisson_issued(50, 10)
    taken, replied = admitting(issued, 1.5, capacity=28)
    assert np.count_nonzero(taken) < 0.1 * len(issued)  # nearly all refused
    assert gaps(issued, replied, min_ns=S, taken_ns=taken) == ()
    reasons = v.verdict(
        scheduled_ns=issued - 2_000,
        issued_ns=issued,
        latency_ns=(taken - issued)[taken > 0],
        completed_ns=taken,
        replied_ns=replied,
        duration_s=10,
        policy=v.ValidityPolicy(min_duration_s=0, min_queries=1, early_stopping=False),
    ).reasons
    assert starting(reasons, "overloaded") and not starting(reasons, "did not answer"), reasons


def test_a_pause_is_still_one_when_some_queries_were_refused() -> None:
    """A 2.5 ms system paused from 6 s to 9.5 s that refused one query in ten outside
    the pause: judged against the queries it took, the pause is found as before."""
    issued = poisson_issued(75, 10)
    replied = served(issued, 0.0025, pauses=[(6.0, 9.5)])
    refused = (np.arange(len(issued)) % 10 == 0) & ((issued < 6 * S) | (issued > 9.5 * S))
    taken = np.where(refused, 0, replied)
    replied = np.where(refused, issued + 50_000, replied)
    (gap,) = gaps(issued, replied, min_ns=S, taken_ns=taken)
    assert 5.9 < gap.start_ns / S < 6.1 and 9.5 <= gap.end_ns / S < 9.6


# --- the verdict ---------------------------------------------------------------------


def test_a_paused_system_that_keeps_up_is_said_to_have_paused_not_overloaded() -> None:
    """75 QPS to a 2.5 ms system paused from 6 s to 9.5 s of a 10 s window: over the
    whole second half it completes fewer than arrive (its queue of the pause is not
    drained by the window's end), but it answered as fast as they came whenever it
    answered."""
    issued = poisson_issued(75, 10)
    replied = served(issued, 0.0025, pauses=[(6.0, 9.5)])
    offered, answered = completion_rates(issued - 2_000, replied, 10.0)
    assert answered < 0.95 * offered  # what the overload rule alone would call overload
    reasons = judged(issued, replied, 10)
    (gap,) = gaps(issued, replied, min_ns=S)
    assert reasons == (
        f"did not answer from t={gap.start_ns / S:.3f} s to t={gap.end_ns / S:.3f} s "
        f"({gap.sent} queries sent in that time): the agent, its host or its link paused "
        "(answers came again: not a backlog)",
    ), reasons
    assert 5.9 < gap.start_ns / S < 6.1 and 9.5 <= gap.end_ns / S < 9.6
    assert gap.sent == int(np.count_nonzero((issued >= gap.start_ns) & (issued < gap.end_ns)))


def test_an_overloaded_system_paused_besides_is_both() -> None:
    """75 QPS to a system serving 61.6/s, paused from 7 s to 8.5 s: behind outside the
    pause too, so overloaded, judged on the second half less the pause."""
    issued = poisson_issued(75, 10)
    replied = served(issued, 1 / 61.6, pauses=[(7.0, 8.5)])
    reasons = judged(issued, replied, 10)
    (gap,) = gaps(issued, replied, min_ns=S)
    assert starting(reasons, "did not answer from t=7.0"), reasons
    (over,) = starting(reasons, "overloaded: completed ")
    less = 5 - second_half_s(10, [gap])
    assert 1.4 < less < 1.6 and f"less {less:.3g} s without answers" in over, over


def test_a_pause_then_a_final_silence_are_both_said() -> None:
    issued = poisson_issued(75, 10)
    replied = served(issued, 0.0025, pauses=[(3.0, 5.0)])
    replied[replied > 8 * S] = 0
    reasons = judged(issued, replied, 10)
    assert starting(reasons, "did not answer from t=2.9") or starting(
        reasons, "did not answer from t=3.0"
    ), reasons
    assert starting(reasons, "stopped answering at t=7.9"), reasons
    assert not starting(reasons, "overloaded"), reasons


def test_a_pause_shorter_than_the_threshold_is_not_a_gap() -> None:
    issued = poisson_issued(75, 10)
    replied = served(issued, 0.0025, pauses=[(3.0, 3.5)])
    assert not starting(judged(issued, replied, 10), "did not answer")
    assert starting(judged(issued, replied, 10, max_silence_s=0.25), "did not answer")


def test_judge_reads_a_stored_run_s_pause() -> None:
    """The server's verdict (:func:`broker.summary.judge`) over a run record."""
    spec = ScenarioSpec(name="online", qps=75, duration_s=10, seed=3)
    issued = poisson_issued(75, 10)
    rec = RunRecord(n=len(issued), batch_size=1, t0_ns=10**12)
    rec.scheduled[:] = issued - 2_000
    rec.paced[:] = issued - 1_000
    rec.issued[:] = issued
    rec.completed[:] = served(issued, 0.0025, pauses=[(6.0, 9.5)])
    rec.ok[:] = 1
    got = judge(
        rec, spec, v.ValidityPolicy(), window_s=10.0, requested_rate=75.0, poisson=True
    ).reasons
    assert starting(got, "did not answer from t=") and not starting(got, "overloaded"), got


# --- closed loops ----------------------------------------------------------------------


def closed_loop(
    service_s: Sequence[float], concurrency: int = 1, pauses: Sequence[tuple[float, float]] = ()
) -> RunRecord:
    """A closed loop's record: ``concurrency`` streams, each sending its next query the
    moment its last is answered; query k takes ``service_s[k]`` on one server (FIFO),
    frozen during each ``(from_s, to_s)`` of ``pauses`` (a predict under way then is
    stretched by it, as a frozen process's clock keeps running)."""
    n = len(service_s)
    rec = RunRecord(n=n, batch_size=1, t0_ns=10**12)
    free, ready = 0, [1] * concurrency  # when the server is free; each stream's next send
    for k, took in enumerate(service_s):
        s = k % concurrency
        sent = ready[s]
        start = max(sent, free)
        end = start + int(took * S)
        for a, b in ((int(a * S), int(b * S)) for a, b in pauses):
            if start < a < end:
                end += b - a
            elif a <= start < b:
                start, end = b, b + (end - start)
        rec.scheduled[k] = rec.paced[k] = rec.issued[k] = sent
        rec.predict_start[k], rec.predict_end[k] = start, end
        rec.completed[k] = free = end
        ready[s] = end + 20_000  # its next query, sent on the answer
    rec.ok[:] = 1
    return rec


def judged_closed(rec: RunRecord) -> tuple[str, ...]:
    spec = ScenarioSpec(name="single-stream", duration_s=1)
    window = float(rec.completed.max()) / S
    policy = v.ValidityPolicy(min_duration_s=0, min_queries=1, early_stopping=False)
    return judge(
        rec, spec, policy, window_s=window, requested_rate=None, poisson=False, open_loop=False
    ).reasons


def test_a_closed_loop_paused_mid_run_is_said_to_have_paused() -> None:
    """Single-stream at 2.5 ms a query, the agent frozen from 2 s to 5 s: one query waits
    out the pause, which no percentile shows; the verdict names it."""
    rec = closed_loop([0.0025] * 3000, pauses=[(2.0, 5.0)])
    reasons = judged_closed(rec)
    (paused,) = starting(reasons, "did not answer from t=1.99")  # the query sent then
    assert "to t=5.00" in paused and "(1 queries sent in that time)" in paused, reasons
    assert not starting(reasons, "overloaded") and not starting(reasons, "stopped"), reasons
    # Concurrency 4: the four queries in flight all wait it out.
    reasons = judged_closed(closed_loop([0.0025] * 3000, concurrency=4, pauses=[(2.0, 5.0)]))
    assert starting(reasons, "did not answer from t=1.99"), reasons


def test_a_closed_loop_s_slow_start_or_slow_model_is_not_a_pause() -> None:
    """The first call at a new batch size may take seconds (its predict: the run's
    start); a model whose every call takes seconds waits that long every time."""
    assert judged_closed(closed_loop([3.0] + [0.0025] * 2000)) == ()
    assert judged_closed(closed_loop([2.0] * 40)) == ()
    assert judged_closed(closed_loop([0.0025] * 2000)) == ()


def test_a_closed_loop_paused_before_its_first_answer_is_said_to_have_paused() -> None:
    """Frozen from the start for 3 s before its first predict: the wait for the first
    reply is not the model's (its predict took 2.5 ms), so it is a gap."""
    reasons = judged_closed(closed_loop([0.0025] * 2000, pauses=[(0.0, 3.0)]))
    (paused,) = starting(reasons, "did not answer from t=0.000 s to t=3.00")
    assert "(1 queries sent in that time)" in paused, reasons
    # frozen for 3 s during its first predict: a slow first call, as far as anyone can tell
    assert judged_closed(closed_loop([0.5] + [0.0025] * 2000, pauses=[(0.1, 3.1)])) == ()


def test_a_closed_loop_whose_agent_stopped_says_so() -> None:
    rec = closed_loop([0.0025] * 2000, concurrency=2)
    rec.completed[-2:] = 0  # the two in flight got no answer
    rec.ok[-2:] = 0
    reasons = judged_closed(rec)
    assert starting(reasons, "stopped answering at t="), reasons
    # one was sent after the last answer, the other before it and still unanswered
    assert "1 queries sent after it got no answer" in " ".join(reasons), reasons
