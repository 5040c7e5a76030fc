"""The server's strategy for every scenario, by name.

A scenario is declared once, by its traits in :mod:`mlscope.scenario_kinds` (what the
agent, the CLI and the contracts read too). One whose load is one run needs nothing
here: :class:`broker.scenario.Scenario` runs it from its traits. One of several runs (a
sweep, a search, reloads) adds a module here with a ``Scenario`` subclass that names it
in ``kind`` and overrides ``execute``, as :mod:`.batched`, :mod:`.peak` and
:mod:`.cold_start` do; the modules of this package are searched for such classes
when it is imported, so there is no list to extend.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from types import MappingProxyType

from broker.scenario import Scenario
from mlscope import scenario_traits

__all__ = ["STRATEGIES", "get", "registry"]


def _strategies() -> Mapping[str, type[Scenario]]:
    """Every ``Scenario`` subclass with a ``kind`` in this package's modules."""
    found: dict[str, type[Scenario]] = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, Scenario) and obj.kind:
                found[obj.kind] = obj
    return MappingProxyType(found)


STRATEGIES = _strategies()
"""Scenario name -> its own strategy class (the others use :class:`Scenario`)."""


def get(name: str) -> Scenario:
    """The strategy of the scenario called ``name`` (a ConfigError names the known ones)."""
    traits = scenario_traits.get(name)
    return STRATEGIES.get(name, Scenario)(traits)


def registry() -> dict[str, Scenario]:
    """Every registered scenario's strategy by name, in listing order."""
    return {name: get(name) for name in scenario_traits.names()}
