"""What ``mlscope-submit`` says when it cannot run, and its exit codes.

Exit codes (README, "What mlscope-submit reports"):

    0    the run completed (VALID or INVALID)
    1    it failed: no server or agent, a model the server does not know, a file that
         cannot be read, an evaluation that failed
    2    usage: bad arguments, in argparse's style (usage line + one message)
    3    with ``--strict``: it completed but is INVALID
    130  interrupted (Ctrl-C): the job (with --repeat, several frameworks or
         --all-agents: every job then running) was cancelled on the server

Arguments are checked before anything connects: each flag goes through the same
pydantic models the server uses, and a refusal names the flag, not the model field.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterable
from typing import Any

import anyio
from pydantic import ValidationError

from mlscope.contracts import EvaluationSummary, JobRequest
from mlscope.errors import MLScopeError
from mlscope.jobs import submit
from mlscope.manifest import FRAMEWORKS
from mlscope.settings import Settings

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_INVALID",
    "EXIT_OK",
    "EXIT_USAGE",
    "InFlight",
    "flag_message",
    "interrupted",
    "interrupted_many",
    "preflight",
    "strict_code",
]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INVALID, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

FIELD_FLAGS = {
    "qps": "--qps",
    "duration_s": "--duration",
    "batch_size": "--batch-size",
    "batch_sizes": "--batch-sizes",
    "concurrency": "--concurrency",
    "latency_bound_ms": "--latency-bound-ms",
    "loadgens": "--loadgens",
    "min_duration_s": "--min-duration",
    "min_queries": "--min-queries",
    "max_issue_lag_us": "--max-issue-lag-us",
    "max_queries": "--max-queries",
    "seed": "--seed",
    "repetitions": "--repetitions",
    "warm_queries": "--warm-queries",
    "warmup_queries": "--warmup-queries",
    "arrivals_s": "--schedule",
    "accuracy_samples": "--accuracy-samples",
    "framework_version": "--framework-version",
    "framework": "--framework",
    "device": "--device",
    "agent_id": "--agent",
    "model": "MODEL",
    "model_version": "MODEL@VERSION",
    "trace_level": "--trace-level",
}
"""The flag behind each field of ``JobRequest`` / ``ScenarioSpec``."""


def flag_message(exc: ValidationError) -> str:
    """``argument --qps: must be greater than 0 (got -5.0)``, one per refused field."""
    parts = []
    for err in exc.errors():
        field = next((str(x) for x in reversed(err["loc"]) if isinstance(x, str)), "")
        where = FIELD_FLAGS.get(field, field.replace("_", "-"))
        msg = str(err["msg"]).removeprefix("Value error, ")
        msg = msg.replace("Input should be", "must be")
        got = err.get("input")
        plain = not isinstance(got, dict | list | tuple) and got is not None
        shown = f" (got {got!r})" if plain and repr(got) not in msg else ""
        parts.append(f"argument {where}: {msg}{shown}" if where else f"{msg}{shown}")
    return "; ".join(parts)


def _check_frameworks(names: Iterable[str]) -> str | None:
    for name in names:
        if name not in FRAMEWORKS:
            return f"unknown framework {name!r}; known: {', '.join(FRAMEWORKS)}"
    return None


def preflight(
    p: argparse.ArgumentParser,
    args: argparse.Namespace,
    make_job: Callable[[argparse.Namespace, str | None], JobRequest],
) -> None:
    """Refuse bad arguments the way argparse does (usage, one line, exit 2) before
    anything connects; a file that cannot be read is an MLScopeError (exit 1)."""
    frameworks = [f.strip() for f in args.framework.split(",") if f.strip()]
    problem = _check_frameworks(frameworks) if frameworks else "argument --framework: empty"
    if problem is None and args.repeat < 1:
        problem = f"argument --repeat: must be at least 1 (got {args.repeat})"
    if problem is None and args.batch_sizes:
        bad = [b for b in args.batch_sizes.split(",") if not b.strip().isdigit()]
        if bad:
            problem = f"argument --batch-sizes: {bad[0]!r} is not a whole number (e.g. 1,8,32)"
    if problem is None:
        try:
            for fw in frameworks:
                make_job(args, fw)
        except ValidationError as exc:
            problem = flag_message(exc)
        except MLScopeError:
            raise  # a file that cannot be read: its own one-line message
        except ValueError as exc:  # int('x') in --batch-sizes and the like
            problem = f"invalid arguments: {exc}"
    if problem is not None:
        p.error(problem)


CANCEL_WAIT_S = 1.2
"""How long an interrupted submitter waits for the server to confirm the cancel: the
user pressed Ctrl-C to get the terminal back, so well under two seconds in all."""


def interrupted(settings: Settings, job_id: str, *, progress_shown: bool = False) -> int:
    """Ctrl-C: cancel the job on the server and say so in one line (no traceback)."""
    from mlscope.api import cancel_job

    if progress_shown:
        print(file=sys.stderr)  # end the progress line
    try:
        reply = anyio.run(
            lambda: cancel_job(settings, job_id, timeout=CANCEL_WAIT_S), backend="asyncio"
        )
    except (MLScopeError, KeyboardInterrupt):
        reply = None
    if reply is None:
        print(
            f"mlscope-submit: interrupted; cancel of job {job_id} sent, not yet confirmed "
            f"(`mlscope cancel {job_id}` to retry)",
            file=sys.stderr,
        )
    else:
        print(
            f"mlscope-submit: interrupted; job {job_id} cancelled, evaluation "
            f"{reply.evaluation_id} stored as cancelled",
            file=sys.stderr,
        )
    return EXIT_INTERRUPTED


class InFlight:
    """The jobs a submission of several has sent and not yet seen end, so that Ctrl-C
    cancels exactly those (the later ones are never sent). A job leaves when its summary
    or its typed error came back; a cancelled wait (Ctrl-C) leaves it here."""

    def __init__(self) -> None:
        self.job_ids: dict[str, None] = {}

    async def submit(self, settings: Settings, job: JobRequest, **kwargs: Any) -> EvaluationSummary:
        self.job_ids[job.job_id] = None
        try:
            summary = await submit(settings, job, **kwargs)
        except MLScopeError:
            self.job_ids.pop(job.job_id, None)
            raise
        self.job_ids.pop(job.job_id, None)
        return summary


def interrupted_many(settings: Settings, in_flight: InFlight) -> int:
    """Ctrl-C during several jobs: cancel the ones in flight at once, one line each."""
    from mlscope.api import cancel_job

    ids = list(in_flight.job_ids)
    replies: dict[str, Any] = {}

    async def one(job_id: str) -> None:
        with contextlib.suppress(MLScopeError):
            replies[job_id] = await cancel_job(settings, job_id, timeout=CANCEL_WAIT_S)

    async def all_of() -> None:
        async with anyio.create_task_group() as tg:
            for job_id in ids:
                tg.start_soon(one, job_id)

    with contextlib.suppress(KeyboardInterrupt):
        anyio.run(all_of, backend="asyncio")
    if not ids:
        print("mlscope-submit: interrupted; no job was running", file=sys.stderr)
    for job_id in ids:
        reply = replies.get(job_id)
        print(
            f"mlscope-submit: interrupted; job {job_id} cancelled, evaluation "
            f"{reply.evaluation_id} stored as cancelled"
            if reply is not None
            else f"mlscope-submit: interrupted; cancel of job {job_id} sent, not yet "
            f"confirmed (`mlscope cancel {job_id}` to retry)",
            file=sys.stderr,
        )
    return EXIT_INTERRUPTED


def strict_code(summaries: Iterable[Any]) -> int:
    """``EXIT_INVALID`` when any result is not a VALID completed run, else ``EXIT_OK``."""
    ok = all(
        isinstance(s, EvaluationSummary) and s.valid and s.status == "completed" for s in summaries
    )
    return EXIT_OK if ok else EXIT_INVALID
