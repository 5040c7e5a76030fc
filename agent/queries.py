"""The agent's query handlers: a query to the agent's own subject or to a capability it
serves (one queue group per served model), and a query naming samples the agent holds
(MLPerf's system under test).

A query names its evaluation, which must be prepared here, or one of its runs
(:class:`agent.evaluations.Evaluations`: its spans are kept under the id it names);
it is admitted to that evaluation's executor
(:mod:`agent.pipeline`), whose threads reply through the outbox; one that its
executor cannot admit is answered "overloaded" at once. Failures are the serving
boundary's
(:class:`mlscope.serving.Boundary`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from nats.aio.msg import Msg

from agent.evaluations import Evaluations
from agent.job import Job
from agent.outbox import Outbox
from mlscope import wire
from mlscope.bus import answerable
from mlscope.contracts import ErrorReply, QueryReply, SamplesQuery, TraceLevel
from mlscope.errors import EvaluationError, MLScopeError, OverloadedError, WireError

__all__ = ["Queries"]

now = time.perf_counter_ns


@dataclass
class Queries:
    """Queries to one agent, admitted to the executors of its prepared evaluations."""

    evaluations: Evaluations
    outbox: Outbox
    """Where the replies made on the executors' threads go out, from the event loop."""

    async def on_query(self, data: bytes, msg: Msg) -> ErrorReply | None:
        """Admit one query (decoded here, after its arrival is stamped); the reply
        comes from the predict thread, or from this one when the executor runs the
        query inline (an idle pipeline and a fast model: no thread hop at all).
        Failures are the serving boundary's."""
        received = now()
        query = wire.decode_query(data)  # a structural check: no pydantic per query
        ev = self.evaluations
        session = ev.by_id.get(query.evaluation_id)  # the evaluation's id, or a run's
        if session is None:
            raise EvaluationError(  # its index: the load generator fails that query
                f"agent {ev.agent_id} was not prepared for evaluation {query.evaluation_id}",
                evaluation_id=query.evaluation_id,
                index=query.index,
            )
        if query.evaluation_id != session.sampled_as:  # a sweep's next run: once a run
            ev.follow(session, query.evaluation_id)
        level = TraceLevel(min(query.trace_level, session.level))
        spans = ev.tracer.buffer(query.evaluation_id) if level > TraceLevel.NONE else None
        job = Job(
            index=query.index,
            inputs=query.inputs,
            received_ns=received,
            level=level,
            spans=spans,
            reply=self._replier(msg.reply),
            raw=query.raw,
            labels=query.labels,
            more=query.more_inputs,
            released=session.released,
        )
        worker = session.worker
        if worker.try_inline(job):
            await self.outbox.flush()
            return None
        if not worker.submit(job):
            busy = OverloadedError(f"agent {ev.agent_id} is overloaded", index=query.index)
            return ErrorReply(error=busy.to_wire())
        return None

    async def on_samples_query(self, query: SamplesQuery, msg: Msg) -> ErrorReply | None:
        """A query naming held samples (MLPerf's SUT): run like any query; the reply
        comes from the predict thread."""
        received = now()
        ev = self.evaluations
        worker, _ = ev.prepared(query.evaluation_id)
        try:
            job = ev.mlperf.job(query, received, self._replier(msg.reply))
        except MLScopeError as exc:  # the SUT completes the query's samples by its index
            wire = exc.to_wire()
            return ErrorReply(error={**wire, "fields": {**wire["fields"], "index": query.index}})
        if not worker.submit(job):
            busy = OverloadedError(f"agent {ev.agent_id} is overloaded", index=query.index)
            return ErrorReply(error=busy.to_wire())
        return None

    def _replier(self, subject: str) -> Any:
        """The query's answer, to its reply subject: an inbox, or the query is refused
        before it runs (the agent never publishes in a requester's stead)."""
        if not answerable(subject):
            raise WireError(f"a query whose reply subject is no inbox: {subject!r}")
        put = self.outbox.put

        def send(reply: QueryReply) -> None:  # on the predict thread
            put(subject, wire.encode_reply(reply))

        return send
