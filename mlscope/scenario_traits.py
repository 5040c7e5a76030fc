"""What each benchmarking scenario is, in one place every process can read.

A scenario is declared once, by one :class:`ScenarioTraits`, in its own module of
:mod:`mlscope.scenario_kinds` (found there automatically: no list to extend). From the
traits everything else is derived:

* the names a job may ask for (``ScenarioSpec.name`` is validated against them; the
  JSON schema lists them; ``mlscope-submit --scenario`` and the dashboard offer them);
* the server's strategy (``broker.scenario_kinds``): one run of an open loop on the
  traits' ``arrivals`` or of a closed loop at their depth, judged with their validity
  rules; a scenario of several runs (a sweep, a search, reloads) adds its own strategy
  class there;
* the agent's local run (``placement: agent``), which may not import the broker: its
  arrivals or closed-loop depth, and whether it can run there at all;
* where a job that names no placement runs (``JobRequest.placement``);
* a scenario file's required fields, a job's time limit, the dashboard's form.

The registry is filled once per process, when a name is first asked for. A scenario
declared outside this package registers itself the same way, in a module named in
``MLSCOPE_SCENARIO_MODULES`` (``Settings.scenario_modules``): every process the CLI
starts imports those (:func:`load_modules`), so the submitter, the server and the
agents agree on the names.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from mlscope.errors import ConfigError

__all__ = [
    "OWN_FIELDS",
    "Extent",
    "ScenarioTraits",
    "check_name",
    "get",
    "load_modules",
    "names",
    "register",
    "registered",
    "unregister",
]

Arrivals = Callable[[Any], tuple[Any, float]]
"""``spec -> (schedule, window_s)``: an open loop's arrivals (:mod:`mlscope.schedule`
gives them their types; this module sits below the contracts and cannot name them)."""


def _one_run(spec: Any) -> int:
    return 1


@dataclass(frozen=True)
class Extent:
    """How long one run of a scenario is planned to last: seconds of its clock, a count
    of answered queries, or both (whichever it reaches first ends it); None where the
    spec does not say."""

    seconds: float | None = None
    queries: int | None = None

    def fraction(self, queries_done: int, elapsed_s: float) -> float | None:
        """How far a run is, 0 to 1, from a progress event's figures; None when the
        extent is unknown (a progress display then shows only the figures)."""
        parts = []
        if self.seconds:
            parts.append(elapsed_s / self.seconds)
        if self.queries:
            parts.append(queries_done / self.queries)
        return min(max(max(parts), 0.0), 1.0) if parts else None


def _timed(spec: Any) -> Extent:
    return Extent(seconds=spec.duration_s, queries=spec.max_queries)


OWN_FIELDS = frozenset(
    {
        "qps",
        "concurrency",
        "batch_sizes",
        "peak_trials",
        "arrivals_s",
        "segments",
        "repetitions",
        "warm_queries",
        "loadgens",
        "loadgen_hosts",
    }
)
"""The ``ScenarioSpec`` fields that shape the load of some scenarios only: a scenario
reads one when its ``fields`` name it (``loadgen_hosts`` goes with ``loadgens``).
Every scenario reads the others (batch size, seed, warm-up, the validity settings),
and ``duration_s`` unless its ``length`` comes from elsewhere."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ScenarioTraits:
    """One scenario, declared: its name, its load and its rules."""

    name: str
    """What ``ScenarioSpec.name`` says (lower case, digits and hyphens)."""
    summary: str
    """One line for ``--help``, the JSON schema and the docs."""
    arrivals: Arrivals | None = None
    """An open loop's arrivals; None for a closed loop (``concurrency`` outstanding)."""
    concurrency: int | None = None
    """A closed loop's fixed depth (single-stream: 1); None: the spec's ``concurrency``."""
    local_depth: int = 1
    """A closed loop run in the agent keeps at least this many queries in flight."""
    local: bool = True
    """Whether the agent can run it (``placement: agent``)."""
    local_stream: bool = False
    """In the agent, on samples it holds pre-processed, it runs as one stream on the
    model's predict thread (``agent.pipeline.Executor.stream``): batches back to back,
    answers post-processed in blocks. For a throughput scenario, whose queries wait on
    no one's answer: the runtime is never kept waiting by the platform."""
    placement: str = "server"
    """Where its load is generated when a job does not say: ``agent`` for a scenario
    that measures the model itself (a throughput sweep: no query need cross the bus),
    ``server`` for one that measures the model as served over the bus."""
    poisson: bool = False
    """Arrivals are Poisson: the verdict allows for the rate's sampling noise."""
    rate_driven: bool = False
    """``qps`` is the rate the user asked for (judged against the achieved rate)."""
    early_stopping: bool = True
    """Its runs must show their latency percentile by early stopping (a throughput
    scenario has no latency target)."""
    percentile: float | None = None
    """The latency percentile its verdict targets (None: the policy's, p99)."""
    fields: frozenset[str] = frozenset()
    """The ``ScenarioSpec`` fields it reads beyond the common ones (the dashboard's
    form enables exactly these)."""
    requires: tuple[str, ...] = ()
    """Fields a scenario file must set."""
    file_aliases: tuple[tuple[str, str], ...] = ()
    """``(file field, spec field)``: a scenario file's field read as another."""
    length: str | None = None
    """What sets how long it runs when ``duration_s`` does not (piecewise: its
    segments); it then does not read ``duration_s`` (:meth:`reads`)."""
    ignores: tuple[tuple[str, str], ...] = ()
    """``(field, why)``: common ``ScenarioSpec`` fields its runs do not read (cold-start
    runs a fixed count of warm queries after each load and judges the loads, not a
    timed run's latency), and what it does instead."""
    extent: Callable[[Any], Extent] = _timed
    """``spec ->`` how long each of its runs is planned to last (default: ``duration_s``
    or ``max_queries``); it says the same as ``length`` where that is set."""
    runs: Callable[[Any], int] = _one_run
    """``spec -> `` the most runs it makes (a sweep's points, a search's trials)."""
    position: int = 1000
    """Where it is listed (lower first; built-ins 0-99)."""

    @property
    def closed_loop(self) -> bool:
        """No schedule: queries are kept outstanding instead."""
        return self.arrivals is None

    def reads(self, field: str) -> bool:
        """Whether its runs read the ``ScenarioSpec`` field ``field``. Where a user sets
        one it does not read (a flag, a scenario file) the job is refused rather than
        run with the value ignored: a run of another length or load than asked for."""
        if field == "duration_s":
            return self.length is None
        if any(field == f for f, _ in self.ignores):
            return False
        if field == "loadgen_hosts":
            field = "loadgens"
        return field not in OWN_FIELDS or field in self.fields

    def unread(self, field: str) -> str:
        """Why it does not read ``field`` (for a refusal): what it reads instead."""
        if field == "duration_s" and self.length is not None:
            return f"its length is set by {self.length}"
        why = next((w for f, w in self.ignores if f == field), None)
        if why is not None:
            return why
        own = sorted(self.fields & OWN_FIELDS)
        return f"its own settings are {', '.join(own)}" if own else "it has no settings of its own"

    def depth(self, concurrency: int, *, local: bool = False) -> int:
        """Queries a closed loop keeps in flight for a spec's ``concurrency``."""
        if self.concurrency is not None:
            return self.concurrency
        return max(concurrency, self.local_depth) if local else concurrency


_KINDS: dict[str, ScenarioTraits] = {}
"""The registry, process-wide as the set of importable modules is: filled from
:mod:`mlscope.scenario_kinds` on first use, then by :func:`register`."""
_LOADING = threading.RLock()  # a module being loaded may ask for a name
_LOADED = threading.Event()


def _load() -> dict[str, ScenarioTraits]:
    """The registry, after importing every module of :mod:`mlscope.scenario_kinds` once
    (each registers its scenarios when imported); a second thread waits for the first."""
    if not _LOADED.is_set():
        with _LOADING:
            if not _LOADED.is_set():
                package = importlib.import_module("mlscope.scenario_kinds")
                for info in pkgutil.iter_modules(package.__path__):
                    importlib.import_module(f"{package.__name__}.{info.name}")
                _LOADED.set()
    return _KINDS


def load_modules(modules: Iterable[str]) -> None:
    """Import each module named (``Settings.scenario_modules``): those that declare
    scenarios register them when imported. A module that cannot be imported is a
    ConfigError naming it."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(
                f"scenario module {name!r} cannot be imported: {exc}",
                field="MLSCOPE_SCENARIO_MODULES",
            ) from exc


def register(traits: ScenarioTraits) -> ScenarioTraits:
    """Add ``traits`` to the registry (a ConfigError when its name is taken)."""
    if traits.name in _KINDS and _KINDS[traits.name] != traits:
        raise ConfigError(f"scenario {traits.name!r} is registered twice", field="scenario")
    _KINDS[traits.name] = traits
    return traits


def unregister(name: str) -> None:
    """Remove the scenario called ``name`` (a no-op when there is none)."""
    _KINDS.pop(name, None)


@contextmanager
def registered(traits: ScenarioTraits) -> Iterator[ScenarioTraits]:
    """``traits`` registered for the ``with`` block only."""
    _load()
    register(traits)
    try:
        yield traits
    finally:
        unregister(traits.name)


def names() -> tuple[str, ...]:
    """Every scenario name, in listing order."""
    kinds = _load()
    return tuple(sorted(kinds, key=lambda n: (kinds[n].position, n)))


def get(name: str) -> ScenarioTraits:
    """The scenario called ``name`` (a ConfigError names the known ones)."""
    try:
        return _load()[name]
    except KeyError:
        raise ConfigError(
            f"unknown scenario {name!r} (known: {', '.join(names())})", field="scenario"
        ) from None


def check_name(name: str) -> str:
    """``name`` when it is a registered scenario (a ValueError names the known ones:
    pydantic reports it as the field's error)."""
    if name not in _load():
        raise ValueError(f"unknown scenario {name!r} (known: {', '.join(names())})")
    return name
