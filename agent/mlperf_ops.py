"""The agent's MLPerf requests: its sample libraries and LoadGen runs in its host.

* ``load_samples`` / ``unload_samples`` (ctl, request/reply): LoadGen's QSL callbacks
  for a prepared evaluation, answered with what the library holds
  (:class:`agent.samplelib.SampleLibrary`, one memory budget for all of them);
* ``mlscope.agent.<id>.samples``: a query naming held samples, run on the
  evaluation's executor like any query (pre-processing skipped when held
  pre-processed);
* ``mlperf`` (ctl): LoadGen next to the model (:mod:`agent.mlperf_local`);
* release (and shutdown) drops the evaluation's library and ends its LoadGen process.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup

from agent.job import Job
from agent.mlperf_local import MLPerfRunner
from agent.pipeline import Executor
from agent.samplelib import MemoryBudget, SampleLibrary
from mlscope import samples
from mlscope.catalog import Entry
from mlscope.contracts import (
    MLPERF_LOADGEN,
    MLPerfRunOp,
    MLPerfStarted,
    QueryReply,
    SamplesLoadOp,
    SamplesQuery,
    SamplesReply,
    SamplesUnloadOp,
    TraceLevel,
)
from mlscope.errors import ConfigError, EvaluationError
from mlscope.predictor import PredictorOptions

__all__ = ["MLPerfOps", "loadgen_installed"]


def loadgen_installed() -> bool:
    """Whether this host can run MLPerf LoadGen (``mlscope[mlperf]``)."""
    try:
        return importlib.util.find_spec("mlperf_loadgen") is not None
    except (ImportError, ValueError):  # blocked, or a module without a spec
        return False


@dataclass
class MLPerfOps:
    """Sample libraries and LoadGen runs of one agent (see the module doc)."""

    agent_id: str
    zoo_dir: Path
    budget: MemoryBudget
    runs_here: bool
    """Whether this agent runs LoadGen itself (the ``mlperf-loadgen`` feature)."""
    libraries: dict[str, SampleLibrary] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.runner = MLPerfRunner(service=f"agent {self.agent_id}")

    async def load(self, op: SamplesLoadOp, worker: Executor, entry: Entry) -> SamplesReply:
        lib = self.libraries.get(op.evaluation_id)
        if lib is None:
            data = await anyio.to_thread.run_sync(samples.dataset, entry, self.zoo_dir)
            if data is None:
                raise ConfigError(
                    f"{entry.manifest.name} has no labelled data set: the agent cannot "
                    "hold its samples",
                    model=entry.manifest.name,
                )
            lib = await anyio.to_thread.run_sync(
                SampleLibrary, op.evaluation_id, data[0], worker.model, self.budget
            )
            self.libraries[op.evaluation_id] = lib
        await anyio.to_thread.run_sync(lib.load, op.indices)
        return _held(lib)

    async def unload(self, op: SamplesUnloadOp) -> SamplesReply:
        lib = self._library(op.evaluation_id)
        await anyio.to_thread.run_sync(lib.unload, op.indices)
        return _held(lib)

    def job(self, q: SamplesQuery, received: int, reply: Callable[[QueryReply], None]) -> Job:
        """The executor job of a samples query (its batch taken from the library)."""
        lib = self._library(q.evaluation_id)
        return Job(
            index=q.index,
            inputs=lib.take(q.samples),
            received_ns=received,
            level=TraceLevel.NONE,
            spans=None,
            reply=reply,
            preprocessed=lib.preprocessed,
        )

    async def release(self, evaluation_id: str) -> None:
        lib = self.libraries.pop(evaluation_id, None)
        if lib is not None:
            lib.clear()
        await self.runner.stop(evaluation_id)

    async def run(
        self,
        op: MLPerfRunOp,
        *,
        entry: Entry,
        graph: Path,
        options: PredictorOptions,
        executor: dict[str, Any],
        allow_custom: bool,
        publish: Callable[[bytes], Awaitable[None]],
        tg: TaskGroup,
    ) -> MLPerfStarted:
        """Start LoadGen in a child process of this agent for a prepared evaluation."""
        self.require()
        cfg = {
            "spec": op.spec.model_dump(),
            "conf_model": op.conf_model,
            "evaluation_id": op.evaluation_id,
            "manifest": entry.manifest.model_dump_json(by_alias=True),
            "manifest_path": str(entry.path),
            "trusted": entry.trusted,
            "zoo_dir": str(self.zoo_dir),
            "graph": str(graph),
            "options": {
                "device": options.device,
                "threads": options.threads,
                "batch_size": op.spec.batch_size,
                "runtime": options.runtime,
            },
            "executor": executor,
            "allow_custom": allow_custom,
            "sample_memory_bytes": self.budget.limit - self.budget.used,
        }
        pid, finish = await self.runner.start(op, cfg, publish, env=_child_env())
        tg.start_soon(finish)
        return MLPerfStarted(pid=pid)

    def require(self) -> None:
        """Refuse, by the feature's name, when this agent does not run LoadGen itself."""
        if not self.runs_here:
            raise ConfigError(
                f"agent {self.agent_id} does not run MLPerf LoadGen itself (no "
                f"{MLPERF_LOADGEN!r} feature: mlcommons-loadgen is not installed, or local "
                "runs are off); use placement server",
                field="placement",
                agent_id=self.agent_id,
            )

    def _library(self, evaluation_id: str) -> SampleLibrary:
        lib = self.libraries.get(evaluation_id)
        if lib is None:
            raise EvaluationError(
                f"agent {self.agent_id} holds no samples for evaluation {evaluation_id}",
                evaluation_id=evaluation_id,
            )
        return lib


def _held(lib: SampleLibrary) -> SamplesReply:
    return SamplesReply(held=len(lib.held), bytes=lib.bytes, preprocessed=lib.preprocessed)


def _child_env() -> dict[str, str]:
    """The agent's environment, with this checkout first on the child's path."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env
