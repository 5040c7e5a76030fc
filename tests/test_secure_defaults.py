"""Secure where it costs nothing: `mlscope up` listens on loopback unless told
otherwise, says so, and warns when it would listen on a network without credentials."""

from __future__ import annotations

from pathlib import Path

from cli.main import build_parser
from cli.services import listen_notice
from cli.stack import LOOPBACK, Stack
from mlscope.settings import Settings


def test_up_binds_loopback_by_default(tmp_path: Path) -> None:
    args = build_parser().parse_args(["up", "--frameworks", "noop"])
    assert args.host == LOOPBACK == "127.0.0.1"
    stack = Stack(Settings(data_dir=tmp_path), nats_port=0, frameworks=[])
    assert stack.nats.host == LOOPBACK
    assert "127.0.0.1 only" in listen_notice(args.host, auth=False)


def test_up_warns_on_a_network_address_without_credentials() -> None:
    assert "WITHOUT credentials" in listen_notice("0.0.0.0", auth=False)
    assert "WITHOUT" not in listen_notice("0.0.0.0", auth=True)
