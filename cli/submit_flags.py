"""``mlscope-submit``'s command line: its flags, and the job they make.

:func:`parser` declares every flag (grouped by what it sets); :func:`make_job` turns the
parsed flags into a :class:`~mlscope.contracts.JobRequest` and refuses, as a usage
error naming the flag, one the scenario does not read or a spec its strategy refuses.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from broker.scenarios import read_arrivals, refuse, scenario_spec
from cli.submit_errors import FIELD_FLAGS, FlagError, flag_for, flags_contract
from cli.system_opts import add_system_flags, system_from_args
from mlscope import scenario_traits
from mlscope.contracts import JobRequest, ScenarioSpec
from mlscope.errors import ConfigError
from mlscope.validity import ValidityPolicy

__all__ = ["make_job", "parser"]


def parser(*, description: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``mlscope-submit`` (``description``: what ``--help`` says first)."""
    p = argparse.ArgumentParser(
        prog="mlscope-submit",
        description=description,
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
    _refuse_what_cannot_run(job.scenario, flags, scenario_file=args.scenario_file)
    return job


def _refuse_what_cannot_run(
    spec: ScenarioSpec, flags: dict[str, Any], *, scenario_file: Path | None = None
) -> None:
    """A flag the scenario does not read, a value of the ``--scenario-file`` it does not
    read (the file names another scenario and ``--scenario`` changed it), or a spec its
    strategy refuses at intake (:meth:`broker.scenario.Scenario.refuse`, held to the
    server's default validity policy), as a usage error naming the flag: refused here,
    before anything runs, rather than ignored or found out after a run."""
    traits = scenario_traits.get(spec.name)
    for field, value in flags.items():
        if field != "name" and value is not None and not traits.reads(field):
            raise FlagError(
                f"argument {flag_for(field)}: scenario {spec.name!r} does not read it: "
                f"{traits.unread(field)}"
            )
    for field in sorted(spec.model_fields_set - {"name"} - _given(flags)):
        if not traits.reads(field):  # set by the file, for the scenario it names
            raise FlagError(
                f"argument --scenario: {scenario_file} sets {field}, which scenario "
                f"{spec.name!r} does not read: {traits.unread(field)}"
            )
    _refuse_what_is_missing(spec, traits)
    try:
        refuse(spec, ValidityPolicy())
    except ConfigError as exc:
        named = exc.fields.get("field")
        where = f"argument {flag_for(named)}: " if isinstance(named, str) else ""
        raise FlagError(f"{where}{exc.message}") from exc


def _refuse_what_is_missing(spec: ScenarioSpec, traits: scenario_traits.ScenarioTraits) -> None:
    """What the scenario cannot run without (``requires``, as a scenario file must set
    it) and no flag or file gave: refused here, not by the server once the job is
    queued (a replay without ``--schedule``, a piecewise run without segments)."""
    read_as = {"schedule_file": "arrivals_s", **dict(traits.file_aliases)}
    for field in traits.requires:
        spec_field = read_as.get(field, field)
        if getattr(spec, spec_field, None) is not None:
            continue
        flag = FIELD_FLAGS.get(spec_field)
        needs = flag or f"{field}, set in a --scenario-file"
        raise FlagError(f"argument --scenario: scenario {spec.name!r} needs {needs}")


def _given(flags: dict[str, Any]) -> set[str]:
    return {field for field, value in flags.items() if value is not None}
