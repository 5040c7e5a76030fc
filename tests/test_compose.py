"""compose.yaml is structurally valid and runs only commands this project has."""

from __future__ import annotations

from pathlib import Path

import yaml

from cli.main import build_parser
from cli.services import FRAMEWORK_MODULES
from mlscope.settings import Settings

COMPOSE = Path(__file__).resolve().parent.parent / "compose.yaml"
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
        if svc.get("command", [""])[0] == "mlscope":
            deps = svc["depends_on"]
            assert all(deps[n]["condition"] == "service_healthy" for n in NATS), name


def test_nats_nodes_form_one_jetstream_cluster() -> None:
    for name in NATS:
        cmd = SERVICES[name]["command"]
        assert "-js" in cmd and cmd[cmd.index("--name") + 1] == name
        assert cmd[cmd.index("--cluster_name") + 1] == "mlscope"
        routes = cmd[cmd.index("--routes") + 1].split(",")
        assert {r.split("//")[1].split(":")[0] for r in routes} == set(NATS) - {name}


def test_dashboard_service_runs_mlscope_dashboard() -> None:
    build_parser().parse_args(SERVICES["dashboard"]["command"][1:])
