"""A closed loop's queries in flight (:meth:`broker.loadgen.Driver._closed_loop`).

``spec.concurrency`` streams, each sending its next query the moment its previous one
is answered: the first ones from the event loop, the others from the query link's
reader thread that stamped the answer, under one lock. A query's scheduled time is
its issue time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from broker.lgclock import now
from mlscope.errors import BusError
from mlscope.querylink import QueryLink
from mlscope.record import RunRecord

__all__ = ["Streams"]


class Streams:
    """A closed loop's queries in flight: the next one is sent on each answer, on the
    link's reader thread (the first ones on the event loop), under one lock."""

    def __init__(
        self, rec: RunRecord, link: QueryLink, frame: Callable[[int], bytes], cap: int
    ) -> None:
        self.rec, self.link, self.frame, self.cap = rec, link, frame, cap
        self.deadline = 0
        self.count = 0
        """Queries sent (or lost trying)."""
        self.outstanding = 0
        self.failure: Exception | None = None
        """What failed building a query (raised by the run)."""
        self.finished = threading.Event()
        """Set once the last answer is in (or a query could not be built)."""
        self.lock = threading.Lock()
        """Held to send a query (and grow the record past its room); the driver holds
        it to write an answer into the record, so that no answer goes to arrays a
        growth is replacing."""
        self._stopped = False

    def stop(self) -> None:
        with self.lock:
            self._stopped = True

    def answered(self) -> None:
        with self.lock:
            self.outstanding -= 1
        self.send_next()

    def send_next(self) -> None:
        rec = self.rec
        with self.lock:
            t = now()
            if self._stopped or self.count >= self.cap or t >= self.deadline:
                if not (self._stopped or self.count >= self.cap or rec.time_up_ns):
                    rec.time_up_ns = t - rec.t0_ns
                if self.outstanding == 0:
                    self.finished.set()
                return
            i = self.count
            try:
                if i >= rec.n:  # the run outlasts the room: grow, never stop early
                    rec.grow()
                frame = self.frame(i)
            except Exception as exc:  # the query cannot be built: raised by the run
                self.failure, self._stopped = exc, True
                self.finished.set()
                return
            rec.scheduled[i] = rec.paced[i] = rec.issued[i] = now() - rec.t0_ns
            try:
                self.link.send(frame)
                self.outstanding += 1
            except BusError as exc:  # the bus is unreachable: lost, this stream ends
                rec.errors[i] = f"not sent: {exc}"
                if self.outstanding == 0:
                    self.finished.set()
            self.count += 1
