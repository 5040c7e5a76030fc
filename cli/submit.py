"""``mlscope-submit MODEL[@VERSION] --framework F ...``: flags into a job, then the job
client (:mod:`mlscope.jobs`) publishes it and waits; this module reports."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import anyio

from cli.submit_errors import (
    EXIT_FAILED,
    SUBMIT_FAILURES,
    InFlight,
    StopSignals,
    failed,
    interrupted,
    interrupted_many,
    preflight,
    strict_code,
)
from cli.submit_flags import make_job, parser
from cli.submit_several import several_jobs
from cli.summary_text import format_summary
from mlscope import scenario_traits
from mlscope.contracts import JobEvent, JobRequest
from mlscope.errors import MLScopeError
from mlscope.jobs import submit
from mlscope.settings import Settings

__all__ = ["main"]


def _notes(event: JobEvent) -> None:
    """What the submitter must hear even without a terminal (a script, CI, ``--json``):
    the job's id as soon as a server accepts or queues it (``mlscope cancel JOB_ID``
    needs it while the job runs), and a restart; one line each, on stderr, so that
    stdout holds the result alone."""
    if event.event == "restarted":
        print(
            f"\n  {event.note or 'job restarted'} (now on {event.server_id})",
            file=sys.stderr,
            flush=True,
        )
    elif event.event == "accepted":
        print(f"  job {event.job_id} accepted by {event.server_id}", file=sys.stderr, flush=True)
    elif event.event == "queued":
        print(f"  job {event.job_id}: {event.note}", file=sys.stderr, flush=True)


def _progress(event: JobEvent) -> None:
    """:func:`_notes`, and on a terminal the live progress line, rewritten in place."""
    _notes(event)
    if event.event == "progress":
        p50 = f"{event.p50_ms:.3f} ms" if event.p50_ms is not None else "-"
        print(
            f"\r  {event.queries_done:>8} queries  {event.elapsed_s:6.1f} s  p50 {p50:<12}",
            end="",
            file=sys.stderr,
            flush=True,
        )


def _settings() -> Settings | None:
    """The environment's settings, with its scenario modules loaded (before the
    parser offers ``--scenario``'s choices); None, said on stderr, when they are bad."""
    try:
        settings = Settings.from_env()
        scenario_traits.load_modules(settings.scenario_modules)
    except MLScopeError as exc:
        print(f"mlscope-submit: {exc}", file=sys.stderr)
        return None
    return settings


def _checked_jobs(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[JobRequest]:
    """The job of each framework, built once, by the preflight that checks them: a job
    reads its files (a replay schedule, a scenario or system file) as it is built."""
    jobs: list[JobRequest] = []

    def build(a: argparse.Namespace, framework: str | None = None) -> JobRequest:
        jobs.append(make_job(a, framework))
        return jobs[-1]

    preflight(p, args, build)
    return jobs


DESCRIPTION = """Submit a job: run MODEL on an agent of --framework under a load scenario,
wait for the result (live progress on a terminal) and print its summary, or with
--json one object. The job's id goes to stderr as soon as a server takes it
(`mlscope cancel JOB_ID` stops it; so does Ctrl-C here)."""
"""What ``mlscope-submit --help`` says first (the module's docstring is for its readers)."""


def main(argv: Sequence[str] | None = None) -> int:
    settings = _settings()
    if settings is None:
        return EXIT_FAILED
    p = parser(description=DESCRIPTION)
    args = p.parse_args(argv)
    try:
        jobs = _checked_jobs(p, args)
    except MLScopeError as exc:
        print(f"mlscope-submit: {exc}", file=sys.stderr)
        return EXIT_FAILED
    with StopSignals() as stops:
        return _submit(args, settings, jobs, stops)


def _submit(
    args: argparse.Namespace, settings: Settings, jobs: list[JobRequest], stops: StopSignals
) -> int:
    several = several_jobs(args)
    if several is not None:
        in_flight = InFlight(on_event=_notes)
        try:
            return several(args, settings, jobs, in_flight)
        except KeyboardInterrupt:  # those running are cancelled; the rest never sent
            interrupted_many(settings, in_flight)
            return stops.code
    show = _notes if args.json or not sys.stderr.isatty() else _progress
    job = jobs[0]
    try:
        summary = anyio.run(lambda: submit(settings, job, on_event=show), backend="asyncio")
    except KeyboardInterrupt:
        interrupted(settings, job.job_id, progress_shown=show is _progress)
        return stops.code
    except SUBMIT_FAILURES as exc:
        return failed(exc)
    if show is _progress:
        print(file=sys.stderr)
    if summary.status == "cancelled":  # by `mlscope cancel` elsewhere
        print(
            f"mlscope-submit: job {job.job_id} was cancelled; evaluation "
            f"{summary.evaluation_id} stored as cancelled",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if args.json:
        print(json.dumps(summary.model_dump(mode="json", by_alias=True)))
    else:
        print(format_summary(summary))
    return strict_code([summary]) if args.strict else 0


if __name__ == "__main__":
    raise SystemExit(main())
