"""What an evaluation is made of, for every kind of run (a scenario run, an MLPerf
LoadGen run): the data set it feeds and the specification stored with its results."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import mlscope
from mlscope.catalog import Entry
from mlscope.contracts import AgentDescription, JobRequest

__all__ = ["git_commit", "specification"]


def specification(
    job: JobRequest, agent: AgentDescription, entry: Entry, prep: dict[str, Any]
) -> dict[str, Any]:
    """Everything needed to run this evaluation again (stored with its results).

    ``mlscope_version`` and ``git_commit`` are the server's; ``agent_mlscope_version``,
    ``agent_git_commit`` and ``agent_settings`` (runtime options, device, batching and
    queue settings the model ran with) are what the agent reported when prepared."""
    return {
        "job": job.dump(),
        "manifest": entry.manifest.model_dump(mode="json"),
        "manifest_sha256": entry.manifest.digest,
        "manifest_file": str(entry.path),
        "artifact_sha256": prep.get("sha256"),
        "agent": agent.dump(),
        "agent_settings": prep.get("settings"),
        "agent_mlscope_version": prep.get("mlscope_version"),
        "agent_git_commit": prep.get("git_commit"),
        "mlscope_version": mlscope.__version__,
        "git_commit": git_commit(),
    }


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=5,
            check=False,
        )
    except OSError:
        return ""
    return out.stdout.strip()
