"""Storage faults: the evaluation database on a small tmpfs that is filled up.

A full disk must fail the job with the database's reason, keep the server and agent
up, and a job after space came back must succeed. (A read-only remount is refused
while chDB holds its files open, so that fault is not reproduced here.) Needs permission
to mount a tmpfs (root, as in CI's container); skipped with that reason elsewhere.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from mlscope.contracts import JobRequest, ScenarioSpec
from mlscope.errors import MLScopeError
from mlscope.jobs import submit
from mlscope.settings import Settings
from tests.conftest import child_env, python, wait_agents, wait_server

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(directory: Path) -> Path:
    """Write until the file system is full; returns the filler file."""
    filler = directory / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    return filler


def test_a_full_disk_fails_the_job_clearly_and_services_recover(
    settings: Settings, small_disk: Path
) -> None:
    settings = settings.with_(clickhouse_dsn=f"chdb:///{small_disk / 'chdb'}")
    env = child_env(settings)
    procs = [
        subprocess.Popen([python(), "-m", "cli.main", "server"], env=env),
        subprocess.Popen([python(), "-m", "cli.main", "agent", "--framework", "noop"], env=env),
    ]
    job = JobRequest(
        model="noop", framework="noop", scenario=ScenarioSpec(name="online", qps=200, duration_s=1)
    )
    try:
        anyio.run(wait_agents, settings, 1)
        anyio.run(wait_server, settings)
        filler = fill(small_disk)
        with pytest.raises(MLScopeError) as failed:
            anyio.run(lambda: submit(settings, job, timeout=90), backend="asyncio")
        assert failed.value.code == "database", failed.value
        assert "space" in failed.value.message.lower(), failed.value.message
        assert [p.poll() for p in procs] == [None, None]
        filler.unlink()  # space comes back
        again = job.model_copy(update={"job_id": "job-after-space"})
        summary = anyio.run(lambda: submit(settings, again, timeout=90), backend="asyncio")
        assert summary.status == "completed" and summary.errors == 0
        assert [p.poll() for p in procs] == [None, None]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(20)
