"""``mlscope-submit --repeat N``: the same job N times, one after another, and run-level
statistics over its VALID runs (mean and 95% CI over runs)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import anyio

from cli.submit_errors import SUBMIT_FAILURES, InFlight, failed, strict_code
from cli.summary_text import format_summary
from mlscope.contracts import EvaluationSummary, JobRequest, new_id
from mlscope.settings import Settings
from mlscope.stats import mean_ci

__all__ = ["main_repeat", "measured_runs", "run_level"]


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


def main_repeat(
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
    except SUBMIT_FAILURES as exc:
        return failed(exc)
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
