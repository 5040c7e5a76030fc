"""The registry of scenarios: one strategy object per ``ScenarioSpec.name``.

Adding a scenario is one module here plus its test:

1. a :class:`broker.scenario.Scenario` subclass in its own module, e.g.
   ``broker/scenario_kinds/burst.py``::

       class Burst(Scenario):
           \"\"\"``qps`` Poisson, doubled for the middle third of the run.\"\"\"

           name = "burst"
           poisson = True
           rate_driven = True

           def arrivals(self, spec: ScenarioSpec) -> tuple[Schedule, float]:
               third = spec.duration_s / 3
               segments = ((spec.qps, spec.qps, third), (2 * spec.qps, 2 * spec.qps, third),
                           (spec.qps, spec.qps, third))
               return schedule.piecewise(segments, seed=spec.seed), spec.duration_s

   (a closed loop sets ``closed_loop = True`` instead of ``arrivals``; several runs
   override ``execute``, as :mod:`.batched` and :mod:`.peak` do);
2. its instance in :data:`REGISTRY` below, and its name in the wire vocabulary
   ``mlscope.contracts.ScenarioName`` (what a job may ask for; ``tests/test_scenario
   _registry.py`` checks the two agree);
3. its test: the schedule it builds (a unit test, as ``tests/test_loadgen.py`` does for
   the others) and one run against the noop agent (``tests/test_scenarios.py``).
"""

from __future__ import annotations

from broker.scenario import Scenario
from broker.scenario_kinds.batched import Batched
from broker.scenario_kinds.closed_loop import Concurrency, SingleStream
from broker.scenario_kinds.cold_start import ColdStart
from broker.scenario_kinds.open_loop import Constant, MultiStream, Online, Piecewise, Replay
from broker.scenario_kinds.peak import Peak
from mlscope.errors import ConfigError

__all__ = ["REGISTRY", "get"]

REGISTRY: dict[str, Scenario] = {
    s.name: s
    for s in (
        Online(),
        SingleStream(),
        MultiStream(),
        Batched(),
        Concurrency(),
        Constant(),
        Replay(),
        Piecewise(),
        Peak(),
        ColdStart(),
    )
}
"""Every scenario by name, in the order ``mlscope-submit --help`` lists them."""


def get(name: str) -> Scenario:
    """The scenario called ``name`` (a ConfigError names the known ones)."""
    try:
        return REGISTRY[name]
    except KeyError:
        known = ", ".join(REGISTRY)
        raise ConfigError(f"unknown scenario {name!r} (known: {known})", field="scenario") from None
