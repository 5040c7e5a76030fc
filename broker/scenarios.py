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
(:mod:`broker.multihost`). A ``batched`` sweep (of several sizes) and a ``peak``
search make several runs: each is a :class:`broker.run.Run` with its own
evaluation id (``<parent>-<k>``, :meth:`broker.scenario.Scenario.run_id`), which its
queries name (so the agent keeps its spans under it), stored on its own, and listed
in the parent summary's ``points``; the parent's own figures are those of the best
run. A cancelled one is stored the same way as far as it got (its runs record how far
in a :class:`broker.run.RunsSoFar`; :mod:`broker.cancel`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from broker.context import Context
from broker.scenario import Outcome
from broker.scenario_kinds import get
from mlscope import replay_file, scenario_traits
from mlscope.contracts import ScenarioSpec
from mlscope.errors import ConfigError
from mlscope.manifest_files import load_yaml, parse_manifest, scenario_refusal
from mlscope.scenario_file import ScenarioFile
from mlscope.schedule import Schedule
from mlscope.validity import ValidityPolicy

__all__ = [
    "build_schedule",
    "execute",
    "file_values",
    "read_arrivals",
    "refuse",
    "scenario_spec",
]


def refuse(spec: ScenarioSpec, policy: ValidityPolicy) -> None:
    """Refuse ``spec`` when its scenario cannot give a result for it under ``policy``
    (:meth:`broker.scenario.Scenario.refuse`): at intake on the server, and in
    ``mlscope-submit`` before anything connects."""
    get(spec.name).refuse(spec, policy)


async def execute(ctx: Context, spec: ScenarioSpec) -> Outcome:
    """Run ``spec`` with its scenario: one run, or a sweep / search of several."""
    return await get(spec.name).execute(ctx, spec)


def build_schedule(spec: ScenarioSpec) -> tuple[Schedule, float]:
    """The open-loop schedule of ``spec`` and the window (s) the load covers."""
    return get(spec.name).schedule(spec)


def read_arrivals(path: Path) -> tuple[float, ...]:
    """Inter-arrival times (s) from a replay file (:func:`mlscope.replay_file.replay`),
    as the job carries them."""
    gaps = np.diff(replay_file.replay(path).offsets_ns, prepend=np.int64(0)) / 1e9
    return tuple(gaps.tolist())


_FILE_FIELDS = (
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
)
"""The fields a scenario file sets by the name a spec gives them."""


def scenario_spec(path: Path | None, flags: dict[str, Any]) -> ScenarioSpec:
    """A :class:`ScenarioSpec` from a scenario YAML (if any), overridden by ``flags``.

    ``flags`` holds command-line values, None where not given. The file's values are
    checked as a spec on their own first (:func:`file_values`), so that a value the
    file holds is refused as the file's, on its line, and one the flags set as theirs.
    """
    values = file_values(path) if path is not None else {}
    values.update({k: v for k, v in flags.items() if v is not None})
    return ScenarioSpec(**values)


def file_values(path: Path) -> dict[str, Any]:
    """The spec fields the scenario file ``path`` sets, refused as a
    :class:`ManifestError` naming the file and line where they make no spec.

    In the YAML, a field may mean another for one scenario (its traits'
    ``file_aliases``: ``concurrency`` is the samples per query of multi-stream) and
    ``schedule_file`` is read here, relative to the YAML (the job carries the arrivals
    themselves).
    """
    data, node = load_yaml(path)
    doc = parse_manifest(data, file=str(path), node=node)
    if not isinstance(doc, ScenarioFile):
        raise ConfigError(f"{path} is a {type(doc).__name__}, not a scenario", file=str(path))
    values: dict[str, Any] = {k: getattr(doc, k) for k in _FILE_FIELDS}
    values = {k: v for k, v in values.items() if v is not None} | {"name": doc.name}
    keys: dict[str, str] = {}  # spec field -> the file key that set it
    for ours, theirs in scenario_traits.get(doc.name).file_aliases:
        if ours in values and theirs not in values:
            values[theirs], keys[theirs] = values.pop(ours), ours
        values.pop(ours, None)
    if doc.schedule_file is not None:
        values["arrivals_s"] = read_arrivals(path.parent / doc.schedule_file)
        keys["arrivals_s"] = "schedule_file"
    try:
        ScenarioSpec(**values)
    except ValidationError as exc:
        raise scenario_refusal(exc, file=str(path), node=node, keys=keys) from exc
    return values
