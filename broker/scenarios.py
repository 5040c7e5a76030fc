"""Every benchmarking scenario: its schedule, its runs, its verdict (called by Evaluator.run).

=============== ============================================================== ========
scenario        load                                                           loop
=============== ============================================================== ========
online          Poisson arrivals at ``qps`` (seeded)                           open
constant        one query every ``1/qps`` s                                    open
multi-stream    ``batch_size`` samples per query, one query every ``1/qps`` s  open
replay          recorded inter-arrival times (``arrivals_s``)                  open
piecewise       Poisson with a rate that ramps / bursts (``segments``)         open
single-stream   one query outstanding                                          closed
concurrency     ``concurrency`` queries outstanding                            closed
batched         a sweep of ``batch_sizes``, closed loop at each: max
                throughput and the optimal batch size                          closed
peak            binary search of the highest Poisson rate whose p99 meets
                ``latency_bound_ms`` (MLPerf's find-peak-performance)          open
cold-start      ``repetitions`` x (reload the model, ``warm_queries``):
                load + first inference apart from warm (broker/coldstart.py)   closed
=============== ============================================================== ========

Each scenario is a strategy object in the registry (:mod:`broker.scenario_kinds`,
which says how to add one); this module is the front door: :func:`execute` runs a
spec with its scenario, :func:`build_schedule` gives an open loop's arrivals, and
:func:`scenario_spec` builds a spec from a scenario file and flags.

Open loops run on one pacer, or with ``loadgens = K > 1`` on K load-generator
processes that share one seeded global schedule (:mod:`broker.distributed`), or with
``loadgen_hosts`` on registered load-generator services on any host
(:mod:`broker.multihost`). A
``batched`` sweep and a ``peak`` search make several runs: each is a :class:`Run`
with its own evaluation id (``<parent>-<k>``), stored on its own, and listed in the
parent summary's ``points``; the parent's own figures are those of the best run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from broker import schedule
from broker.context import Context
from broker.scenario import Outcome, Run, Scenario, run_once
from broker.scenario_kinds import REGISTRY, get
from broker.scenario_kinds.peak import PEAK_PRECISION, next_rate, peak_floor_qps
from broker.schedule import Schedule
from mlscope.contracts import ScenarioSpec
from mlscope.errors import ConfigError
from mlscope.manifest import ScenarioFile, load_manifest

__all__ = [
    "PEAK_PRECISION",
    "SCENARIOS",
    "Context",
    "Outcome",
    "Run",
    "Scenario",
    "build_schedule",
    "execute",
    "next_rate",
    "peak_floor_qps",
    "read_arrivals",
    "run_once",
    "scenario_spec",
]

SCENARIOS = tuple(REGISTRY)
"""Every scenario name (the registry's)."""


async def execute(ctx: Context, spec: ScenarioSpec) -> Outcome:
    """Run ``spec`` with its scenario: one run, or a sweep / search of several."""
    return await get(spec.name).execute(ctx, spec)


def build_schedule(spec: ScenarioSpec) -> tuple[Schedule, float]:
    """The open-loop schedule of ``spec`` and the window (s) the load covers."""
    return get(spec.name).schedule(spec)


def read_arrivals(path: Path) -> tuple[float, ...]:
    """Inter-arrival times (s) from a replay file (:func:`broker.schedule.replay`)."""
    offsets = schedule.replay(path).offsets_ns
    gaps = np.diff(offsets, prepend=np.int64(0))
    return tuple(float(g) / 1e9 for g in gaps.tolist())


def scenario_spec(path: Path | None, flags: dict[str, Any]) -> ScenarioSpec:
    """A :class:`ScenarioSpec` from a scenario YAML (if any), overridden by ``flags``.

    ``flags`` holds command-line values, None where not given. In the YAML,
    ``concurrency`` means the samples per query for multi-stream and ``schedule_file``
    is read here, relative to the YAML (the job carries the arrivals themselves).
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
        if doc.name == "multi-stream" and doc.concurrency is not None:
            values.setdefault("batch_size", values.pop("concurrency"))
        if doc.schedule_file is not None:
            values["arrivals_s"] = read_arrivals(path.parent / doc.schedule_file)
    values.update({k: v for k, v in flags.items() if v is not None})
    return ScenarioSpec(**values)
