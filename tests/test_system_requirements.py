"""Jobs that require things of the agent's machine: flags and ``--system`` files, the
matcher on real advertised facts, and resolution on a real stack where two agents of
one host differ in what they may use (one pinned to a single core)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from cli.all_agents import matching_agents
from cli.submit_flags import make_job, parser
from cli.system_opts import parse_size
from mlscope import sysinfo, sysmatch
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.contracts import (
    AgentDescription,
    FrameworkInfo,
    JobRequest,
    ModelOffer,
    ScenarioSpec,
    SystemRequirement,
)
from mlscope.errors import ConfigError, ResolutionError
from mlscope.jobs import submit
from mlscope.manifest import SystemRequirements
from mlscope.natsserver import NatsServer
from mlscope.settings import Settings
from tests.conftest import child_env, make_data_dir, python, wait_agents, wait_server
from tests.scale_fixtures import start, stop

pytestmark = pytest.mark.timeout(180)


def described(agent_id: str = "a", **facts: object) -> AgentDescription:
    """This machine's real facts as an agent would advertise them (``facts`` override)."""
    return AgentDescription(
        agent_id=agent_id,
        **{**sysinfo.host_facts(), **facts},  # type: ignore[arg-type]
        frameworks=(FrameworkInfo(name="noop", version="1.0.0"),),
        pid=os.getpid(),
        mlscope_version="0",
        started_at=1.0,
        heartbeat_at=1.0,
        heartbeat_s=1.0,
    )


def test_the_matcher_on_this_machines_facts() -> None:
    me = described()
    cores = me.usable_cores or me.cpu_cores
    assert cores == len(os.sched_getaffinity(0))
    assert sysmatch.misses(None, me) == []
    fits = SystemRequirement(
        arch={"x86_64": "amd64", "aarch64": "arm64"}.get(me.arch, me.arch),
        device="cpu",
        min_cores=cores,
        min_memory_bytes=sysmatch.usable_memory(me),
        host=me.host,
    )
    assert sysmatch.misses(fits, me) == []
    missed = sysmatch.misses(
        SystemRequirement(
            arch="s390x",
            device="fpga",
            accelerator="u250",
            min_memory_bytes=1 << 50,
            min_cores=cores + 1,
            interconnect="nvlink",
            host="elsewhere",
        ),
        me,
    )
    assert len(missed) == 7, missed
    assert f"{cores} usable cores < {cores + 1}" in missed
    assert any(m.startswith("memory ") and "< 1048576.0 GiB" in m for m in missed)
    assert "no accelerator 'u250' (has none)" in missed
    # A cgroup limit lower than the machine's memory is what counts.
    capped = described(memory_limit_bytes=1 << 30)
    assert sysmatch.misses(SystemRequirement(min_memory_bytes=2 << 30), capped) == [
        "memory 1.0 GiB < 2.0 GiB"
    ]


def test_all_agents_runs_only_on_agents_that_meet_the_requirement() -> None:
    offer = ModelOffer(name="noop", version="1.0.0", framework="noop")
    wide, narrow = described("wide", models=(offer,)), described("narrow", models=(offer,))
    narrow = narrow.model_copy(update={"usable_cores": 1})
    cores = wide.usable_cores or wide.cpu_cores
    job = JobRequest(model="noop", framework="noop")
    assert [a.agent_id for a, _ in matching_agents(job, [wide, narrow])] == ["wide", "narrow"]
    if cores > 1:
        wanted = job.model_copy(update={"system": SystemRequirement(min_cores=cores)})
        assert [a.agent_id for a, _ in matching_agents(wanted, [wide, narrow])] == ["wide"]


def test_a_manifest_asks_only_for_what_it_sets_and_the_job_wins() -> None:
    assert sysmatch.from_manifest(SystemRequirements()) is None  # device cpu by default
    manifest = sysmatch.from_manifest(SystemRequirements(arch="amd64", min_cores=8))
    assert manifest == SystemRequirement(arch="amd64", min_cores=8)
    job = SystemRequirement(min_cores=2, min_memory_bytes=1)
    assert sysmatch.effective(manifest, job) == SystemRequirement(
        arch="amd64", min_cores=2, min_memory_bytes=1
    )
    assert sysmatch.effective(None, job) == job
    assert sysmatch.describe(job) == ">= 0.0 GiB memory, >= 2 cores"


def test_system_flags_and_files_make_the_jobs_requirement() -> None:
    def job(*flags: str) -> JobRequest:
        return make_job(parser().parse_args(["noop", "--framework", "noop", *flags]))

    assert job().system is None
    repo = Path(__file__).resolve().parent.parent
    by_file = job("--system", str(repo / "manifests/systems/gpu-h100.yaml"), "--min-cores", "4")
    assert by_file.system == SystemRequirement(
        arch="amd64",
        device="gpu",
        accelerator="NVIDIA H100",
        min_memory_bytes=64 << 30,
        min_cores=4,
        interconnect="pcie5",
    )
    assert job("--system", "cpu-amd64", "--min-memory", "2G").system == SystemRequirement(
        arch="amd64", device="cpu", min_memory_bytes=2 << 30
    )
    assert parse_size("512M") == 512 << 20 and parse_size("1.5GiB") == 3 << 29
    with pytest.raises(ConfigError, match="unknown system 'nope'"):
        job("--system", "nope")
    catalog = Catalog.load(default_manifest_dirs())
    assert {s.name for s in catalog.systems} >= {"cpu-amd64", "gpu-h100", "fpga-u250"}


NARROW = ("--agent-id", "narrow")


def _pinned_to_one_core() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


@pytest.fixture(scope="module")
def two_agents(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[Settings]:
    """A server and two noop agents on this host: ``wide`` may use every core,
    ``narrow`` is pinned to one (as ``taskset -c 0 mlscope agent`` would be)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores to pin one agent to fewer than the other")
    base = tmp_path_factory.mktemp("sysreq")
    with NatsServer(store_dir=base / "nats") as nats_server:
        settings = Settings(nats_url=nats_server.url, data_dir=make_data_dir(base / "d", zoo_dir))
        server = start(settings, "server")
        agents: list[subprocess.Popen[bytes]] = []
        try:
            anyio.run(wait_server, settings)
            agents.append(start(settings, "agent", "--framework", "noop", "--agent-id", "wide"))
            agents.append(
                subprocess.Popen(
                    [python(), "-m", "cli.main", *("agent", "--framework", "noop"), *NARROW],
                    env=child_env(settings),
                    preexec_fn=_pinned_to_one_core,
                )
            )
            anyio.run(wait_agents, settings, 2, 120.0)
            yield settings
        finally:
            stop(*agents, server)


def _job(**system: object) -> JobRequest:
    return JobRequest(
        model="noop",
        framework="noop",
        scenario=ScenarioSpec(name="online", qps=20, duration_s=0.5),
        system=SystemRequirement.model_validate(system),
    )


def test_resolution_picks_the_one_agent_that_meets_the_requirement(two_agents: Settings) -> None:
    cores = len(os.sched_getaffinity(0))
    listed = subprocess.run(
        [python(), "-m", "cli.main", "agents"],
        env=child_env(two_agents),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = {line.split()[0]: line.split() for line in listed.splitlines()[1:]}
    assert rows["narrow"][3] == "1" and rows["wide"][3] == str(cores), listed
    # Several jobs: without the requirement they would spread over both agents.
    for _ in range(3):
        summary = anyio.run(
            lambda: submit(two_agents, _job(min_cores=cores), timeout=90), backend="asyncio"
        )
        assert summary.agent_id == "wide"
    summary = anyio.run(lambda: submit(two_agents, _job(min_cores=1), timeout=90))
    assert summary.agent_id in ("wide", "narrow")


def test_a_requirement_no_agent_meets_is_refused_with_each_agents_reasons(
    two_agents: Settings,
) -> None:
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ResolutionError) as caught:
        anyio.run(
            lambda: submit(two_agents, _job(min_memory_bytes=1 << 50, min_cores=cores), timeout=60)
        )
    text = str(caught.value)
    assert "on a system with >= 1048576.0 GiB memory" in text, text
    wide = text.split("agent wide misses ")[1].split(";")[0]
    narrow = text.split("agent narrow misses ")[1].split(";")[0]
    assert wide.startswith("memory ") and "cores" not in wide, text
    assert narrow.startswith("memory ") and f"1 usable cores < {cores}" in narrow, text
    misses = caught.value.fields["system_misses"]
    assert set(misses) == {"wide", "narrow"}


def test_only_the_agents_of_the_jobs_framework_are_named_for_what_they_miss() -> None:
    """An agent of another framework could not run the job whatever its system: its
    misses would only bury the reasons that matter (it is still listed as live)."""
    from broker.resolve import resolve
    from mlscope.catalog import Catalog, default_manifest_dirs
    from mlscope.contracts import FrameworkInfo
    from tests.conftest import agent_description

    noop = agent_description("small-noop", cpu_cores=1)
    ort = agent_description(
        "small-ort", cpu_cores=1, frameworks=(FrameworkInfo(name="onnxruntime", version="1"),)
    )
    with pytest.raises(ResolutionError) as caught:
        resolve(_job(min_cores=64), [noop, ort], Catalog.load(default_manifest_dirs()))
    text = str(caught.value)
    assert "agent small-noop misses " in text and "small-ort misses" not in text, text
    assert set(caught.value.fields["system_misses"]) == {"small-noop"}
    assert "live agents: " in text and "small-ort" in text.split("live agents: ")[1]


def test_a_cgroup_memory_limit_is_read_from_either_cgroup_version(tmp_path: Path) -> None:
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    assert sysinfo.cgroup_memory_limit((v2, v1)) is None  # neither file: no cgroup
    v1.write_text("2147483648\n")
    assert sysinfo.cgroup_memory_limit((v2, v1)) == 2 << 30
    v2.write_text("max\n")  # cgroup v2 without a limit wins over a stale v1 file
    assert sysinfo.cgroup_memory_limit((v2, v1)) is None
    v2.write_text("1073741824\n")
    assert sysinfo.cgroup_memory_limit((v2, v1)) == 1 << 30
