"""compose.yaml is structurally valid and runs only commands this project has."""

from __future__ import annotations

from pathlib import Path

import yaml

from cli.main import build_parser

COMPOSE = Path(__file__).resolve().parent.parent / "compose.yaml"


def test_every_service_runs_a_real_mlscope_command() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    assert {"nats", "clickhouse", "server"} <= set(services)
    parser = build_parser()
    for name, svc in services.items():
        cmd = svc.get("command")
        if not cmd:
            assert svc.get("image"), f"{name} has neither a command nor an image"
            continue
        if cmd[0] == "mlscope":
            parser.parse_args(cmd[1:])  # exits (fails the test) on an unknown command
            assert svc["environment"]["MLSCOPE_NATS_URL"].startswith("nats://")
    for svc in services.values():
        for vol in svc.get("volumes", []):
            assert vol.split(":")[0] in doc["volumes"]
