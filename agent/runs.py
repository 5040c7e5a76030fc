"""An agent's local runs (placement agent), by evaluation: started by a run request,
stopped by the evaluation's release or by a new prepare of it (its job restarted on
another server).

A run is a :class:`~agent.localrun.LocalRun` on the prepared evaluation's executor,
served by :func:`agent.runrows.serve_run` in the agent's task group: its rows go on
the agent's own rows subject (:func:`mlscope.names.agent_rows`), not the request's
reply subject, since under credentials an answer is allowed only for a while after the
request and a run's rows go on for as long as the run.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from anyio.abc import TaskGroup

from agent.localinputs import run_inputs
from agent.localrun import LocalRun
from agent.pipeline import Executor
from agent.runrows import Publish, rows_publisher, serve_run
from agent.samplelib import MemoryBudget
from agent.tracer import Tracer
from mlscope import names
from mlscope.bus import Bus
from mlscope.catalog import Entry
from mlscope.contracts import RunOp, RunStarted, TraceLevel
from mlscope.errors import ConfigError, EvaluationError
from mlscope.tuning import ProcessTuning

__all__ = ["FINAL_ROWS_WAIT_S", "LocalRuns"]

FINAL_ROWS_WAIT_S = 15.0
"""How long stopping a local run waits for its final rows (shipping them gives up
after 10 s)."""


@dataclass
class _Running:
    """A local run's task: its scope (cancelled to stop it) and the event set once it
    has ended, its final rows shipped."""

    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    done: anyio.Event = field(default_factory=anyio.Event)


@dataclass
class Prepared:
    """What a run needs of the evaluation the agent was prepared for."""

    worker: Executor
    level: TraceLevel
    """The evaluation's trace level (a run traces at most this much)."""
    entry: Entry
    released: threading.Event | None = None
    """Set when the evaluation is released: the run's queries still queued are not run
    (:attr:`agent.job.Job.released`)."""
    trace_id: str = ""
    """The id the run's spans are kept under: its run's (``RunOp.run_id``) when the
    evaluation makes several, else the evaluation's ("" too)."""


@dataclass
class LocalRuns:
    """The local runs of one agent, at most one per evaluation."""

    agent_id: str
    enabled: bool
    """Whether this agent runs load itself (``AgentConfig.local_runs``)."""
    zoo_dir: Path
    sample_memory: MemoryBudget
    """What every local run's held samples draw on (shared with the sample libraries)."""
    tuning: ProcessTuning
    """The process's one owner of GC and switch interval (runs of several evaluations
    may overlap)."""
    running: dict[str, _Running] = field(default_factory=dict)
    """Each evaluation's run now running, by evaluation id."""

    async def start(
        self,
        req: RunOp,
        reply: str,
        prepared: Prepared | None,
        *,
        bus: Bus,
        tracer: Tracer,
        tg: TaskGroup,
    ) -> RunStarted:
        """Start the run ``req`` asks for on its prepared evaluation (None: it was not
        prepared here): answered at once with the run's t0; its rows follow on the
        agent's rows subject, served in ``tg``."""
        if not reply:
            raise ConfigError("a run request needs a reply subject (its start is answered)")
        if not self.enabled:
            raise ConfigError(
                f"agent {self.agent_id} does not run load itself (placement agent is "
                "off on it); use placement server",
                field="placement",
            )
        if prepared is None:
            raise EvaluationError(
                f"agent {self.agent_id} was not prepared for evaluation {req.evaluation_id}"
            )
        if req.evaluation_id in self.running:
            raise EvaluationError(
                f"evaluation {req.evaluation_id} already has a run on agent {self.agent_id}",
                evaluation_id=req.evaluation_id,
            )
        # An open loop is a timed measurement (switch interval, no GC: the process's
        # one owner holds them, local runs of several evaluations may overlap), set
        # before the clock starts; serve_run lets go of it, and of the samples held,
        # when the run's rows are shipped.
        held = contextlib.ExitStack()
        try:
            run = await self._local_run(req, prepared, tracer, held)
            held.enter_context(
                self.tuning.load() if run.closed else self.tuning.measurement(realtime_loop=False)
            )
            t0 = await anyio.to_thread.run_sync(run.prepare)
            running = self.running[req.evaluation_id] = _Running()
            publish = rows_publisher(bus, names.agent_rows(self.agent_id, req.evaluation_id))
            max_bytes = min(req.max_bytes, bus.payload_budget())
            tg.start_soon(self._serve, running, run, req, publish, held, max_bytes)
        except BaseException:
            held.close()
            raise
        scheduled = len(run.schedule) if run.schedule is not None else 0
        return RunStarted(
            t0_agent=t0,
            queries=scheduled,
            preprocess="ahead" if run.preprocessed else "timed",
            streamed=run.streamed,
        )

    async def stop(self, evaluation_id: str) -> None:
        """Stop the evaluation's run, once its final rows are shipped (so none reaches
        a run started after this); nothing when it has none."""
        running = self.running.pop(evaluation_id, None)
        if running is not None:
            running.scope.cancel()
            with anyio.move_on_after(FINAL_ROWS_WAIT_S):
                await running.done.wait()

    async def _serve(
        self,
        running: _Running,
        run: LocalRun,
        req: RunOp,
        publish: Publish,
        held: contextlib.ExitStack,
        max_bytes: int,
    ) -> None:
        """:func:`serve_run` in the scope of ``running``, which :meth:`stop` cancels."""
        try:
            with running.scope:
                await serve_run(
                    run, req, publish, f"agent {self.agent_id}", held=held, max_bytes=max_bytes
                )
        finally:
            running.done.set()
            if self.running.get(req.evaluation_id) is running:
                del self.running[req.evaluation_id]

    async def _local_run(
        self, req: RunOp, prepared: Prepared, tracer: Tracer, held: contextlib.ExitStack
    ) -> LocalRun:
        """The run ``req`` asks for on the prepared executor, its inputs ready (held
        pre-processed samples are given back when ``held`` closes)."""
        inputs, held_bytes = await anyio.to_thread.run_sync(
            functools.partial(
                run_inputs,
                prepared.entry,
                prepared.worker.model,
                req,
                zoo_dir=self.zoo_dir,
                budget=self.sample_memory,
            )
        )
        if held_bytes is not None:
            held.callback(self.sample_memory.release, held_bytes)
        level = TraceLevel(min(TraceLevel.parse(req.trace_level), prepared.level))
        busy = f"agent {self.agent_id} is overloaded"
        return await anyio.to_thread.run_sync(  # a long schedule takes seconds to draw
            functools.partial(
                LocalRun,
                prepared.worker,
                req.scenario,
                inputs=inputs,
                level=level,
                spans=(
                    tracer.buffer(prepared.trace_id or req.evaluation_id)
                    if level > TraceLevel.NONE
                    else None
                ),
                overloaded=lambda _i: busy,
                preprocessed=held_bytes is not None,
                released=prepared.released,
            )
        )
