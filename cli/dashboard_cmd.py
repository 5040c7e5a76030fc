"""``mlscope dashboard [--port P]``: the Streamlit dashboard (a client of the stack).

It reads the same settings as every other command (``MLSCOPE_NATS_URL``,
``MLSCOPE_DATA_DIR``, ``MLSCOPE_CLICKHOUSE_DSN``): with chDB it asks the server that
owns it over the bus, with a ClickHouse server it reads the database directly.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

from cli.flag_types import port
from mlscope.lifeline import ends_with_this_process
from mlscope.settings import Settings

__all__ = ["APP", "command", "register", "serve"]

APP = Path(__file__).resolve().parent.parent / "dashboard" / "app.py"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("dashboard", help="run the web dashboard (Streamlit)")
    p.add_argument("--port", type=port, default=8501)
    p.add_argument("--address", default="127.0.0.1")
    p.set_defaults(func=run)


def command(port: int, address: str = "127.0.0.1") -> list[str]:
    """The streamlit command line that serves the dashboard."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.port",
        str(port),
        "--server.address",
        address,
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--global.developmentMode",
        "false",
        "--client.toolbarMode",
        "viewer",
    ]


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("streamlit") is None:
        print(
            "mlscope dashboard needs Streamlit: pip install 'mlscope[dashboard]'", file=sys.stderr
        )
        return 1
    settings: Settings = args.settings
    env = {**os.environ, **settings.as_env()}
    root = str(APP.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    print(
        f"mlscope dashboard: http://{args.address}:{args.port}  (Ctrl-C stops it)",
        file=sys.stderr,
        flush=True,
    )
    return serve(command(args.port, args.address), env)


def serve(cmd: list[str], env: dict[str, str]) -> int:
    """Run the Streamlit process until it ends; Ctrl-C or SIGTERM on this process stops
    it too (a SIGTERM alone would otherwise leave it serving the port, orphaned), and so
    does this process's end by any means (:mod:`mlscope.lifeline`)."""
    child = subprocess.Popen(cmd, env=env, preexec_fn=ends_with_this_process())

    def stop(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return child.wait()
    except KeyboardInterrupt:
        child.send_signal(signal.SIGINT)  # a Ctrl-C in a terminal reached it already
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if child.poll() is None:
            child.terminate()
            child.wait()
