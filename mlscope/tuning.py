"""The one owner of what a measurement changes for the whole process.

A timed run needs three things that belong to the process, not to the run: a short
GIL switch interval (the pacer thread gets the GIL the moment its sleep ends, not
after the default 5 ms), no cyclic garbage collection (a collection holds the GIL for
milliseconds), and the event-loop thread in SCHED_FIFO (a loop thread preempted while
it holds the GIL stalls the pacer). Up to four jobs run at once in one server, so no
run may set and restore these on its own: the second run to end would restore GC
while the first still measures. :class:`ProcessTuning` counts the measurements in
progress: the tuning is applied when the first starts and restored when the last
ends. Work that can wait and would hold the GIL for long (the trace ingester) waits
for :meth:`ProcessTuning.wait_idle`.

One instance per process, made by whoever runs the process (``broker.server.Server``,
a load-generator child, an MLPerf test, an agent that runs load itself with
``placement: agent``) and passed down explicitly. Measurements
start and end on the event-loop thread (thread priority is per thread).
"""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from mlscope.pacer import RealtimeThread

__all__ = ["PACER_SWITCH_INTERVAL_S", "ProcessTuning"]

PACER_SWITCH_INTERVAL_S = 0.0001


class ProcessTuning:
    """Switch interval, GC and the loop thread's priority, held while any timed
    measurement runs; and whether any load runs at all (for :meth:`wait_idle`).

    :meth:`load` marks a load in progress (a closed loop: the ingester waits, nothing
    is tuned); :meth:`measurement` is a load whose issue times must be exact (an open
    loop on the pacer, an MLPerf test): it also holds the tuning. Real-time priority
    for the loop thread is requested per measurement (a busy real-time thread at a
    high rate would take a core from the system under test): it is held while
    measurements run and none of them declined it.
    """

    def __init__(self, *, switch_interval_s: float = PACER_SWITCH_INTERVAL_S) -> None:
        self.switch_interval_s = switch_interval_s
        self._loads = 0
        self._measuring = 0
        self._declined_realtime = 0
        self._saved_switch = 0.0
        self._gc_was_enabled = False
        self._loop_rt: RealtimeThread | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def loads(self) -> int:
        """Loads in progress (measurements included)."""
        return self._loads

    @property
    def measuring(self) -> int:
        """Measurements in progress (the tuning is held while this is above 0)."""
        return self._measuring

    @property
    def realtime_loop(self) -> bool:
        """Whether the loop thread is held in SCHED_FIFO now (needs CAP_SYS_NICE)."""
        return self._loop_rt is not None and self._loop_rt.active

    def running(self) -> bool:
        """Whether a load of this process is in progress."""
        return self._loads > 0

    async def wait_idle(self) -> None:
        """Return once no load is in progress.

        The trace ingester's decoding and inserts waited here: they delayed the pacer
        thread by tens of milliseconds at 1,000 QPS (p99 issue lag 700-960 µs with
        tracing on against 130-145 µs with it off, same machine, same minute).
        """
        while self._loads:
            await self._idle.wait()

    @contextmanager
    def load(self) -> Iterator[None]:
        """A load in progress: work that can wait (:meth:`wait_idle`) waits."""
        self._loads += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._loads -= 1
            if self._loads == 0:
                self._idle.set()

    @contextmanager
    def measurement(self, *, realtime_loop: bool = True) -> Iterator[None]:
        """A timed load: tuned from its start (before its clock starts) to its end."""
        with self.load():
            self._start(realtime_loop)
            try:
                yield
            finally:
                self._end(realtime_loop)

    def _start(self, realtime_loop: bool) -> None:
        if self._measuring == 0:
            self._saved_switch = sys.getswitchinterval()
            sys.setswitchinterval(self.switch_interval_s)
            # Objects alive now are frozen (never scanned again) and collection is off;
            # reference counting still frees nearly everything meanwhile.
            self._gc_was_enabled = gc.isenabled()
            gc.collect()
            gc.freeze()
            gc.disable()
        self._measuring += 1
        self._declined_realtime += not realtime_loop
        self._set_priority()

    def _end(self, realtime_loop: bool) -> None:
        self._measuring -= 1
        self._declined_realtime -= not realtime_loop
        self._set_priority()
        if self._measuring == 0:
            gc.unfreeze()
            if self._gc_was_enabled:
                gc.enable()
            sys.setswitchinterval(self._saved_switch)

    def _set_priority(self) -> None:
        want = self._measuring > 0 and self._declined_realtime == 0
        if want and self._loop_rt is None:
            self._loop_rt = RealtimeThread(enable=True)
        elif not want and self._loop_rt is not None:
            self._loop_rt.restore()
            self._loop_rt = None
