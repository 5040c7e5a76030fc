"""Every subject, stream, consumer and bucket name mlscope uses, built in one place.

Subjects (core NATS unless marked JetStream):

    mlscope.jobs.submit                JetStream (stream MLSCOPE_JOBS, work queue): jobs
    mlscope.job.<job_id>.events        progress, accepted and done events of one job
    mlscope.job.<job_id>.cancel        stop one job (every server hears it)
    mlscope.cap.<framework>.<model>    capability subject; queue group of the same name
    mlscope.agent.<agent_id>.query     queries directed at one agent
    mlscope.agent.<agent_id>.ctl       control requests to one agent (``ControlRequest``:
                                       ping, describe, prepare, release, run, the
                                       sample library's load/unload, mlperf)
    mlscope.agent.<agent_id>.samples   queries naming samples the agent holds (MLPerf)
    mlscope.agent.<agent_id>.rows.<eval_id>
                                       the rows of one agent's local run (placement agent),
                                       or its MLPerf run's MLPerfDone
    mlscope.traces.<eval_id>.<agent_id>
                                       JetStream (stream MLSCOPE_TRACES): span and sample
                                       batches of one agent in one evaluation (the
                                       ingester stores a batch only from the subject its
                                       own fields name; an agent's own user publishes
                                       only under its id); stored as
                                       mlscope.traces.<agent_id> (one budget per agent)
    mlscope.db.sql                     read-only SQL against the evaluation database
    mlscope.db.sql.page.<server_id>    the next page of a result that server holds
                                       (no queue group: only the replica that ran the
                                       statement has it)
    mlscope.db.sql.close.<server_id>   release a result that server holds (a reader
                                       that stops before its last page)
    mlscope.db.evaluation              fetch one stored evaluation (spec + summary)
    mlscope.dead.<stream>              JetStream (stream MLSCOPE_DEAD): messages a consumer
                                       gave up on, the error in their headers
    mlscope.loadgen.<id>.ctl           control requests to one load-generator service
                                       (ping, load a dealt slice)
    mlscope.loadgen.<id>.run           start a loaded slice; answered when it is done
    mlscope.loadgen.<id>.progress      queries done so far by one load-generator service

Buckets: ``mlscope_agents`` (agent descriptions, TTL-expired), ``mlscope_models``
(published manifests), ``mlscope_cancels`` (cancels of jobs no server ran, TTL-expired),
``mlscope_loadgens`` (load-generator services, TTL-expired),
object stores ``mlscope_loadgen_work`` (dealt slices and their results) and
``mlscope_artifacts`` (built zoo models and their build locks).
"""

from __future__ import annotations

import hashlib
import re

__all__ = [
    "AGENTS_BUCKET",
    "ARTIFACTS_BUCKET",
    "CANCELS_BUCKET",
    "DEAD_STREAM",
    "EVALUATION_SUBJECT",
    "JOBS_CONSUMER",
    "JOBS_STREAM",
    "JOBS_SUBJECT",
    "LOADGENS_BUCKET",
    "LOADGEN_WORK_BUCKET",
    "MODELS_BUCKET",
    "PREFIX",
    "SQL_SUBJECT",
    "STORED_TRACES_TRANSFORM",
    "TOKEN_MAX_CHARS",
    "TRACES_CONSUMER",
    "TRACES_STREAM",
    "agent_ctl",
    "agent_query",
    "agent_rows",
    "agent_samples",
    "agent_traces",
    "capability",
    "dead_letter",
    "dead_letters_wildcard",
    "evaluation_traces",
    "job_cancel",
    "job_cancel_wildcard",
    "job_events",
    "loadgen_ctl",
    "loadgen_progress",
    "loadgen_run",
    "sql_close",
    "sql_pages",
    "stored_traces",
    "token",
    "traces",
]

PREFIX = "mlscope"

JOBS_STREAM = "MLSCOPE_JOBS"
JOBS_SUBJECT = f"{PREFIX}.jobs.submit"
JOBS_CONSUMER = "servers"

TRACES_STREAM = "MLSCOPE_TRACES"
TRACES_CONSUMER = "ingester"

DEAD_STREAM = "MLSCOPE_DEAD"

AGENTS_BUCKET = "mlscope_agents"
MODELS_BUCKET = "mlscope_models"
CANCELS_BUCKET = "mlscope_cancels"
"""Cancel requests of jobs no server was running (key: job id, value: the reason), so
that any server that takes such a job later, even one started after the request,
stores it as cancelled without running it."""
ARTIFACTS_BUCKET = "mlscope_artifacts"
"""Object store of built zoo models (mlscope.artifact_bucket)."""

LOADGENS_BUCKET = "mlscope_loadgens"
"""Registry of load-generator services (``mlscope loadgen``)."""
LOADGEN_WORK_BUCKET = "mlscope_loadgen_work"
"""Object store of dealt schedule slices and their raw results (distributed load)."""

SQL_SUBJECT = f"{PREFIX}.db.sql"
EVALUATION_SUBJECT = f"{PREFIX}.db.evaluation"

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


TOKEN_MAX_CHARS = 128
"""Longest subject token: a longer value keeps its start and a digest of the whole.
nats-server closes the connection of a client that sends a subject longer than its
control line (4 KiB), and nats-py then stays closed: one long id in a subject would
cut a service off the bus."""


def token(value: str) -> str:
    """One subject token: NATS separators and wildcards become '_'; a value longer than
    :data:`TOKEN_MAX_CHARS` becomes its start and a digest of all of it (distinct
    values stay distinct)."""
    cleaned = _UNSAFE.sub("_", value)
    if len(cleaned) > TOKEN_MAX_CHARS:
        digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:24]
        cleaned = f"{cleaned[: TOKEN_MAX_CHARS - 25]}-{digest}"
    return cleaned or "_"


def sql_pages(server_id: str) -> str:
    """Where server ``server_id`` serves the pages of the results it holds."""
    return f"{SQL_SUBJECT}.page.{token(server_id)}"


def sql_close(server_id: str) -> str:
    """Where server ``server_id`` releases a result it holds before its last page."""
    return f"{SQL_SUBJECT}.close.{token(server_id)}"


def capability(framework: str, model: str) -> str:
    return f"{PREFIX}.cap.{token(framework)}.{token(model)}"


def agent_query(agent_id: str) -> str:
    return f"{PREFIX}.agent.{token(agent_id)}.query"


def agent_ctl(agent_id: str) -> str:
    return f"{PREFIX}.agent.{token(agent_id)}.ctl"


def agent_samples(agent_id: str) -> str:
    return f"{PREFIX}.agent.{token(agent_id)}.samples"


def agent_rows(agent_id: str, evaluation_id: str) -> str:
    return f"{PREFIX}.agent.{token(agent_id)}.rows.{token(evaluation_id)}"


def job_events(job_id: str) -> str:
    return f"{PREFIX}.job.{token(job_id)}.events"


def job_cancel(job_id: str) -> str:
    return f"{PREFIX}.job.{token(job_id)}.cancel"


def job_cancel_wildcard() -> str:
    return f"{PREFIX}.job.*.cancel"


def traces(eval_id: str, agent_id: str) -> str:
    return f"{PREFIX}.traces.{token(eval_id)}.{token(agent_id)}"


def agent_traces(agent: str) -> str:
    """Every evaluation's trace subject of one agent (a token, or ``*`` for any)."""
    return f"{PREFIX}.traces.*.{agent}"


def evaluation_traces(eval_id: str) -> str:
    """Every agent's trace subject of one evaluation."""
    return f"{PREFIX}.traces.{token(eval_id)}.*"


def traces_wildcard() -> str:
    return f"{PREFIX}.traces.>"


def stored_traces(agent_id: str) -> str:
    """The subject under which ``MLSCOPE_TRACES`` keeps an agent's batches (of every
    evaluation): the stream's subject transform (:data:`STORED_TRACES_TRANSFORM`)
    drops the evaluation token, so its per-subject limit is a per-agent budget."""
    return f"{PREFIX}.traces.{token(agent_id)}"


STORED_TRACES_TRANSFORM = (
    agent_traces("*"),
    f"{PREFIX}.traces.{{{{wildcard(2)}}}}",
)
"""(source, destination) of ``MLSCOPE_TRACES``'s subject transform: a batch published
on :func:`traces` of (evaluation, agent) is stored on :func:`stored_traces` of the
agent (the batch names its evaluation itself)."""


def dead_letter(stream: str) -> str:
    """Where a consumer of ``stream`` puts the messages it gave up on."""
    return f"{PREFIX}.dead.{token(stream)}"


def dead_letters_wildcard() -> str:
    return f"{PREFIX}.dead.>"


def loadgen_ctl(loadgen_id: str) -> str:
    return f"{PREFIX}.loadgen.{token(loadgen_id)}.ctl"


def loadgen_run(loadgen_id: str) -> str:
    return f"{PREFIX}.loadgen.{token(loadgen_id)}.run"


def loadgen_progress(loadgen_id: str) -> str:
    return f"{PREFIX}.loadgen.{token(loadgen_id)}.progress"
