"""``mlscope-submit MODEL[@VERSION] --framework F ...``: publish a job, wait, report."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import anyio
import nats.errors
import nats.js.errors

from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.contracts import EvaluationSummary, JobEvent, JobRequest, ScenarioSpec
from mlscope.errors import BusError, MLScopeError, error_from_wire
from mlscope.settings import Settings

__all__ = ["main", "submit"]

ACCEPT_TIMEOUT_S = 10.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlscope-submit", description=__doc__)
    p.add_argument("model", metavar="MODEL[@VERSION]")
    p.add_argument("--framework", required=True)
    p.add_argument("--framework-version", default=None, help="constraint, e.g. '>=1.20,<2'")
    p.add_argument("--device", default="cpu")
    p.add_argument("--agent", dest="agent_id", default=None)
    p.add_argument("--scenario", default="online", choices=["online", "batched"])
    p.add_argument("--qps", type=float, default=100.0)
    p.add_argument("--duration", type=float, default=10.0, help="seconds")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-queries", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-level", default="model",
                   choices=["none", "model", "framework", "system", "full"])
    p.add_argument("--json", action="store_true", help="print only the summary as JSON")
    p.add_argument("--all-agents", action="store_true",
                   help="one evaluation on every live agent that serves the model; "
                        "prints one comparison table")
    p.add_argument("--any-framework", action="store_true",
                   help="with --all-agents: agents of every framework offering the model")
    return p


def make_job(args: argparse.Namespace) -> JobRequest:
    name, _, version = args.model.partition("@")
    return JobRequest(
        model=name, model_version=version or None, framework=args.framework,
        framework_version=args.framework_version, device=args.device, agent_id=args.agent_id,
        scenario=ScenarioSpec(name=args.scenario, qps=args.qps, duration_s=args.duration,
                              batch_size=args.batch_size, seed=args.seed,
                              max_queries=args.max_queries),
        trace_level=args.trace_level, submitted_at=time.time())


async def submit(settings: Settings, job: JobRequest, *, on_event: object = None,
                 timeout: float | None = None) -> EvaluationSummary:
    """Publish ``job`` and wait for its summary; failures raise their typed error."""
    limit = timeout or (job.scenario.duration_s * 3 + 360.0)
    async with busmod.connect(settings, name="mlscope-submit") as bus:
        sub = await bus.nc.subscribe(names.job_events(job.job_id))
        try:
            # Retried with the job id as message id: a cluster leader election or a
            # reconnect does not lose the job, and a retry is not a second job.
            await busmod.publish_persistent(bus, names.JOBS_SUBJECT, codec.encode_model(job),
                                            msg_id=job.job_id, attempts=4)
        except BusError as exc:
            raise BusError("the job stream does not exist: is an mlscope server running? "
                           "(`mlscope up` or `mlscope server`)") from exc
        accepted = False
        deadline = time.monotonic() + limit
        while True:
            wait = ACCEPT_TIMEOUT_S if not accepted else deadline - time.monotonic()
            try:
                msg = await sub.next_msg(timeout=max(0.1, wait))
            except (nats.errors.TimeoutError, TimeoutError) as exc:
                if not accepted:
                    raise BusError(f"no server took job {job.job_id} within "
                                   f"{ACCEPT_TIMEOUT_S:g} s: is `mlscope server` running?"
                                   ) from exc
                raise BusError(f"job {job.job_id} did not finish within {limit:g} s") from exc
            event = codec.decode_model(JobEvent, msg.data)
            accepted = True
            if callable(on_event):
                on_event(event)
            if event.event == "failed":
                raise error_from_wire(event.error or {"message": "job failed"})
            if event.event == "done" and event.summary is not None:
                return event.summary


def _progress(event: JobEvent) -> None:
    if event.event == "progress":
        p50 = f"{event.p50_ms:.3f} ms" if event.p50_ms is not None else "-"
        print(f"\r  {event.queries_done:>8} queries  {event.elapsed_s:6.1f} s  p50 {p50:<12}",
              end="", file=sys.stderr, flush=True)
    elif event.event == "accepted":
        print(f"  accepted by {event.server_id}", file=sys.stderr, flush=True)


def format_summary(s: EvaluationSummary) -> str:
    def f(v: float | None, unit: str = "", nd: int = 3) -> str:
        return "-" if v is None else f"{v:.{nd}f}{unit}"

    lat, lag = s.latency_ms, s.issue_lag_us
    verdict = "VALID" if s.valid else "INVALID: " + "; ".join(s.invalid_reasons)
    rows = [
        ("evaluation", s.evaluation_id),
        ("model", f"{s.model['name']} {s.model['version']}"),
        ("framework", f"{s.framework['name']} {s.framework['version']} on {s.device}"),
        ("agent", f"{s.agent_id} ({s.host})"),
        ("scenario", f"{s.scenario['name']} batch={s.scenario['batch_size']} "
                     f"seed={s.scenario['seed']}"),
        ("verdict", verdict),
        ("queries", f"{s.queries} ({s.samples} samples, {s.errors} errors, "
                    f"{s.not_issued} not issued) in {s.duration_s:.2f} s"),
        ("rate", f"requested {f(s.requested_qps, '', 1)} / scheduled "
                 f"{f(s.scheduled_qps, '', 1)} / achieved {f(s.achieved_qps, '', 1)} QPS"),
        ("latency ms", f"trimmed mean {f(lat.trimmed_mean)}  p50 {f(lat.p50)}  p90 "
                       f"{f(lat.p90)}  p99 {f(lat.p99)}  max {f(lat.max)}"),
        ("issue lag µs", f"p50 {f(lag.get('p50'), '', 1)}  p99 {f(lag.get('p99'), '', 1)}  "
                         f"max {f(lag.get('max'), '', 1)}"),
        ("throughput", f"{f(s.throughput_ips, '', 1)} inputs/s"),
    ]
    if s.accuracy:
        rows.append(("accuracy", "  ".join(f"{k} {v:.4f}" for k, v in s.accuracy.items())))
    return "\n".join(f"  {k:<13} {v}" for k, v in rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    settings = Settings.from_env()
    if args.all_agents:
        return _main_all_agents(args, settings)
    try:
        job = make_job(args)
        show = None if args.json or not sys.stderr.isatty() else _progress
        summary = anyio.run(lambda: submit(settings, job, on_event=show), backend="asyncio")
    except MLScopeError as exc:
        print(f"mlscope-submit: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # pydantic validation of the arguments
        print(f"mlscope-submit: invalid arguments: {exc}", file=sys.stderr)
        return 2
    if show is not None:
        print(file=sys.stderr)
    if args.json:
        print(json.dumps(summary.model_dump(mode="json", by_alias=True)))
    else:
        print(format_summary(summary))
    return 0


def _main_all_agents(args: argparse.Namespace, settings: Settings) -> int:
    from cli.all_agents import comparison_table, submit_all

    try:
        job = make_job(args)
        results = anyio.run(lambda: submit_all(settings, job, any_framework=args.any_framework),
                            backend="asyncio")
    except MLScopeError as exc:
        print(f"mlscope-submit: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"mlscope-submit: invalid arguments: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([r.model_dump(mode="json", by_alias=True)
                          if isinstance(r, EvaluationSummary) else {"error": r.to_wire()}
                          for r in results]))
    else:
        print(comparison_table(results))
    return 0 if all(isinstance(r, EvaluationSummary) for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
