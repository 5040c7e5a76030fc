"""The Python API: connect, see what can run, submit a job and await its summary,
cancel one, and fetch results as pandas data frames.

::

    import anyio
    from mlscope.api import Client
    from mlscope.contracts import JobRequest, ScenarioSpec

    async def main() -> None:
        async with Client() as client:                 # settings from MLSCOPE_* variables
            print([a.agent_id for a in await client.agents()])
            print(await client.models())               # what live agents serve
            job = JobRequest(model="noop", framework="noop",
                             scenario=ScenarioSpec(name="online", qps=100, duration_s=2))
            summary = await client.submit(job, on_progress=lambda e: print(e.event))
            queries = await client.queries(summary.evaluation_id)   # a DataFrame
            print(summary.latency_ms.p99, len(queries))

    anyio.run(main)

Everything goes over the bus, so it works wherever ``mlscope-submit`` does: results are
read through the server's read-only SQL responder (:mod:`mlscope.remote`), in pages.
Frames hold the rows as stored (times in ns); statistics over them belong to
``analysis/`` (which reads the same tables).

The job client proper (publish with the job id as message id, wait for events, fall
back to the stored result when a "done" was missed) is the one ``mlscope-submit``
uses; :meth:`Client.submit` follows the same protocol on the client's connection.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import ValidationError

from mlscope import bus as busmod
from mlscope import codec, jobs, names, remote
from mlscope.contracts import (
    MAX_ID_CHARS,
    AgentDescription,
    CancelReply,
    CancelRequest,
    EvaluationSummary,
    JobEvent,
    JobRequest,
)
from mlscope.errors import BusDenied, BusError, ConfigError, DatabaseError
from mlscope.registry import list_agents
from mlscope.settings import Settings
from mlscope.tracerows import trace_rows

if TYPE_CHECKING:  # pandas loads when a frame is asked for, not on import
    import pandas as pd

__all__ = ["CANCEL_ON_EXIT_S", "PAGE_ROWS", "Client", "cancel_job"]

PAGE_ROWS = remote.ARROW_PAGE_ROWS
"""Rows asked for per SQL reply (the server sends fewer where they would not fit one
message)."""
CANCEL_ON_EXIT_S = 2.0
"""How long a cancelled :meth:`Client.submit` waits for the server to confirm that it
cancelled the job (the caller is on its way out: not long)."""

Progress = Callable[[JobEvent], object]


def _ident(argument: str, value: object) -> str:
    """``value`` when it is an id (a string of at most MAX_ID_CHARS characters); else a
    ConfigError naming ``argument``: a misused call fails at the API's edge, typed."""
    if not isinstance(value, str):
        raise ConfigError(
            f"{argument} must be a string id, not {type(value).__name__}", argument=argument
        )
    if not value or len(value) > MAX_ID_CHARS:
        raise ConfigError(
            f"{argument} must be 1 to {MAX_ID_CHARS} characters, not {len(value)}",
            argument=argument,
        )
    return value


def _idents(argument: str, values: object) -> list[str]:
    """A list of ids (:func:`_ident` each); a lone string is refused, not split into
    one-character ids."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise ConfigError(
            f"{argument} must be a list of evaluation ids, not {type(values).__name__}",
            argument=argument,
        )
    return [_ident(argument, v) for v in values]


class Client:
    """One connection to an mlscope deployment; ``async with Client(settings)``."""

    def __init__(self, settings: Settings | None = None, *, name: str = "mlscope api") -> None:
        self.settings = settings or Settings.from_env()
        self._name = name
        self._stack = AsyncExitStack()
        self._bus: busmod.Bus | None = None

    async def __aenter__(self) -> Client:
        self._bus = await self._stack.enter_async_context(
            busmod.connect(self.settings, name=self._name)
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._bus = None
        await self._stack.aclose()

    @property
    def bus(self) -> busmod.Bus:
        if self._bus is None:
            raise BusError("the client is not connected: use `async with Client(...)`")
        return self._bus

    # ------------------------------------------------------------------ registry

    async def agents(self) -> list[AgentDescription]:
        """The live agents, as they advertise themselves."""
        return await list_agents(self.bus)

    async def models(self) -> list[dict[str, Any]]:
        """What live agents serve: one ``{name, version, framework, agents}`` per model
        and framework, ``agents`` the ids serving it; sorted by name."""
        served: dict[tuple[str, str, str], list[str]] = {}
        for a in await self.agents():
            for o in a.models:
                served.setdefault((o.name, o.version, o.framework), []).append(a.agent_id)
        return [
            {"name": n, "version": v, "framework": f, "agents": sorted(ids)}
            for (n, v, f), ids in sorted(served.items())
        ]

    # ------------------------------------------------------------------ jobs

    async def submit(
        self, job: JobRequest, *, on_progress: Progress | None = None, timeout: float | None = None
    ) -> EvaluationSummary:
        """Publish ``job`` and await its summary; ``on_progress`` hears every event
        (queued, accepted, progress, restarted, done). A failed job raises its typed error; a
        cancelled one returns its summary with ``status == "cancelled"``.

        Cancelling the await (a cancel scope or task group, ``anyio.fail_after``,
        ``asyncio.wait_for``) cancels the job on the server as well, as Ctrl-C does in
        ``mlscope-submit``: it would otherwise hold its agent for the rest of its run
        with nobody waiting for it. The cancel is sent and awaited at most
        :data:`CANCEL_ON_EXIT_S` before the cancellation goes on."""
        if not isinstance(job, JobRequest):
            raise ConfigError(
                f"job must be a JobRequest, not {type(job).__name__} "
                "(JobRequest.model_validate(...) reads a mapping)",
                argument="job",
            )
        try:
            return await jobs.submit_on(self.bus, job, on_event=on_progress, timeout=timeout)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_ON_EXIT_S):
                await self.cancel(
                    job.job_id,
                    reason="its submitter stopped waiting",
                    timeout=CANCEL_ON_EXIT_S,
                )
            raise

    async def cancel(
        self, job_id: str, *, reason: str = "cancelled by the user", timeout: float = 10.0
    ) -> CancelReply | None:
        """Cancel ``job_id``: the reply of the server that ran it, once the run is
        stored as cancelled; None when no server runs it (a queued job is then not run).
        Credentials that may not cancel are a :class:`~mlscope.errors.BusDenied`."""
        _ident("job_id", job_id)
        try:
            request = CancelRequest(job_id=job_id, reason=reason)
        except ValidationError as exc:
            where = ".".join(str(p) for p in exc.errors()[0]["loc"]) or "arguments"
            raise ConfigError(
                f"cancel: {where}: {exc.errors()[0]['msg']}", argument=where
            ) from None
        try:
            reply = await busmod.request(
                self.bus, names.job_cancel(job_id), codec.encode_model(request), timeout=timeout
            )
        except BusDenied:
            raise  # nobody heard it: "no server runs it" would not be known
        except BusError:
            return None
        return CancelReply.model_validate(reply)

    async def stored(self, evaluation_id: str) -> EvaluationSummary | None:
        """The stored summary of an evaluation, or None when the database has none
        (yet). Where no server answers, its BusError: "none stored" is the database's
        answer, not the lack of one."""
        _ident("evaluation_id", evaluation_id)
        try:
            return await remote.stored_summary(self.bus, evaluation_id, timeout=5.0)
        except DatabaseError:
            return None

    # ------------------------------------------------------------------ results

    async def frame(self, sql: str, parameters: dict[str, Any] | None = None) -> pd.DataFrame:
        """One read-only SELECT as a data frame, read in Arrow pages of at most
        :data:`PAGE_ROWS` rows, each under the max payload (:func:`mlscope.remote.arrow`)."""
        table = await remote.arrow(self.bus, sql, parameters or {}, page_rows=PAGE_ROWS)
        return remote.to_frame(table)

    async def evaluations(self, ids: Sequence[str] | None = None) -> pd.DataFrame:
        """Stored evaluations (all, or ``ids``), newest first, with their ``summary``
        and ``spec`` as JSON text."""
        ids = _idents("ids", ids) if ids is not None else None
        where = " WHERE evaluation_id IN {ids:Array(String)}" if ids is not None else ""
        return await self.frame(
            "SELECT * FROM evaluations FINAL" + where + " ORDER BY created_at DESC, evaluation_id",
            {"ids": list(ids)} if ids is not None else {},
        )

    async def queries(self, evaluation_id: str) -> pd.DataFrame:
        """The raw per-query records of one evaluation, by query index."""
        _ident("evaluation_id", evaluation_id)
        return await self._keyset(
            "SELECT * FROM queries FINAL WHERE evaluation_id = {e:String}",
            {"e": evaluation_id},
            (("query_index", "UInt32"),),
        )

    async def spans(self, evaluation_id: str) -> pd.DataFrame:
        """The trace spans of one evaluation, by start time (then agent and span id):
        those of the agent it ran on (:func:`mlscope.tracerows.trace_rows`)."""
        _ident("evaluation_id", evaluation_id)
        return await self._keyset(
            f"SELECT * FROM {trace_rows('spans')}",
            {"e": evaluation_id},
            (("start_ns", "Int64"), ("agent_id", "String"), ("span_id", "UInt64")),
        )

    async def _keyset(
        self, select: str, parameters: dict[str, Any], key: tuple[tuple[str, str], ...]
    ) -> pd.DataFrame:
        """Every row of ``select`` as one frame, read in keyset frames
        (:func:`mlscope.remote.keyset_pages`): the server holds one frame at a time,
        whatever the table's length."""
        import pyarrow as pa

        tables = [t async for t in remote.keyset_pages(self.bus, select, parameters, key)]
        return remote.to_frame(pa.concat_tables(tables))


async def cancel_job(
    settings: Settings, job_id: str, *, reason: str = "cancelled by the user", timeout: float
) -> CancelReply | None:
    """:meth:`Client.cancel` on a connection of its own."""
    async with Client(settings, name="mlscope cancel") as client:
        return await client.cancel(job_id, reason=reason, timeout=timeout)
