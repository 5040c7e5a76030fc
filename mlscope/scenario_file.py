"""A benchmarking scenario as a YAML file (``kind: scenario``): what ``mlscope-submit
--scenario-file`` reads, and the committed ones in ``manifests/scenarios/``.

:func:`broker.scenarios.scenario_spec` makes a :class:`ScenarioSpec` of one, with the
submit flags over its values.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from mlscope import scenario_traits
from mlscope.contracts import (
    MAX_BATCH,
    MAX_CONCURRENCY,
    MAX_DURATION_S,
    MAX_LOADGENS,
    MAX_QPS,
    ScenarioName,
    ScenarioSpec,
)
from mlscope.manifest import Strict, relative_path

__all__ = ["ScenarioFile"]


def _spec_bound(field: str, bound: str) -> Any:
    """:class:`ScenarioSpec`'s own ``bound`` (``le``, ``max_length``) of ``field``, for
    the limits it writes out rather than names: a scenario file is held to the bounds
    of the spec it becomes, defined once, there."""
    for constraint in ScenarioSpec.model_fields[field].metadata:
        if hasattr(constraint, bound):
            return getattr(constraint, bound)
    raise LookupError(f"ScenarioSpec.{field} has no {bound}")


class ScenarioFile(Strict):
    """A benchmarking scenario as YAML (``kind: scenario``); see docs for each name.

    Each value has the bounds of the :class:`ScenarioSpec` field it sets, so that
    ``mlscope manifest validate`` refuses what a submission would.
    """

    kind: Literal["scenario"] = "scenario"
    name: ScenarioName
    qps: float | None = Field(default=None, gt=0, le=MAX_QPS)
    """Target arrival rate (online: Poisson mean; constant: fixed interval)."""
    duration_s: float | None = Field(default=None, gt=0, le=MAX_DURATION_S)
    batch_size: int | None = Field(default=None, ge=1, le=MAX_BATCH)
    batch_sizes: tuple[int, ...] | None = Field(
        default=None, max_length=_spec_bound("batch_sizes", "max_length")
    )
    """batched: the batch sizes to sweep."""
    concurrency: int | None = Field(default=None, ge=1, le=MAX_CONCURRENCY)
    """concurrency: requests kept in flight (closed loop); multi-stream: streams."""
    seed: int = 0
    latency_bound_ms: float | None = Field(
        default=None, gt=0, le=_spec_bound("latency_bound_ms", "le")
    )
    schedule_file: str | None = None
    """replay: a recorded trace, relative to the scenario file."""
    segments: tuple[tuple[float, float, float], ...] | None = None
    """piecewise: ``[rate_start, rate_end, seconds]`` per segment (ramps and bursts)."""
    loadgens: int | None = Field(default=None, ge=1, le=MAX_LOADGENS)
    """Open loops: load-generator processes sharing one global schedule."""
    repetitions: int | None = Field(default=None, ge=1, le=_spec_bound("repetitions", "le"))
    """cold-start: how many times the model is unloaded, loaded and run again."""
    warm_queries: int | None = Field(default=None, ge=1, le=_spec_bound("warm_queries", "le"))
    """cold-start: warm queries after each load."""

    @field_validator("batch_sizes")
    @classmethod
    def _positive(cls, v: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if v is not None and (not v or min(v) < 1):
            raise ValueError("batch_sizes must be a non-empty list of positive integers")
        if v is not None and max(v) > MAX_BATCH:
            raise ValueError(f"a batch size may be at most {MAX_BATCH} (got {max(v)})")
        return v

    @field_validator("segments")
    @classmethod
    def _segments_as_the_spec_takes_them(
        cls, v: tuple[tuple[float, float, float], ...] | None
    ) -> tuple[tuple[float, float, float], ...] | None:
        """The spec's own segment rules (count, rates, the longest run), not a copy."""
        if v is not None:
            try:
                ScenarioSpec(name="piecewise", segments=v)
            except ValidationError as exc:
                raise ValueError(
                    str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
                ) from None
        return v

    @field_validator("schedule_file")
    @classmethod
    def _inside(cls, v: str | None) -> str | None:
        return relative_path(v)

    @model_validator(mode="after")
    def _needs(self) -> ScenarioFile:
        traits = scenario_traits.get(self.name)
        for field in traits.requires:
            if getattr(self, field, None) is None:
                raise ValueError(f"scenario {self.name!r} needs {field}")
        # A value the scenario would ignore is refused, as mlscope-submit refuses its flag.
        read_as = {"schedule_file": "arrivals_s", **dict(traits.file_aliases)}
        for key in sorted(self.model_fields_set - {"kind", "name"}):
            if not traits.reads(field := read_as.get(key, key)):
                raise ValueError(
                    f"scenario {self.name!r} does not read {key}: {traits.unread(field)}"
                )
        return self
