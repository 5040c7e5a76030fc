"""mlscope/tuning.py: one owner of the process-wide tuning, safe with concurrent jobs."""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import anyio
import pytest

from mlscope.tuning import ProcessTuning


@pytest.fixture
def untuned() -> Iterator[None]:
    """The process as a test runner has it (GC on, default switch interval), and back."""
    switch, enabled = sys.getswitchinterval(), gc.isenabled()
    gc.enable()
    sys.setswitchinterval(0.005)
    try:
        yield
    finally:
        sys.setswitchinterval(switch)
        (gc.enable if enabled else gc.disable)()


def test_overlapping_measurements_keep_the_tuning_until_the_last_ends(untuned: None) -> None:
    tuning = ProcessTuning(switch_interval_s=0.0002)
    first = tuning.measurement()
    second = tuning.measurement()
    first.__enter__()
    assert not gc.isenabled() and sys.getswitchinterval() == pytest.approx(0.0002)
    second.__enter__()
    assert tuning.measuring == 2
    second.__exit__(None, None, None)  # the second job ends while the first still runs
    assert not gc.isenabled(), "GC restored while a measurement still runs"
    assert sys.getswitchinterval() == pytest.approx(0.0002)
    assert tuning.measuring == 1 and tuning.running()
    first.__exit__(None, None, None)
    assert gc.isenabled() and sys.getswitchinterval() == pytest.approx(0.005)
    assert tuning.measuring == 0 and not tuning.running()


def test_a_failing_measurement_still_restores(untuned: None) -> None:
    tuning = ProcessTuning()
    with pytest.raises(RuntimeError), tuning.measurement():
        raise RuntimeError("run failed")
    assert gc.isenabled() and sys.getswitchinterval() == pytest.approx(0.005)
    assert not tuning.running()


def test_gc_left_off_by_the_process_stays_off(untuned: None) -> None:
    gc.disable()
    tuning = ProcessTuning()
    with tuning.measurement():
        pass
    assert not gc.isenabled()


def test_a_load_is_not_tuned_but_makes_waiters_wait(untuned: None) -> None:
    tuning = ProcessTuning()
    with tuning.load():
        assert tuning.running() and tuning.measuring == 0
        assert gc.isenabled() and sys.getswitchinterval() == pytest.approx(0.005)
    assert not tuning.running()


def test_realtime_is_held_only_while_no_measurement_declines_it(untuned: None) -> None:
    tuning = ProcessTuning()
    with tuning.measurement(realtime_loop=False):
        assert not tuning.realtime_loop
    with tuning.measurement(realtime_loop=True):
        held = tuning.realtime_loop  # False without CAP_SYS_NICE
        with tuning.measurement(realtime_loop=False):
            assert not tuning.realtime_loop  # a fast run declines it for all
        assert tuning.realtime_loop == held
    assert not tuning.realtime_loop


def test_wait_idle_returns_when_the_last_load_ends() -> None:
    anyio.run(_wait_idle_returns_when_the_last_load_ends, backend="asyncio")


async def _wait_idle_returns_when_the_last_load_ends() -> None:
    tuning = ProcessTuning()
    order: list[str] = []

    async def waiter() -> None:
        await tuning.wait_idle()
        order.append("ingester")

    first, second = tuning.load(), tuning.load()
    first.__enter__()
    second.__enter__()
    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.sleep(0.01)
        second.__exit__(None, None, None)
        await anyio.sleep(0.01)
        order.append("first still running")
        first.__exit__(None, None, None)
    assert order == ["first still running", "ingester"]
    await tuning.wait_idle()  # idle: returns at once
