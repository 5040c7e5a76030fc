"""``mlscope rerun EVAL_ID``: run a stored evaluation's specification again.

The stored job is resubmitted with a new job id, ``rerun_of`` pointing at the original,
and pinned to what ran: the exact model version, the manifest's content (its sha256,
which also covers the artifacts' checksums: a changed manifest is refused, not
silently used) and the framework's exact version. The new evaluation stores its own
full specification, so the two can be compared field by field.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import anyio

from cli.submit import format_summary
from mlscope import bus as busmod
from mlscope import remote
from mlscope.contracts import EvaluationSummary, JobRequest, new_id
from mlscope.errors import EvaluationError
from mlscope.jobs import submit
from mlscope.manifest import manifest_digest
from mlscope.settings import Settings

__all__ = ["register", "rerun", "rerun_job"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("rerun", help="run a stored evaluation's specification again")
    p.add_argument("evaluation_id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def rerun_job(spec: dict[str, object], evaluation_id: str) -> JobRequest:
    imported = spec.get("imported")
    if isinstance(imported, dict):
        raise EvaluationError(
            f"evaluation {evaluation_id} was imported from MLPerf logs "
            f"({imported.get('source')}): there is no job to rerun",
            evaluation_id=evaluation_id,
        )
    job = JobRequest.model_validate(spec["job"])
    manifest = spec.get("manifest")
    if not isinstance(manifest, dict) or "version" not in manifest:
        raise EvaluationError(
            f"evaluation {evaluation_id} has no stored manifest to rerun",
            evaluation_id=evaluation_id,
        )
    ran = spec.get("agent")
    frameworks = ran.get("frameworks", []) if isinstance(ran, dict) else []
    version = next(
        (
            f.get("version")
            for f in frameworks
            if isinstance(f, dict) and f.get("name") == job.framework
        ),
        None,
    )
    return job.model_copy(
        update={
            "job_id": new_id("job"),
            "rerun_of": evaluation_id,
            "model_version": str(manifest["version"]),
            "manifest_sha256": str(spec.get("manifest_sha256") or manifest_digest(manifest)),
            "framework_version": f"=={version}" if version else job.framework_version,
            "submitted_at": time.time(),
        }
    )


def artifact_note(before: dict[str, object], after: dict[str, object]) -> str | None:
    """A warning when the rerun ran other model bytes than the original (another
    machine's build, a rebuild): results may differ for that reason alone."""
    old, new = before.get("artifact_sha256"), after.get("artifact_sha256")
    if old is None or new is None or old == new:
        return None
    return (
        f"note: the model's artifact differs from the original run's (sha256 {new} "
        f"vs {old}): it was built elsewhere or rebuilt, so results may differ for "
        "that reason alone"
    )


async def rerun(settings: Settings, evaluation_id: str) -> EvaluationSummary:
    async with busmod.connect(settings, name="mlscope rerun") as bus:
        spec, _ = await remote.evaluation(bus, evaluation_id)
    job = rerun_job(spec, evaluation_id)
    # An MLPerf run lasts what its conf files say (10 minutes officially).
    summary = await submit(settings, job, timeout=6 * 3600.0 if job.mlperf else None)
    async with busmod.connect(settings, name="mlscope rerun") as bus:
        again, _ = await remote.evaluation(bus, summary.evaluation_id)
    note = artifact_note(spec, again)
    if note:
        print(note, file=sys.stderr)
    return summary


def run(args: argparse.Namespace) -> int:
    summary = anyio.run(rerun, args.settings, args.evaluation_id, backend="asyncio")
    if args.json:
        print(json.dumps(summary.model_dump(mode="json", by_alias=True)))
    else:
        print(format_summary(summary))
    return 0
