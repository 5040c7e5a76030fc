"""``mlscope-submit`` with several jobs: one per framework (``--framework a,b``), one per
agent (``--all-agents``) or the same job repeated (``--repeat N``, :mod:`cli.submit_repeat`),
each submitted through one :class:`~cli.submit_errors.InFlight` so that Ctrl-C cancels
every job then running."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import anyio

from cli.submit_errors import EXIT_FAILED, SUBMIT_FAILURES, InFlight, failed, strict_code
from cli.submit_repeat import main_repeat
from cli.summary_text import format_summary
from mlscope import bus as busmod
from mlscope.contracts import EvaluationSummary, JobRequest
from mlscope.settings import Settings

__all__ = ["main_all_agents", "main_many", "several_jobs"]

Several = Callable[[argparse.Namespace, Settings, list[JobRequest], InFlight], int]
"""A path of several jobs: (arguments, settings, the checked jobs, the jobs in flight)
-> exit code."""


def several_jobs(args: argparse.Namespace) -> Several | None:
    """The path of a submission of several jobs, or None for one job."""
    if args.all_agents:
        return main_all_agents
    if "," in args.framework:
        return main_many
    if args.repeat > 1:
        return main_repeat
    return None


def main_all_agents(
    args: argparse.Namespace, settings: Settings, jobs: list[JobRequest], in_flight: InFlight
) -> int:
    """One evaluation on every live agent that serves the model, then one comparison
    table."""
    from cli.all_agents import comparison_table, submit_all

    job = jobs[0]
    try:
        results = anyio.run(
            lambda: submit_all(
                settings, job, any_framework=args.any_framework, in_flight=in_flight
            ),
            backend="asyncio",
        )
    except SUBMIT_FAILURES as exc:
        return failed(exc)
    if args.json:
        print(
            json.dumps(
                [
                    r.model_dump(mode="json", by_alias=True)
                    if isinstance(r, EvaluationSummary)
                    else {"error": r.to_wire()}
                    for r in results
                ]
            )
        )
    else:
        print(comparison_table(results))
    if not all(isinstance(r, EvaluationSummary) for r in results):
        return EXIT_FAILED
    return strict_code(results) if args.strict else 0


def main_many(
    args: argparse.Namespace, settings: Settings, jobs: list[JobRequest], in_flight: InFlight
) -> int:
    """One evaluation per framework (one after another unless --parallel), then one
    comparison of their outputs."""
    from broker.compare import format_comparison

    try:
        summaries, comparison = anyio.run(
            _run_many, args, settings, jobs, in_flight, backend="asyncio"
        )
    except SUBMIT_FAILURES as exc:  # of the task group, its first failure
        return failed(exc)
    if args.json:
        doc = {
            "summaries": [s.model_dump(mode="json", by_alias=True) for s in summaries],
            "comparison": comparison.to_dict() if comparison else None,
        }
        print(json.dumps(doc))
        return strict_code(summaries) if args.strict else 0
    for s in summaries:
        print(format_summary(s))
        print()
    if comparison is not None:
        print(format_comparison(comparison))
    return strict_code(summaries) if args.strict else 0


async def _run_many(
    args: argparse.Namespace, settings: Settings, jobs: list[JobRequest], in_flight: InFlight
) -> tuple[list[EvaluationSummary], Any]:
    """The jobs' summaries (and, with --accuracy, the comparison of their outputs)."""
    from broker.compare import compare_evaluations

    out: list[EvaluationSummary | None] = [None] * len(jobs)

    async def one(i: int) -> None:
        out[i] = await in_flight.submit(settings, jobs[i])

    if args.parallel:
        async with anyio.create_task_group() as tg:
            for i in range(len(jobs)):
                tg.start_soon(one, i)
    else:  # one measurement at a time: they would share the agents' host
        for i in range(len(jobs)):
            await one(i)
    done = [s for s in out if s is not None]
    if not args.accuracy:
        return done, None
    async with busmod.connect(settings, name="mlscope-submit") as bus:
        return done, await compare_evaluations(
            bus, [(s.framework["name"], s.evaluation_id, s.accuracy) for s in done]
        )
