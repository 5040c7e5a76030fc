"""The CPU time of a local run (:mod:`agent.localrun`): read at its start and its end
(and where its pacer's thread starts and ends), never per query.

Two figures, each over the run:

* the agent process's (``time.process_time``): the model's, the load generator's and
  the agent's own work (event loop, shipping, tracing) together;
* the load generator's own: the CPU time of the threads that do only its work
  (``time.thread_time``, which a thread can read only of itself): an open loop's run
  thread and the thread its pacer runs on. A query the pacer answers inline (a tiny
  model on an idle executor, :meth:`agent.pipeline.Executor.try_inline`) counts there:
  each is under the executor's ``inline_max_us``. A closed loop's or a stream's queries
  are issued on the model's predict thread (by the previous query's reply, or between
  two predicts), so their cost cannot be told from the model's without a clock read
  per query: their load-generator figure is None.

A run stopped before its end (its evaluation released) ships its rows at once, while
its thread may still drain its queries: :meth:`RunCpu.spent` then gives the process's
time up to now and the load generator's once its pacer has stopped (the run's thread
only waits after that).
"""

from __future__ import annotations

import threading
import time

from mlscope.pacer import Pacer, PacerResult

__all__ = ["RunCpu"]


class RunCpu:
    """The CPU time of one local run; ``separable``: its load generator has threads of
    its own (an open loop)."""

    def __init__(self, *, separable: bool) -> None:
        self.separable = separable
        self._process0: float | None = None
        self._thread0 = 0.0
        self._before_pacer_s = 0.0
        """The run's thread, up to its pacer's start."""
        self._pacer_s = 0.0
        self._stopped = threading.Event()
        """The load is no longer issued: the pacer's thread, or the run, has ended."""
        self._ended = threading.Event()
        self.process_s = 0.0
        self.loadgen_s: float | None = None

    def start(self) -> None:
        """The run starts (on its thread)."""
        self._process0, self._thread0 = time.process_time(), time.thread_time()

    def end(self) -> None:
        """The run has ended (on its thread): its figures."""
        thread = time.thread_time() - self._thread0  # first: it is part of the process's
        self.process_s = time.process_time() - (self._process0 or 0.0)
        if self.separable:
            self.loadgen_s = thread + self._pacer_s
        self._ended.set()
        self._stopped.set()

    def paced(self, pacer: Pacer) -> PacerResult:
        """Run ``pacer`` on a thread of its own (its real-time priority ends with the
        thread), from the run's thread, keeping that thread's CPU time; what the pacer
        raised is raised here."""
        self._before_pacer_s = time.thread_time() - self._thread0
        out: list[PacerResult] = []
        failed: list[Exception] = []

        def paced() -> None:
            cpu0 = time.thread_time()
            try:
                out.append(pacer.run())
            except Exception as exc:  # raised on the run's thread
                failed.append(exc)
            finally:
                self._pacer_s = time.thread_time() - cpu0
                self._stopped.set()

        thread = threading.Thread(target=paced, name="mlscope-pacer", daemon=True)
        thread.start()
        thread.join()
        if failed:
            raise failed[0]
        return out[0]

    def wait_stopped(self, timeout: float) -> None:
        """After the run was told to stop: until its load is no longer issued (its
        pacer's thread has ended, or the run), at most ``timeout`` s (blocking)."""
        if self.separable:
            self._stopped.wait(timeout)

    def spent(self) -> tuple[float, float | None]:
        """The run's (process, load generator) CPU time in s: its figures once it has
        ended; before (a stopped run still draining), the process's up to now and the
        load generator's up to its pacer's end (None while it still issues)."""
        if self._ended.is_set() or self._process0 is None:
            return self.process_s, self.loadgen_s
        process = time.process_time() - self._process0
        if not (self.separable and self._stopped.is_set()):
            return process, None
        return process, self._before_pacer_s + self._pacer_s
