"""The models an agent holds: which it may serve (and why not the rest), and the loaded ones.

Every model of the agent's framework is verified against its build lock or pin before
it is offered (:mod:`agent.offers`); built zoo models the data directory lacks are
fetched from the bus's artifact bucket first. A loaded model is one predictor behind
one :class:`~agent.pipeline.Executor`, kept per model key and shared by every
evaluation prepared on it; it is closed when the last of them lets it go.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from agent.offers import Offer, servable, verified_graph
from agent.pipeline import Executor, ExecutorConfig
from agent.worker import LoadedModel
from mlscope import artifact_bucket
from mlscope.artifacts import ArtifactStore, zoo_coordinates
from mlscope.bus import Bus
from mlscope.catalog import Catalog, Entry
from mlscope.contracts import MAX_REFUSALS, REFUSAL_MESSAGE_MAX_CHARS, RefusedModel
from mlscope.errors import ConfigError, MLScopeError
from mlscope.fetchpolicy import FetchPolicy
from mlscope.framework_manifest import FrameworkManifest
from mlscope.manifest import is_built
from mlscope.predictor import PredictorOptions
from mlscope.settings import Settings

__all__ = ["ModelHost"]

log = logging.getLogger("mlscope.agent")


@dataclass(kw_only=True)
class ModelHost:
    """One agent's models: offered, refused and loaded."""

    settings: Settings
    framework: str
    who: str
    """The agent, as errors and logs name it (``agent <id>``)."""
    device: str = "cpu"
    threads: int | None = None
    """``--threads``: wins over the framework manifest's runtime options."""
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    """How each loaded model's executor admits and batches (``max_batch`` is set per
    evaluation)."""
    framework_manifest: FrameworkManifest | None = None
    """The framework manifest whose runtime options the predictors get (the one of the
    probed version when the catalog has it)."""
    runtime_version: str = ""
    """The probed runtime's version, which manifests' framework constraints are checked
    against (set once the framework is probed)."""
    offers: list[Offer] = field(default_factory=list)
    refused: list[RefusedModel] = field(default_factory=list)
    """Manifests of this framework not served here, and why (advertised too)."""
    workers: dict[str, Executor] = field(default_factory=dict)
    """The loaded models' executors, by model key."""
    loaded_settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per loaded model key: what it was opened with (reported by prepare)."""

    def __post_init__(self) -> None:
        self.store = ArtifactStore(
            self.settings.data_dir,
            zoo_dir=self.settings.zoo_dir,
            policy=FetchPolicy.from_settings(self.settings),
        )
        """Remembers verified files by size and mtime: re-checking one is a stat."""

    # ------------------------------------------------------------------ offered

    def check(self, e: Entry) -> Path:
        """The verified graph of ``e`` here (:func:`agent.offers.verified_graph`)."""
        return verified_graph(
            e,
            runtime_version=self.runtime_version,
            zoo_dir=self.settings.zoo_dir,
            store=self.store,
            allow_custom=self.settings.allow_custom_code,
        )

    def servable(self, catalog: Catalog) -> tuple[list[Offer], list[RefusedModel]]:
        """What may be served now from ``catalog``, and what is refused
        (:func:`agent.offers.servable`)."""
        return servable(catalog.entries, framework=self.framework, check=self.check)

    async def fetch_missing(self, bus: Bus, catalog: Catalog) -> None:
        """Built zoo models of this framework that the data dir lacks, fetched from the
        bus's artifact bucket (verified file by file; see mlscope.artifact_bucket). The
        bucket is written by other clients: whatever one model's fetch raises, that
        model is not served (its refusal says why) and the agent goes on."""
        wanted = sorted(
            {
                str(e.manifest.assets.base_url)
                for e in catalog.entries
                if e.manifest.framework.name == self.framework
                and is_built(e.manifest.assets.base_url)
            }
        )
        for url in wanted:
            try:
                name, version = zoo_coordinates(url)
                await artifact_bucket.fetch(
                    bus,
                    self.settings.zoo_dir,
                    name,
                    version,
                    log=self._log,
                    max_bytes=self.settings.max_artifact_bytes,
                )
            except Exception as exc:  # not served then; the refusal says why
                self._log(f"cannot fetch {url[:100]} from the artifact bucket: {exc!r}")

    def offer(self, name: str, version: str) -> Entry:
        """The entry served for ``name@version``; ConfigError (with the reason it was
        refused, if it was) when none is."""
        for e, _ in self.offers:
            if e.manifest.name == name and e.manifest.version == version:
                return e
        why = next((r for r in self.refused if (r.name, r.version) == (name, version)), None)
        raise ConfigError(
            f"{self.who} does not serve {name}@{version}" + (f": {why.message}" if why else ""),
            model=name,
            version=version,
        )

    def advertised_refusals(self) -> tuple[tuple[RefusedModel, ...], int]:
        """The refusals the agent's registry entry lists, and how many more there are:
        the first :data:`~mlscope.contracts.MAX_REFUSALS`, each message cut to
        :data:`~mlscope.contracts.REFUSAL_MESSAGE_MAX_CHARS`. The bus may hold any number
        of manifests this agent cannot serve; its entry must still fit one message
        (:meth:`offer` keeps naming the whole reason)."""
        listed = tuple(
            r
            if len(r.message) <= REFUSAL_MESSAGE_MAX_CHARS
            else r.model_copy(
                update={"message": r.message[: REFUSAL_MESSAGE_MAX_CHARS - 3] + "..."}
            )
            for r in self.refused[:MAX_REFUSALS]
        )
        return listed, len(self.refused) - len(listed)

    def entry(self, key: str) -> Entry:
        """The offered entry of model key ``key`` (a prepared evaluation's model)."""
        return next(e for e, _ in self.offers if e.manifest.key == key)

    # ------------------------------------------------------------------ loaded

    def options(self, batch_size: int = 1) -> PredictorOptions:
        """How a model is opened here: the device and ``--threads``, and the runtime
        options the framework manifest gives for that device."""
        fm = self.framework_manifest
        return PredictorOptions(
            device=self.device,
            threads=self.threads,
            batch_size=batch_size,
            runtime=fm.runtime(self.device) if fm else {},
        )

    async def load(self, entry: Entry, graph: Path, batch: int) -> tuple[int, int]:
        """Open ``entry``'s model and its executor, whose predict thread runs the first
        inference; returns (load ns, first inference ns). A model whose first inference
        fails is closed and its error raised."""
        opts = self.options(batch)
        model = await anyio.to_thread.run_sync(
            functools.partial(
                LoadedModel.open,
                entry,
                graph,
                opts,
                labels=self._labels(entry),
                allow_custom=self.settings.allow_custom_code,
            )
        )
        executor = Executor(
            model,
            dataclasses.replace(self.executor, max_batch=batch),
            warm=True,  # the first inference on the thread that will predict
        )
        try:
            first_ns = await anyio.to_thread.run_sync(executor.first_inference_ns)
        except MLScopeError:
            await anyio.to_thread.run_sync(executor.stop)  # and closes the predictor
            raise
        key = entry.manifest.key
        self.loaded_settings[key] = self._opened_with(opts, model)
        self.workers[key] = executor
        return model.load_ns, first_ns

    async def unload(self, key: str, *, in_use: Collection[str]) -> bool:
        """Stop and close the loaded model ``key`` unless a key of ``in_use`` (the
        prepared evaluations') names it; True if it was."""
        if key not in self.workers or key in in_use:
            return False
        worker = self.workers.pop(key)
        self.loaded_settings.pop(key, None)
        await anyio.to_thread.run_sync(worker.stop)
        return True

    async def stop_all(self) -> None:
        """Stop every loaded model (the agent is leaving)."""
        for worker in self.workers.values():
            await anyio.to_thread.run_sync(worker.stop)

    def _opened_with(self, opts: PredictorOptions, model: LoadedModel) -> dict[str, Any]:
        """The options a model was opened with, and what its runtime says it uses
        (a predictor's optional ``effective_options()``: e.g. ORT's providers)."""
        found = getattr(model.predictor, "effective_options", None)
        return {
            "device": opts.device,
            "threads": opts.intra_op_threads,
            "runtime": dict(opts.runtime),
            "effective": found() if callable(found) else None,
            "framework_manifest": (
                self.framework_manifest.version if self.framework_manifest else None
            ),
        }

    def _labels(self, entry: Entry) -> list[str] | None:
        """The first output's labels file, when the manifest names one that is local
        (labels name top-k results for queries that ask; remote assets have none)."""
        try:
            return entry.labels(self.settings.zoo_dir)
        except MLScopeError:
            return None

    def _log(self, message: str) -> None:
        log.info("%s: %s", self.who, message)
