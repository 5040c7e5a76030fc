"""``mlscope rerun EVAL_ID``: run a stored evaluation's specification again.

The stored job (of one run of a sweep or search, ``<id>-<k>``, that run's point alone:
:mod:`mlscope.reproduce`) is resubmitted with a new job id, ``rerun_of`` pointing at the original,
and pinned to what ran: the exact model version, the manifest's content (its sha256,
which also covers the artifacts' checksums: a changed manifest is refused, not
silently used), the framework's exact version and, unless ``--any-system``, the host
the original agent ran on. The new evaluation stores its own full specification; the
command then says what differs from the original's (host, agent, versions and commit
of the agent, its runtime options and settings, the model's artifact), or that nothing
does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
from pydantic import ValidationError

from cli.console import Bar, progress
from cli.flag_types import identifier
from cli.submit_errors import InFlight, StopSignals, field_message, interrupted_many
from cli.summary_text import format_summary
from mlscope import bus as busmod
from mlscope import remote
from mlscope.contracts import (
    EvaluationSummary,
    JobEvent,
    JobRequest,
    SystemRequirement,
    new_id,
)
from mlscope.errors import DatabaseError, EvaluationError, EvaluationNotFound
from mlscope.manifest import manifest_digest
from mlscope.reproduce import evaluation_job
from mlscope.settings import Settings

__all__ = [
    "artifact_note",
    "differences",
    "register",
    "rerun",
    "rerun_job",
    "stored_scenario",
    "stored_spec",
]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("rerun", help="run a stored evaluation's specification again")
    p.add_argument("evaluation_id", type=identifier, metavar="EVAL_ID")
    p.add_argument(
        "--any-system",
        action="store_true",
        help="run on any agent that serves the job (default: the original agent's host)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def rerun_job(
    spec: dict[str, object],
    evaluation_id: str,
    *,
    any_system: bool = False,
    point: Mapping[str, Any] | None = None,
) -> JobRequest:
    """The job that runs ``evaluation_id`` again (:func:`mlscope.reproduce.evaluation_job`:
    of one run of a sweep or search, that run alone, the scenario its stored summary
    says it ran: ``point``), pinned to what ran."""
    imported = spec.get("imported")
    if isinstance(imported, dict):
        raise EvaluationError(
            f"evaluation {evaluation_id} was imported from MLPerf logs "
            f"({imported.get('source')}): there is no job to rerun",
            evaluation_id=evaluation_id,
        )
    job = evaluation_job(_stored_job(spec, evaluation_id), evaluation_id, point)
    manifest = spec.get("manifest")
    if not isinstance(manifest, dict) or "version" not in manifest:
        raise EvaluationError(
            f"evaluation {evaluation_id} has no stored manifest to rerun",
            evaluation_id=evaluation_id,
        )
    ran = spec.get("agent")
    frameworks = _listed(ran.get("frameworks") if isinstance(ran, dict) else None)
    version = next(
        (
            f.get("version")
            for f in frameworks
            if isinstance(f, dict) and f.get("name") == job.framework
        ),
        None,
    )
    host = ran.get("host") if isinstance(ran, dict) else None
    system = job.system
    if not any_system and host:
        system = (system or SystemRequirement()).model_copy(update={"host": str(host)})
    return job.model_copy(
        update={
            "job_id": new_id("job"),
            "rerun_of": evaluation_id,
            "model_version": str(manifest["version"]),
            "manifest_sha256": str(spec.get("manifest_sha256") or manifest_digest(manifest)),
            "framework_version": f"=={version}" if version else job.framework_version,
            "submitted_at": time.time(),
            "system": system,
        }
    )


def _stored_job(spec: dict[str, object], evaluation_id: str) -> JobRequest:
    """The job a stored specification ran; an EvaluationError naming what is wrong with
    it when it cannot be run again (none stored, or fields this version refuses)."""
    if "job" not in spec:
        raise EvaluationError(
            f"evaluation {evaluation_id}: its stored spec has no job to rerun",
            evaluation_id=evaluation_id,
        )
    try:
        return JobRequest.model_validate(spec["job"])
    except ValidationError as exc:
        raise EvaluationError(
            f"evaluation {evaluation_id}: its stored job cannot run again: {field_message(exc)}",
            evaluation_id=evaluation_id,
        ) from None


def _listed(value: object) -> Sequence[Any]:
    """A stored list, or () where the specification holds something else."""
    return value if isinstance(value, list | tuple) else ()


async def stored_spec(bus: busmod.Bus, evaluation_id: str) -> dict[str, Any]:
    """The stored specification of ``evaluation_id``, read as every reader of the
    database reads it (:func:`analysis.data.stored_json`: a DatabaseError naming the
    evaluation when it is not a JSON object)."""
    from analysis.data import stored_json

    _, rows = await remote.sql(
        bus,
        "SELECT spec FROM evaluations FINAL WHERE evaluation_id = {id:String}",
        {"id": evaluation_id},
    )
    if not rows:
        raise EvaluationNotFound(f"no evaluation {evaluation_id!r}", evaluation_id=evaluation_id)
    return stored_json(evaluation_id, "spec", rows[0][0])


async def stored_scenario(bus: busmod.Bus, evaluation_id: str) -> dict[str, Any] | None:
    """The scenario ``evaluation_id`` ran, as its stored summary says (a sweep's run:
    its own point); None where the summary holds none this can read."""
    from analysis.data import stored_json

    _, rows = await remote.sql(
        bus,
        "SELECT summary FROM evaluations FINAL WHERE evaluation_id = {id:String}",
        {"id": evaluation_id},
    )
    try:
        scenario = stored_json(evaluation_id, "summary", rows[0][0]).get("scenario")
    except (IndexError, DatabaseError):
        return None
    return scenario if isinstance(scenario, dict) else None


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


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``a.b.c`` keys (lists kept whole)."""
    if not isinstance(value, dict):
        return {prefix: value} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in value.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _agent_facts(spec: dict[str, Any]) -> dict[str, Any]:
    """The facts of a stored specification that a rerun reports when they differ."""
    agent = spec.get("agent")
    agent = agent if isinstance(agent, dict) else {}
    fws = {
        f.get("name"): f.get("version")
        for f in _listed(agent.get("frameworks"))
        if isinstance(f, dict)
    }
    return {
        "host": agent.get("host"),
        "agent": agent.get("agent_id"),
        "cpu": agent.get("cpu_model"),
        **{f"framework {k}": v for k, v in fws.items()},
        "agent mlscope version": spec.get("agent_mlscope_version") or agent.get("mlscope_version"),
        "agent git commit": spec.get("agent_git_commit"),
        **{
            f"agent setting {k}": "default" if v is None else v  # None: the runtime's choice
            for k, v in _flat(spec.get("agent_settings") or {}).items()
        },
    }


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What differs between an original run's stored specification and its rerun's, one
    line each (``host: b (original a)``); a fact that either run did not record is left
    out. A different model artifact gets :func:`artifact_note`."""
    old, new = _agent_facts(before), _agent_facts(after)
    lines = [
        f"{key}: {new[key]} (original {old[key]})"
        for key in sorted(old.keys() & new.keys())
        if old[key] is not None and new[key] is not None and old[key] != new[key]
    ]
    note = artifact_note(before, after)
    return [*lines, *([note] if note else [])]


async def rerun(
    settings: Settings,
    evaluation_id: str,
    *,
    any_system: bool = False,
    on_event: Callable[[JobEvent], None] | None = None,
    in_flight: InFlight | None = None,
) -> EvaluationSummary:
    """Resubmit ``evaluation_id``'s specification; ``on_event`` hears the job's events,
    and ``in_flight`` holds its job id while it runs (what an interrupt cancels)."""
    async with busmod.connect(settings, name="mlscope rerun") as bus:
        spec = await stored_spec(bus, evaluation_id)
        point = await stored_scenario(bus, evaluation_id)
    job = rerun_job(spec, evaluation_id, any_system=any_system, point=point)
    # An MLPerf run lasts what its conf files say (10 minutes officially).
    timeout = 6 * 3600.0 if job.mlperf else None
    summary = await (in_flight or InFlight()).submit(
        settings, job, on_event=on_event, timeout=timeout
    )
    async with busmod.connect(settings, name="mlscope rerun") as bus:
        again = await stored_spec(bus, summary.evaluation_id)
    diff = differences(spec, again)
    if diff:
        print(f"differs from {evaluation_id}:", file=sys.stderr)
        for line in diff:
            print(f"  {line}", file=sys.stderr)
    else:  # said, so that silence is never read as "not compared"
        print(
            f"nothing differs from {evaluation_id} (host, agent, versions, commit, "
            "settings, artifact)",
            file=sys.stderr,
        )
    return summary


def _shows(bar: Bar) -> Callable[[JobEvent], None]:
    """The job's events on the progress bar: who took it, queries done, p50 so far."""

    def show(event: JobEvent) -> None:
        if event.event == "queued":
            bar.update("queued: every server is busy")
        elif event.event == "accepted":
            bar.update(f"accepted by {event.server_id}")
        elif event.event == "progress":
            p50 = f"{event.p50_ms:.3f} ms" if event.p50_ms is not None else "-"
            bar.update(f"{event.queries_done} queries, {event.elapsed_s:.1f} s, p50 {p50}")

    return show


def run(args: argparse.Namespace) -> int:
    in_flight = InFlight()
    with StopSignals() as stops:
        try:
            with progress(f"rerunning {args.evaluation_id}", enabled=not args.json) as bar:
                summary = anyio.run(
                    lambda: rerun(
                        args.settings,
                        args.evaluation_id,
                        any_system=args.any_system,
                        on_event=_shows(bar),
                        in_flight=in_flight,
                    ),
                    backend="asyncio",
                )
        except KeyboardInterrupt:  # the job would go on holding its agent: cancel it
            interrupted_many(args.settings, in_flight, program="mlscope rerun")
            return stops.code
    if args.json:
        print(json.dumps(summary.model_dump(mode="json", by_alias=True)))
    else:
        print(format_summary(summary))
    return 0
