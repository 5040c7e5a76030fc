"""What ``mlscope-submit`` and ``mlscope`` say when their arguments cannot run, and
``mlscope-submit``'s exit codes.

Exit codes (README, "What mlscope-submit reports"):

    0    the run completed (VALID or INVALID)
    1    it failed: no server or agent, a model the server does not know, a file that
         cannot be read, an evaluation that failed
    2    usage: bad arguments, in argparse's style (usage line + one message)
    3    with ``--strict``: it completed but is INVALID
    130  interrupted (Ctrl-C): the job (with --repeat, several frameworks or
         --all-agents: every job then running) was cancelled on the server

Arguments are checked before anything connects: each number, list and id flag of either
program goes through one of the argparse types of :mod:`cli.flag_types`, and then
through the same pydantic models the server uses. A command builds those models from
its flags inside :func:`flags_contract`, the one place a refusal becomes a
:class:`FlagError` that names the flag, not the model field (:func:`flag_message`); a
refusal anywhere else (a reply, a stored record) is not the user's doing and stays what
it was.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import anyio

from cli.flag_types import check_frameworks, positive_ints
from mlscope.errors import ConfigError, MLScopeError
from mlscope.settings import Settings

if TYPE_CHECKING:  # the contracts load when a job is built, not when a flag is read
    from pydantic import ValidationError

    from mlscope.contracts import EvaluationSummary, JobRequest

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_INVALID",
    "EXIT_OK",
    "EXIT_USAGE",
    "FIELD_FLAGS",
    "SUBMIT_FAILURES",
    "FlagError",
    "InFlight",
    "StopSignals",
    "failed",
    "field_message",
    "flag_for",
    "flag_message",
    "flags_contract",
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
    """``argument --qps: must be greater than 0 (got -5.0)``, one per refused field: a
    field is named by the flag that sets it (:data:`FIELD_FLAGS`, else ``--field-name``
    as argparse names an option after its destination)."""
    return _problems(exc, _argument)


class FlagError(ConfigError):
    """A contract a command built from its flags refused them; the message names each
    flag (``argument --qps: must be greater than 0 (got -1.0)``): a usage error, exit 2."""


@contextlib.contextmanager
def flags_contract() -> Iterator[None]:
    """Where a command's flags become a contract: a pydantic refusal inside is raised
    as a :class:`FlagError` (:func:`flag_message`); nothing else is translated."""
    from pydantic import ValidationError  # loaded with the contracts built inside

    try:
        yield
    except ValidationError as exc:
        raise FlagError(flag_message(exc)) from exc


def field_message(exc: ValidationError) -> str:
    """``scenario.qps: must be greater than 0 (got -5.0)``: the refusal of stored or
    received fields (no flag set them), each named by its path in the model."""
    return _problems(exc, lambda loc: ".".join(str(x) for x in loc))


def flag_for(field: str) -> str:
    """The flag that sets ``field`` (:data:`FIELD_FLAGS`, else ``--field-name`` as
    argparse names an option after its destination)."""
    return FIELD_FLAGS.get(field, "--" + field.replace("_", "-"))


def _argument(loc: tuple[int | str, ...]) -> str:
    field = next((str(x) for x in reversed(loc) if isinstance(x, str)), "")
    if not field:
        return ""
    return f"argument {flag_for(field)}"


def _problems(exc: ValidationError, name: Callable[[tuple[int | str, ...]], str]) -> str:
    """Each error of ``exc`` as ``NAME: why (got value)`` (just ``why`` where ``name``
    gives nothing: a check of the model as a whole), joined by ``; ``."""
    parts = []
    for err in exc.errors():
        where = name(tuple(err["loc"]))
        msg = str(err["msg"]).removeprefix("Value error, ")
        msg = msg.replace("Input should be", "must be")
        got = err.get("input")
        if isinstance(got, float) and math.isnan(got):  # no bound holds NaN: say what it is
            msg = "must be a number"
        plain = not isinstance(got, dict | list | tuple) and got is not None
        shown = f" (got {got!r})" if plain and repr(got) not in msg else ""
        parts.append(f"{where}: {msg}{shown}" if where else f"{msg}{shown}")
    return "; ".join(parts)


def preflight(
    p: argparse.ArgumentParser,
    args: argparse.Namespace,
    make_job: Callable[[argparse.Namespace, str | None], JobRequest],
) -> None:
    """Refuse bad arguments the way argparse does (usage, one line, exit 2) before
    anything connects; a file that cannot be read is an MLScopeError (exit 1)."""
    frameworks = [f.strip() for f in args.framework.split(",") if f.strip()]
    problem = check_frameworks(frameworks) if frameworks else "argument --framework: empty"
    if problem is None and args.repeat < 1:
        problem = f"argument --repeat: must be at least 1 (got {args.repeat})"
    if problem is None and args.batch_sizes:
        try:
            positive_ints(args.batch_sizes)
        except argparse.ArgumentTypeError as exc:
            problem = f"argument --batch-sizes: {exc}"
    if problem is None:
        try:
            for fw in frameworks:
                make_job(args, fw)
        except FlagError as exc:
            problem = exc.message
        except MLScopeError:
            raise  # a file that cannot be read: its own one-line message
        except ValueError as exc:  # int('x') in --batch-sizes and the like
            problem = f"invalid arguments: {exc}"
    if problem is not None:
        p.error(problem)


CANCEL_WAIT_S = 1.2
"""How long an interrupted submitter waits for the server to confirm the cancel: the
user pressed Ctrl-C to get the terminal back, so well under two seconds in all."""


class StopSignals:
    """While entered, SIGTERM (a supervisor's stop, ``timeout``, a cancelled CI job)
    interrupts the submitter as Ctrl-C does, so that its running jobs are cancelled on
    the server instead of holding their agents for the rest of their runs. :attr:`code`
    is the exit code that says which signal it was: 130 (128 + SIGINT, Ctrl-C) or 143
    (128 + SIGTERM)."""

    def __init__(self) -> None:
        self.signum = int(signal.SIGINT)
        self._previous: Any = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # where signals arrive
            self._previous = signal.signal(signal.SIGTERM, self._terminated)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def _terminated(self, signum: int, _frame: object) -> NoReturn:
        self.signum = signum
        raise KeyboardInterrupt

    @property
    def code(self) -> int:
        return 128 + self.signum


def interrupted(
    settings: Settings,
    job_id: str,
    *,
    progress_shown: bool = False,
    program: str = "mlscope-submit",
) -> None:
    """Ctrl-C or SIGTERM (:class:`StopSignals`): cancel the job on the server and say so
    in one line (no traceback) that ``program`` starts."""
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
            f"{program}: interrupted; cancel of job {job_id} sent, not yet confirmed "
            f"(`mlscope cancel {job_id}` to retry)",
            file=sys.stderr,
        )
    else:
        print(
            f"{program}: interrupted; job {job_id} cancelled, evaluation "
            f"{reply.evaluation_id} stored as cancelled",
            file=sys.stderr,
        )


class InFlight:
    """The jobs a submission of several has sent and not yet seen end, so that Ctrl-C
    cancels exactly those (the later ones are never sent). A job leaves when its summary
    or its typed error came back; a cancelled wait (Ctrl-C) leaves it here. ``on_event``
    hears each job's events (the submitter's one-line notes: each job's id)."""

    def __init__(self, *, on_event: Callable[[Any], None] | None = None) -> None:
        self.job_ids: dict[str, None] = {}
        self.on_event = on_event

    async def submit(self, settings: Settings, job: JobRequest, **kwargs: Any) -> EvaluationSummary:
        from mlscope.jobs import submit

        self.job_ids[job.job_id] = None
        kwargs.setdefault("on_event", self.on_event)
        try:
            summary = await submit(settings, job, **kwargs)
        except MLScopeError:
            self.job_ids.pop(job.job_id, None)
            raise
        self.job_ids.pop(job.job_id, None)
        return summary


def interrupted_many(
    settings: Settings, in_flight: InFlight, *, program: str = "mlscope-submit"
) -> None:
    """Ctrl-C or SIGTERM during several jobs: cancel the ones in flight at once, one
    line each that ``program`` starts."""
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
        print(f"{program}: interrupted; no job was running", file=sys.stderr)
    for job_id in ids:
        reply = replies.get(job_id)
        print(
            f"{program}: interrupted; job {job_id} cancelled, evaluation "
            f"{reply.evaluation_id} stored as cancelled"
            if reply is not None
            else f"{program}: interrupted; cancel of job {job_id} sent, not yet "
            f"confirmed (`mlscope cancel {job_id}` to retry)",
            file=sys.stderr,
        )


def strict_code(summaries: Iterable[Any]) -> int:
    """``EXIT_INVALID`` when any result is not a VALID completed run, else ``EXIT_OK``."""
    from mlscope.contracts import EvaluationSummary

    ok = all(
        isinstance(s, EvaluationSummary) and s.valid and s.status == "completed" for s in summaries
    )
    return EXIT_OK if ok else EXIT_INVALID


SUBMIT_FAILURES = (MLScopeError, ValueError, ExceptionGroup)
"""What a submission's wait raises that :func:`failed` turns into an exit status."""


def failed(exc: BaseException) -> int:
    """Say on stderr, in one line, why a submission failed; its exit status:
    ``EXIT_FAILED`` for an MLScopeError, ``EXIT_USAGE`` for invalid arguments (a
    ValueError: pydantic's validation of the arguments and the scenario). Of a task
    group's failures, the first counts; any other exception is raised again."""
    first = exc
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    if isinstance(first, MLScopeError):
        print(f"mlscope-submit: {first}", file=sys.stderr)
        return EXIT_FAILED
    if isinstance(first, ValueError):
        print(f"mlscope-submit: invalid arguments: {first}", file=sys.stderr)
        return EXIT_USAGE
    raise exc
