"""What the Run page's form takes from a stored job (:func:`dashboard.prefill.form_values`)
and what it says it cannot hold: a setting the form has no box for is listed, never
dropped in silence."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dashboard.prefill import form_values
from mlscope.contracts import JobRequest, ScenarioSpec

pytestmark = pytest.mark.timeout(30)

ROW = SimpleNamespace(model_version="1.0.0")


def _job(name: str, placement: str | None = None) -> JobRequest:
    job = {"model": "digits_cnn", "framework": "onnxruntime", "placement": placement}
    return JobRequest.model_validate({**job, "scenario": ScenarioSpec(name=name, duration_s=2)})


@pytest.mark.parametrize(("name", "placement"), [("single-stream", "agent"), ("batched", "server")])
def test_a_placement_other_than_the_scenarios_own_is_said(name: str, placement: str) -> None:
    _, left = form_values(_job(name, placement), ROW)
    assert f"placement {placement}" in left


@pytest.mark.parametrize("name", ["single-stream", "batched"])
def test_the_scenarios_own_placement_is_not_a_note(name: str) -> None:
    _, left = form_values(_job(name), ROW)
    assert not any(note.startswith("placement") for note in left)
