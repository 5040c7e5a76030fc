"""``mlscope-submit MODEL[@VERSION] --framework F ...``: flags into a job, then the job
client (:mod:`mlscope.jobs`) publishes it and waits; this module reports."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio

from broker.scenarios import read_arrivals, refuse, scenario_spec
from cli.submit_errors import (
    EXIT_FAILED,
    FlagError,
    InFlight,
    flag_for,
    flags_contract,
    interrupted,
    interrupted_many,
    preflight,
    strict_code,
)
from cli.summary_text import format_summary
from cli.system_opts import add_system_flags, system_from_args
from mlscope import bus as busmod
from mlscope import scenario_traits
from mlscope.contracts import EvaluationSummary, JobEvent, JobRequest, ScenarioSpec, new_id
from mlscope.errors import ConfigError, MLScopeError
from mlscope.jobs import submit
from mlscope.settings import Settings
from mlscope.stats import mean_ci
from mlscope.validity import ValidityPolicy

__all__ = ["main", "make_job", "measured_runs", "parser", "run_level"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlscope-submit",
        description=__doc__,
        epilog=_scenarios_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL[@VERSION]")
    _target_flags(p)
    _scenario_flags(p)
    _validity_flags(p)
    _submission_flags(p)
    add_system_flags(p)
    return p


def _scenarios_help() -> str:
    """One line per registered scenario, for ``--help``."""
    lines = [f"  {n:<14} {scenario_traits.get(n).summary}" for n in scenario_traits.names()]
    return "scenarios:\n" + "\n".join(lines)


def _target_flags(p: argparse.ArgumentParser) -> None:
    """What is evaluated, and where."""
    p.add_argument(
        "--framework",
        required=True,
        help="a framework, or several comma-separated: one evaluation each, "
        "compared (output divergence) when --accuracy is given",
    )
    p.add_argument("--framework-version", default=None, help="constraint, e.g. '>=1.20,<2'")
    p.add_argument("--device", default="cpu")
    p.add_argument("--agent", dest="agent_id", default=None)
    p.add_argument(
        "--placement",
        choices=("server", "agent"),
        default=None,
        help="where the load generator runs: server (queries cross the bus: the served "
        "model) or agent (the agent runs the scenario itself: the model); default: the "
        "scenario's (agent for batched, server for the others)",
    )
    p.add_argument(
        "--preprocess",
        choices=("ahead", "timed"),
        default=None,
        help="ahead: the agent pre-processes the samples once, before the clock starts "
        "(placement agent; its default where they fit the agent's sample memory); "
        "timed: inside each query's time (placement server always)",
    )


def _scenario_flags(p: argparse.ArgumentParser) -> None:
    """The scenario and its load (each flag overrides the --scenario-file's value)."""
    p.add_argument(
        "--scenario",
        default=None,
        choices=list(scenario_traits.names()),
        help="load scenario (default: online, or the --scenario-file's; listed below)",
    )
    p.add_argument(
        "--scenario-file",
        type=Path,
        default=None,
        help="a scenario YAML (manifests/scenarios/); flags given override it",
    )
    p.add_argument("--qps", type=float, default=None, help="rate (default 100)")
    p.add_argument("--duration", type=float, default=None, help="seconds (default 10)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--batch-sizes", default=None, help="batched: sweep, e.g. 1,2,4,8")
    p.add_argument("--concurrency", type=int, default=None, help="closed loop: queries in flight")
    p.add_argument(
        "--latency-bound-ms",
        type=float,
        default=None,
        help="p99 bound (online: validity; peak: the search target)",
    )
    p.add_argument(
        "--peak-trials",
        type=int,
        default=None,
        help="peak: most runs the search makes (default 10)",
    )
    p.add_argument(
        "--schedule",
        type=Path,
        default=None,
        help="replay: inter-arrival times in seconds, one per line",
    )
    p.add_argument("--max-queries", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    _cold_start_flags(p)
    _loadgen_flags(p)


def _cold_start_flags(p: argparse.ArgumentParser) -> None:
    """How a cold start reloads the model."""
    p.add_argument(
        "--repetitions", type=int, default=None, help="cold-start: loads measured (default 5)"
    )
    p.add_argument(
        "--warm-queries",
        type=int,
        default=None,
        help="cold-start: warm queries after each load (default 20)",
    )


def _loadgen_flags(p: argparse.ArgumentParser) -> None:
    """Where an open loop's load generators run."""
    p.add_argument(
        "--loadgens",
        type=int,
        default=None,
        help="open loops: load-generator processes sharing one schedule",
    )
    p.add_argument(
        "--loadgen-hosts",
        default=None,
        metavar="ID,ID",
        help="open loops: registered load-generator services (`mlscope loadgen --id ID`, "
        "any host) the schedule is dealt to, instead of processes on the server's host",
    )


def _validity_flags(p: argparse.ArgumentParser) -> None:
    """What a run must show to be VALID, and what it leaves out of its figures."""
    p.add_argument(
        "--min-duration",
        type=float,
        default=None,
        help="validity: minimum run length in s (default 10)",
    )
    p.add_argument(
        "--min-queries",
        type=int,
        default=None,
        help="validity: minimum issued queries (default 100)",
    )
    p.add_argument(
        "--max-issue-lag-us",
        type=float,
        default=None,
        help="validity: p99 issue lag tolerated (default 500)",
    )
    p.add_argument(
        "--warmup-queries",
        type=int,
        default=None,
        help="the first N queries warm up: run, stored (flagged), left out of every figure",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="exit 3 when a run completes INVALID (exit codes: cli/submit_errors.py)",
    )


def _submission_flags(p: argparse.ArgumentParser) -> None:
    """How many evaluations, what they also measure, and what is printed."""
    p.add_argument(
        "--accuracy",
        action="store_true",
        help="also run the labelled data set once (top-1/top-5, outputs kept)",
    )
    p.add_argument(
        "--accuracy-samples",
        type=int,
        default=None,
        help="at most this many data-set samples for --accuracy",
    )
    p.add_argument(
        "--trace-level", default="model", choices=["none", "model", "framework", "system", "full"]
    )
    p.add_argument(
        "--parallel",
        action="store_true",
        help="let evaluations that share a host run at the same time (by "
        "default they run one after another); results are marked",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the scenario N times, one after another; prints run-level "
        "statistics (mean and 95%% CI over runs)",
    )
    _fan_out_flags(p)


def _fan_out_flags(p: argparse.ArgumentParser) -> None:
    """One job on several agents, and what is printed."""
    p.add_argument("--json", action="store_true", help="print only the summary as JSON")
    p.add_argument(
        "--all-agents",
        action="store_true",
        help="one evaluation on every live agent that serves the model; "
        "prints one comparison table",
    )
    p.add_argument(
        "--any-framework",
        action="store_true",
        help="with --all-agents: agents of every framework offering the model",
    )


def make_job(args: argparse.Namespace, framework: str | None = None) -> JobRequest:
    name, _, version = args.model.partition("@")
    flags = {
        "name": args.scenario,
        "qps": args.qps,
        "duration_s": args.duration,
        "batch_size": args.batch_size,
        "seed": args.seed,
        "max_queries": args.max_queries,
        "concurrency": args.concurrency,
        "latency_bound_ms": args.latency_bound_ms,
        "peak_trials": getattr(args, "peak_trials", None),
        "loadgens": args.loadgens,
        "loadgen_hosts": (
            tuple(h.strip() for h in args.loadgen_hosts.split(",") if h.strip())
            if getattr(args, "loadgen_hosts", None)
            else None
        ),
        "min_duration_s": args.min_duration,
        "min_queries": args.min_queries,
        "max_issue_lag_us": args.max_issue_lag_us,
        "batch_sizes": (
            tuple(int(b) for b in args.batch_sizes.split(",")) if args.batch_sizes else None
        ),
        "arrivals_s": read_arrivals(args.schedule) if args.schedule else None,
        "repetitions": getattr(args, "repetitions", None),
        "warm_queries": getattr(args, "warm_queries", None),
        "warmup_queries": getattr(args, "warmup_queries", None),
        "preprocess": getattr(args, "preprocess", None),
    }
    with flags_contract():
        job = JobRequest(
            model=name,
            model_version=version or None,
            framework=framework or args.framework,
            framework_version=args.framework_version,
            device=args.device,
            agent_id=args.agent_id,
            scenario=scenario_spec(args.scenario_file, flags),
            trace_level=args.trace_level,
            submitted_at=time.time(),
            accuracy=getattr(args, "accuracy", False),
            accuracy_samples=getattr(args, "accuracy_samples", None),
            parallel=getattr(args, "parallel", False),
            # None: the scenario's own placement (JobRequest.placement)
            **({"placement": p} if (p := getattr(args, "placement", None)) else {}),
            system=system_from_args(args),
        )
    _refuse_what_cannot_run(job.scenario, flags)
    return job


def _refuse_what_cannot_run(spec: ScenarioSpec, flags: dict[str, Any]) -> None:
    """A flag the scenario does not read, or a spec its strategy refuses at intake
    (:meth:`broker.scenario.Scenario.refuse`, held to the server's default validity
    policy), as a usage error naming the flag: refused here, before anything runs,
    rather than ignored or found out after a run."""
    traits = scenario_traits.get(spec.name)
    for field, value in flags.items():
        if field != "name" and value is not None and not traits.reads(field):
            raise FlagError(
                f"argument {flag_for(field)}: scenario {spec.name!r} does not read it: "
                f"{traits.unread(field)}"
            )
    try:
        refuse(spec, ValidityPolicy())
    except ConfigError as exc:
        named = exc.fields.get("field")
        where = f"argument {flag_for(named)}: " if isinstance(named, str) else ""
        raise FlagError(f"{where}{exc.message}") from exc


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


Several = Callable[[argparse.Namespace, Settings, list[JobRequest], InFlight], int]


def _several_jobs(args: argparse.Namespace) -> Several | None:
    """The path of a submission of several jobs, or None for one job."""
    if args.all_agents:
        return _main_all_agents
    if "," in args.framework:
        return _main_many
    if args.repeat > 1:
        return _main_repeat
    return None


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


def main(argv: Sequence[str] | None = None) -> int:
    settings = _settings()
    if settings is None:
        return EXIT_FAILED
    p = parser()
    args = p.parse_args(argv)
    try:
        jobs = _checked_jobs(p, args)
    except MLScopeError as exc:
        print(f"mlscope-submit: {exc}", file=sys.stderr)
        return EXIT_FAILED
    several = _several_jobs(args)
    if several is not None:
        in_flight = InFlight(on_event=_notes)
        try:
            return several(args, settings, jobs, in_flight)
        except KeyboardInterrupt:  # those running are cancelled; the rest never sent
            return interrupted_many(settings, in_flight)
    show = _notes if args.json or not sys.stderr.isatty() else _progress
    job = jobs[0]
    try:
        summary = anyio.run(lambda: submit(settings, job, on_event=show), backend="asyncio")
    except KeyboardInterrupt:
        return interrupted(settings, job.job_id, progress_shown=show is _progress)
    except MLScopeError as exc:
        print(f"mlscope-submit: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # pydantic validation of the arguments and the scenario
        print(f"mlscope-submit: invalid arguments: {exc}", file=sys.stderr)
        return 2
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


def measured_runs(summaries: Sequence[EvaluationSummary]) -> list[EvaluationSummary]:
    """The runs whose figures count at run level: completed and VALID (an overloaded or
    cut-short run's figures describe another load than the one specified)."""
    return [s for s in summaries if s.status == "completed" and s.valid]


def run_level(summaries: Sequence[EvaluationSummary]) -> dict[str, dict[str, float | None]]:
    """Mean and 95% CI over runs (Student's t) of each run's p50, p99 and throughput;
    none of them is negative, so neither is an interval's low end."""
    stats = {
        "p50_ms": [s.latency_ms.p50 for s in summaries],
        "p99_ms": [s.latency_ms.p99 for s in summaries],
        "throughput_ips": [s.throughput_ips for s in summaries],
    }
    out = {}
    for name, values in stats.items():
        mean, lo, hi = mean_ci([v for v in values if v is not None], floor=0.0)
        out[name] = {"mean": mean, "ci_low": lo, "ci_high": hi}
    return out


def _main_repeat(
    args: argparse.Namespace, settings: Settings, jobs: list[JobRequest], in_flight: InFlight
) -> int:
    """The same job ``--repeat`` times, one after another; run-level statistics."""
    job = jobs[0]

    async def go() -> list[EvaluationSummary]:
        return [
            await in_flight.submit(settings, job.model_copy(update={"job_id": new_id("job")}))
            for _ in range(args.repeat)
        ]

    try:
        summaries = anyio.run(go, backend="asyncio")
    except MLScopeError as exc:
        print(f"mlscope-submit: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"mlscope-submit: invalid arguments: {exc}", file=sys.stderr)
        return 2
    kept = measured_runs(summaries)
    stats = run_level(kept)
    if args.json:
        print(
            json.dumps(
                {
                    "summaries": [s.model_dump(mode="json", by_alias=True) for s in summaries],
                    "run_level": stats,
                    "run_level_over": [s.evaluation_id for s in kept],
                }
            )
        )
        return strict_code(summaries) if args.strict else 0
    for s in summaries:
        print(format_summary(s))
        print()
    left = [s.evaluation_id for s in summaries if s not in kept]
    print(
        f"  run level over {len(kept)} VALID runs of {len(summaries)} (mean, 95% CI over runs)"
        + (f"; left out, not VALID: {', '.join(left)}:" if left else ":")
    )
    for name, v in stats.items():
        ci = "-" if v["ci_low"] is None else f"[{v['ci_low']:.3f}, {v['ci_high']:.3f}]"
        mean = "-" if v["mean"] is None else f"{v['mean']:.3f}"
        print(f"  {name:<15} {mean}  {ci}")
    print("  compare repeated runs with analysis.compare.compare_repeats (CIs over runs)")
    return strict_code(summaries) if args.strict else 0


def _main_all_agents(
    args: argparse.Namespace, settings: Settings, jobs: list[JobRequest], in_flight: InFlight
) -> int:
    from cli.all_agents import comparison_table, submit_all

    job = jobs[0]
    try:
        results = anyio.run(
            lambda: submit_all(
                settings, job, any_framework=args.any_framework, in_flight=in_flight
            ),
            backend="asyncio",
        )
    except MLScopeError as exc:
        print(f"mlscope-submit: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"mlscope-submit: invalid arguments: {exc}", file=sys.stderr)
        return 2
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


def _main_many(
    args: argparse.Namespace, settings: Settings, jobs: list[JobRequest], in_flight: InFlight
) -> int:
    """One evaluation per framework (one after another unless --parallel), then one
    comparison of their outputs."""
    from broker.compare import format_comparison

    try:
        summaries, comparison = anyio.run(
            _run_many, args, settings, jobs, in_flight, backend="asyncio"
        )
    except (MLScopeError, ValueError, ExceptionGroup) as caught:
        exc: BaseException = caught
        while isinstance(exc, BaseExceptionGroup):  # the first failure of the task group
            exc = exc.exceptions[0]
        if isinstance(exc, MLScopeError):
            print(f"mlscope-submit: {exc}", file=sys.stderr)
            return 1
        if isinstance(exc, ValueError):
            print(f"mlscope-submit: invalid arguments: {exc}", file=sys.stderr)
            return 2
        raise
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


if __name__ == "__main__":
    raise SystemExit(main())
