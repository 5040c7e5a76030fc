"""The job client: publish a job on the bus and wait for its summary.

Every caller that submits jobs goes through here: ``mlscope-submit`` (``cli/submit.py``;
``cli/submit_flags.py`` makes its flags a :class:`~mlscope.contracts.JobRequest`), the
dashboard's run page, ``mlscope demo``/``rerun``/``mlperf`` and the tests.
"""

from __future__ import annotations

import time
from typing import Any

from mlscope import bus as busmod
from mlscope import codec, names, remote, scenario_traits
from mlscope.contracts import EvaluationSummary, JobEvent, JobRequest, evaluation_id_for
from mlscope.errors import (
    BusDenied,
    BusError,
    BusRefused,
    ConfigError,
    DatabaseError,
    WireError,
    error_from_wire,
)
from mlscope.provision import JOB_MAX_BYTES
from mlscope.settings import Settings

__all__ = [
    "ACCEPT_TIMEOUT_S",
    "STORED_CHECK_S",
    "await_summary",
    "publish_job",
    "stored_result",
    "submit",
    "submit_on",
    "time_limit",
]

ACCEPT_TIMEOUT_S = 10.0
QUEUED_NOTE = "every server is busy with other jobs: queued, it starts when one is free"
STORED_CHECK_S = 15.0
"""After this long without an event the submitter asks for the job's stored evaluation
(its id is derived from the job), so a missed "done" never leaves it waiting."""


async def submit(
    settings: Settings, job: JobRequest, *, on_event: object = None, timeout: float | None = None
) -> EvaluationSummary:
    """Publish ``job`` and wait for its summary; failures raise their typed error."""
    async with busmod.connect(settings, name="mlscope-submit") as bus:
        return await submit_on(bus, job, on_event=on_event, timeout=timeout)


async def submit_on(
    bus: busmod.Bus, job: JobRequest, *, on_event: object = None, timeout: float | None = None
) -> EvaluationSummary:
    """:func:`submit` on a connection the caller holds."""
    sub = await bus.nc.subscribe(names.job_events(job.job_id))
    try:
        await publish_job(bus, job)
        return await await_summary(
            bus,
            sub,
            job.job_id,
            timeout or time_limit(job),
            on_event,
            evaluation_id=job.evaluation_id(),
        )
    finally:
        await sub.unsubscribe()


def time_limit(job: JobRequest) -> float:
    """How long a job may take before its submitter gives up (runs x 3 x duration
    + 6 min)."""
    sc = job.scenario
    traits = scenario_traits.get(sc.name)
    return max(sc.duration_s, traits.extent(sc).seconds or 0.0) * 3 * traits.runs(sc) + 360.0


async def publish_job(bus: busmod.Bus, job: JobRequest) -> None:
    """Put ``job`` on the job stream, refusing one over the bus's size limit."""
    data = codec.encode_model(job)
    sc = job.scenario
    limit_bytes = min(JOB_MAX_BYTES, int(bus.nc.max_payload))
    if len(data) > limit_bytes:
        what = (
            f" (its replay schedule has {len(sc.arrivals_s)} arrivals: split it)"
            if sc.arrivals_s
            else ""
        )
        raise ConfigError(
            f"the job is {len(data)} bytes, over the {limit_bytes}-byte limit of a job{what}",
            field="scenario",
        )
    try:
        # Retried with the job id as message id: a cluster leader election or a
        # reconnect does not lose the job, and a retry is not a second job.
        stored = await busmod.publish_persistent(
            bus, names.JOBS_SUBJECT, data, msg_id=job.job_id, attempts=4
        )
    except BusRefused:
        raise  # the stream is there and refused the job: say why
    except BusError as exc:
        raise BusError(
            "the job stream does not exist: is an mlscope server running? "
            "(`mlscope up` or `mlscope server`)"
        ) from exc
    if not stored:  # the stream dropped it as a repeat: no server will take it again
        raise ConfigError(
            f"job {job.job_id} was submitted before: a job id names one job (a new "
            "JobRequest gets a new id)",
            field="job_id",
        )


async def await_summary(
    bus: busmod.Bus,
    sub: Any,
    job_id: str,
    limit: float,
    on_event: object,
    *,
    evaluation_id: str | None = None,
) -> EvaluationSummary:
    """The job's summary from its events (or from the database when its "done" was
    missed: ``evaluation_id``, the job's :meth:`~mlscope.contracts.JobRequest.evaluation_id`,
    default the one derived from ``job_id``); its typed error when it failed. A
    cancelled job's summary has status "cancelled" (it is stored as such)."""
    accepted = queued = False
    deadline = time.monotonic() + limit
    while True:
        wait = (
            ACCEPT_TIMEOUT_S if not accepted else min(STORED_CHECK_S, deadline - time.monotonic())
        )
        msg = await busmod.next_msg(sub, max(0.1, wait))
        if msg is None:
            if not accepted:
                stored = await _not_taken(
                    bus, job_id, limit, deadline, None if queued else on_event, evaluation_id
                )
                if stored is not None:  # run and stored while its events were missed
                    return stored
                queued = True
                continue
            _, stored = await stored_result(bus, job_id, evaluation_id)
            if stored is not None:  # its "done" was missed (a bus outage)
                return stored
            if time.monotonic() < deadline:
                continue
            raise BusError(f"job {job_id} did not finish within {limit:g} s")
        try:
            event = codec.decode_model(JobEvent, msg.data)
        except WireError:
            continue  # not an event of ours: a stray or hostile message
        accepted = True
        if callable(on_event):
            on_event(event)
        if event.event == "failed":
            raise error_from_wire(event.error or {"message": "job failed"})
        if event.event in ("done", "cancelled") and event.summary is not None:
            return event.summary


async def _not_taken(
    bus: busmod.Bus,
    job_id: str,
    limit: float,
    deadline: float,
    on_event: object,
    evaluation_id: str | None,
) -> EvaluationSummary | None:
    """No server took the job yet: its stored summary if it has one; None while it is
    queued (servers answer, each busy with as many jobs as it runs at a time; ``on_event``
    then hears "queued"); a BusError when no server answers or ``deadline`` passed."""
    answers, stored = await stored_result(bus, job_id, evaluation_id)
    if stored is not None:
        return stored
    if not answers:
        raise BusError(
            f"no server took job {job_id} within {ACCEPT_TIMEOUT_S:g} s and none answers: "
            "is `mlscope server` running? The job stays on the bus's job queue and runs "
            "when a server starts",
            job_id=job_id,
        )
    if time.monotonic() >= deadline:
        raise BusError(
            f"job {job_id} was not started within {limit:g} s: every server stayed busy "
            "with other jobs (it stays queued)",
            job_id=job_id,
        )
    if callable(on_event):
        on_event(JobEvent(job_id=job_id, event="queued", note=QUEUED_NOTE))
    return None


async def stored_result(
    bus: busmod.Bus, job_id: str, evaluation_id: str | None = None
) -> tuple[bool, EvaluationSummary | None]:
    """Whether a server answers on the bus (its database responder), and the job's
    stored summary when it has one (None: not stored yet, or no server answering right
    now): a job not taken while a server answers waits in the job queue behind others
    (a server runs a few jobs at a time). ``evaluation_id``: where the job's evaluation
    is stored (:meth:`~mlscope.contracts.JobRequest.evaluation_id`: an MLPerf import's
    is its logs'), default the id derived from ``job_id``."""
    try:
        summary = await remote.stored_summary(
            bus, evaluation_id or evaluation_id_for(job_id), timeout=5.0
        )
    except BusDenied:
        raise  # these credentials may not ask: waiting would not change that
    except BusError:  # nobody serves the database, or no answer in time
        return False, None
    except DatabaseError:  # a server answered: not stored
        return True, None
    return True, summary
