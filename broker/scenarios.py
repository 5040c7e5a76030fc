"""Every benchmarking scenario: its schedule, its runs, its verdict (called by Evaluator.run).

Each scenario is declared by its traits, one module each in :mod:`mlscope.scenario_kinds`
(``mlscope-submit --help`` lists them), and run by its strategy
(:mod:`broker.scenario_kinds`, which says when a scenario needs one of its own).
Here :func:`execute` runs a spec with its scenario, :func:`build_schedule` gives an
open loop's arrivals, and :func:`scenario_spec` builds a spec from a scenario file and
flags.

Open loops run on one pacer, or with ``loadgens = K > 1`` on K load-generator
processes that share one seeded global schedule (:mod:`broker.distributed`), or with
``loadgen_hosts`` on registered load-generator services on any host
(:mod:`broker.multihost`). A ``batched`` sweep and a ``peak`` search make several
runs: each is a :class:`broker.scenario.Run` with its own evaluation id
(``<parent>-<k>``), stored on its own, and listed in the parent summary's ``points``;
the parent's own figures are those of the best run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from broker.context import Context
from broker.scenario import Outcome
from broker.scenario_kinds import get
from mlscope import scenario_traits, schedule
from mlscope.contracts import ScenarioSpec
from mlscope.errors import ConfigError
from mlscope.manifest import ScenarioFile, load_manifest
from mlscope.schedule import Schedule

__all__ = ["build_schedule", "execute", "read_arrivals", "scenario_spec"]


async def execute(ctx: Context, spec: ScenarioSpec) -> Outcome:
    """Run ``spec`` with its scenario: one run, or a sweep / search of several."""
    return await get(spec.name).execute(ctx, spec)


def build_schedule(spec: ScenarioSpec) -> tuple[Schedule, float]:
    """The open-loop schedule of ``spec`` and the window (s) the load covers."""
    return get(spec.name).schedule(spec)


def read_arrivals(path: Path) -> tuple[float, ...]:
    """Inter-arrival times (s) from a replay file (:func:`mlscope.schedule.replay`)."""
    offsets = schedule.replay(path).offsets_ns
    gaps = np.diff(offsets, prepend=np.int64(0))
    return tuple(float(g) / 1e9 for g in gaps.tolist())


def scenario_spec(path: Path | None, flags: dict[str, Any]) -> ScenarioSpec:
    """A :class:`ScenarioSpec` from a scenario YAML (if any), overridden by ``flags``.

    ``flags`` holds command-line values, None where not given. In the YAML, a field may
    mean another for one scenario (its traits' ``file_aliases``: ``concurrency`` is the
    samples per query of multi-stream) and ``schedule_file`` is read here, relative to
    the YAML (the job carries the arrivals themselves).
    """
    values: dict[str, Any] = {}
    if path is not None:
        doc = load_manifest(path)
        if not isinstance(doc, ScenarioFile):
            raise ConfigError(f"{path} is a {type(doc).__name__}, not a scenario", file=str(path))
        for key in (
            "qps",
            "duration_s",
            "batch_size",
            "batch_sizes",
            "seed",
            "latency_bound_ms",
            "segments",
            "loadgens",
            "concurrency",
            "repetitions",
            "warm_queries",
        ):
            if getattr(doc, key) is not None:
                values[key] = getattr(doc, key)
        values["name"] = doc.name
        for ours, theirs in scenario_traits.get(doc.name).file_aliases:
            if ours in values:
                values.setdefault(theirs, values.pop(ours))
        if doc.schedule_file is not None:
            values["arrivals_s"] = read_arrivals(path.parent / doc.schedule_file)
    values.update({k: v for k, v in flags.items() if v is not None})
    return ScenarioSpec(**values)
