"""A local run's CPU time (:mod:`agent.localcpu`): the agent process's and its load
generator's own, read at the run's start and end and where its pacer starts and ends.
No figure's size is asserted (the machine is shared): only what contains what."""

from __future__ import annotations

import numpy as np
import pytest

from agent.localcpu import RunCpu
from mlscope.errors import EvaluationError
from mlscope.pacer import Pacer

OFFSETS = np.arange(1, 21, dtype=np.int64) * 1_000_000
"""20 queries, 1 ms apart."""


def test_an_open_loops_load_generator_is_its_pacers_thread_within_the_process() -> None:
    cpu = RunCpu(separable=True)
    assert cpu.spent() == (0.0, None)  # not started
    cpu.start()
    issued: list[int] = []
    result = cpu.paced(Pacer(OFFSETS, issue=lambda i, _s, _p: issued.append(i)))
    assert issued == list(range(20)) and result.reached == 20
    # Stopped and not yet ended (its thread draining): the pacer's time, and the
    # process's up to now, which holds it.
    process, loadgen = cpu.spent()
    assert loadgen is not None and 0 < loadgen <= process
    cpu.end()
    assert cpu.loadgen_s is not None and loadgen <= cpu.loadgen_s <= cpu.process_s
    assert cpu.spent() == (cpu.process_s, cpu.loadgen_s)


def test_a_closed_loops_load_generator_is_not_told_apart() -> None:
    """Its queries are issued on the model's predict thread: only the process's time."""
    cpu = RunCpu(separable=False)
    cpu.start()
    cpu.wait_stopped(60.0)  # returns at once: there is no pacer to wait for
    assert cpu.spent()[1] is None
    cpu.end()
    assert cpu.loadgen_s is None and cpu.process_s >= 0


def test_what_the_pacer_raised_is_raised_on_the_runs_thread_with_its_time_kept() -> None:
    def issue(i: int, _scheduled: int, _paced: int) -> None:
        raise ValueError(f"query {i}")

    cpu = RunCpu(separable=True)
    cpu.start()
    with pytest.raises(EvaluationError, match="query 0"):
        cpu.paced(Pacer(OFFSETS, issue=issue))
    cpu.wait_stopped(60.0)  # the pacer's thread has ended
    assert cpu.spent()[1] is not None
