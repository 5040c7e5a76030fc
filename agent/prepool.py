"""An executor's pre-processing pool (:mod:`agent.pipeline`).

An admitted query (:class:`agent.job.Slot`) is pre-processed once, by whoever claims it
first under the executor's lock: a pool thread, or the predict thread when the query's
turn comes before any pool thread took it (:meth:`PrePool.ensure`). A predict thread
that finds a pool thread at it waits on the slot's latch, which that thread holds until
it is done. A query the idle predict thread is already waiting for is left to that
thread: no hand-off.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from agent.job import CLAIMED, DONE, PENDING, Slot

__all__ = ["PrePool"]


class PrePool:
    """Threads that pre-process admitted queries while earlier batches are predicted."""

    def __init__(
        self,
        name: str,
        workers: int,
        *,
        lock: threading.Lock,
        preprocess: Callable[[Slot], None],
        idle_seq: Callable[[], int],
    ) -> None:
        """``lock``: the executor's, under which slots are claimed; ``preprocess``: the
        work, sets the slot's inputs or error; ``idle_seq``: the seq the predict thread is
        idly waiting for, else -1. The threads (``pre-<name>-<i>``) are started by the
        executor."""
        self._lock = lock
        self._preprocess = preprocess
        self._idle_seq = idle_seq
        self._work: queue.SimpleQueue[Slot | None] = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._loop, name=f"pre-{name}-{i}", daemon=True)
            for i in range(workers)
        ]

    def offer(self, slot: Slot) -> None:
        """Hand ``slot`` to the pool: a pool thread pre-processes it unless it is claimed first."""
        self._work.put(slot)

    def stop(self) -> None:
        """End the threads once they have taken what was offered."""
        for _ in self.threads:
            self._work.put(None)

    def ensure(self, slot: Slot) -> None:
        """``slot`` pre-processed: here, unless a pool thread claimed it (then waited for)."""
        with self._lock:
            mine = slot.state == PENDING
            if mine:
                slot.state = CLAIMED
        if mine:
            self._preprocess(slot)
            slot.state = DONE
        elif slot.state != DONE and slot.latch is not None:
            slot.latch.acquire()  # released by the pool thread when it is done
            slot.latch.release()

    def skip(self, slot: Slot) -> None:
        """``slot`` never pre-processed (a pool thread already at it is waited for)."""
        with self._lock:
            mine = slot.state == PENDING
            if mine:
                slot.state = DONE
        if not mine and slot.state != DONE and slot.latch is not None:
            slot.latch.acquire()
            slot.latch.release()

    def _loop(self) -> None:
        while self._take(self._work.get()):
            pass

    def _take(self, slot: Slot | None) -> bool:
        """Pre-process ``slot`` unless another thread has it; False: the pool stops. The
        slot is this call's local only: waiting for the next one, the thread holds
        nothing of the last (a run's last query holds the whole run)."""
        if slot is None:
            return False
        if slot.seq == self._idle_seq():
            return True  # the idle predict thread does it inline: no hand-off
        with self._lock:
            if slot.state != PENDING:
                return True
            slot.state = CLAIMED
            slot.latch = latch = threading.Lock()
            latch.acquire()
        self._preprocess(slot)
        slot.state = DONE
        latch.release()
        return True
