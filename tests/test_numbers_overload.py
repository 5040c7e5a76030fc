"""A real overload: efficientnet_lite0 on ONNX Runtime offered far more than one agent on
this machine can serve. The run is INVALID for overload, with offered, issued and
completed rates told apart, and the agent's refusals named, not dropped silently."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from mlscope.contracts import JobRequest, ScenarioSpec
from mlscope.jobs import submit
from mlscope.settings import Settings
from tests.conftest import running_stack

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def ort_stack(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[Settings]:
    with running_stack(tmp_path_factory.mktemp("overload"), zoo_dir, ["onnxruntime"]) as s:
        yield s.settings


def test_an_overloaded_run_is_invalid_for_overload(ort_stack: Settings) -> None:
    # ~5 ms of compute per query at best on 2 cores: 400/s is at least twice too many.
    spec = ScenarioSpec(
        name="constant",
        qps=400,
        duration_s=3.0,
        min_duration_s=0,
        min_queries=1,
        max_issue_lag_us=1e6,
    )
    job = JobRequest(
        model="efficientnet_lite0", framework="onnxruntime", scenario=spec, trace_level="none"
    )
    s = anyio.run(lambda: submit(ort_stack, job, timeout=240), backend="asyncio")
    assert not s.valid
    over = [r for r in s.invalid_reasons if r.startswith("overloaded: completed ")]
    assert len(over) == 1, s.invalid_reasons
    # It answered to the end, ever later: a backlog, not an agent that went silent or
    # paused (its replies kept coming, one predict call apart).
    assert not any(r.startswith(("stopped answering", "did not answer")) for r in s.invalid_reasons)
    assert s.scheduled_qps is not None and s.completed_qps is not None
    assert s.completed_qps < 0.8 * s.scheduled_qps  # completed, not issued, is reported
    assert s.backlog_s is not None and s.backlog_s > 0.1
    assert s.errors == s.failed + s.refused + s.lost
    if s.refused:  # the agent's queue filled: named apart from failures
        assert any(r.startswith(f"{s.refused} queries refused") for r in s.invalid_reasons)
