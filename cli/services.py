"""``mlscope up``, ``mlscope server`` and ``mlscope agent``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio

from mlscope.errors import MLScopeError
from mlscope.natsserver import NatsServer
from mlscope.settings import Settings

__all__ = ["register"]

# Frameworks `up` starts an agent for, with the module that must be importable.
FRAMEWORK_MODULES = {
    "onnxruntime": "onnxruntime",
    "pytorch": "torch",
    "tensorflow": "tensorflow",
    "tflite": "ai_edge_litert",
    "noop": None,
}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = sub.add_parser("up", help="run nats-server, the server and one agent per framework")
    up.add_argument("--nats-port", type=int, default=4222)
    up.add_argument("--data-dir", type=Path, default=None)
    up.add_argument("--frameworks", default=None,
                    help="comma-separated frameworks (default: every installed one)")
    up.set_defaults(func=run_up)

    srv = sub.add_parser("server", help="run the server against MLSCOPE_NATS_URL")
    srv.set_defaults(func=run_server)

    ag = sub.add_parser("agent", help="run one agent against MLSCOPE_NATS_URL")
    ag.add_argument("--framework", required=True)
    ag.add_argument("--device", default="cpu")
    ag.add_argument("--threads", type=int, default=None)
    ag.add_argument("--agent-id", default=None)
    ag.set_defaults(func=run_agent)


def run_server(args: argparse.Namespace) -> int:
    from broker.server import Server

    return _serve(Server(args.settings).run)


def run_agent(args: argparse.Namespace) -> int:
    from agent.service import Agent, AgentConfig
    from mlscope.catalog import Catalog, default_manifest_dirs

    settings: Settings = args.settings
    config = AgentConfig(framework=args.framework, agent_id=args.agent_id,
                         device=args.device, threads=args.threads)
    catalog = Catalog.load(default_manifest_dirs(settings.manifests_dir))
    return _serve(Agent(settings, config, catalog).run)


def _serve(run: Callable[..., Coroutine[Any, Any, None]]) -> int:
    """Run a service until SIGINT/SIGTERM, then cancel it cleanly."""

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(run)
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    break

    try:
        anyio.run(main, backend="asyncio")
    except BaseExceptionGroup as group:
        # Surface the typed error a service failed with, not the task-group wrapper.
        typed = group.subgroup(lambda e: isinstance(e, MLScopeError))
        if typed is None:
            raise
        raise _first(typed) from group
    return 0


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def installed_frameworks() -> list[str]:
    return [fw for fw, mod in FRAMEWORK_MODULES.items()
            if mod is None or importlib.util.find_spec(mod) is not None]


class Stack:
    """nats-server + server + agents as child processes of this one."""

    def __init__(self, settings: Settings, *, nats_port: int, frameworks: list[str]) -> None:
        self.settings, self.nats_port, self.frameworks = settings, nats_port, frameworks
        self.nats = NatsServer(store_dir=settings.data_dir / "nats", port=nats_port)
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> Settings:
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.nats.start()
        self.settings = self.settings.with_(nats_url=self.nats.url)
        env = {**os.environ, **self.settings.as_env()}
        py = [sys.executable, "-m", "cli.main"]
        self.children["server"] = subprocess.Popen([*py, "server"], env=env,
                                                   start_new_session=True)
        for fw in self.frameworks:
            self.children[f"agent:{fw}"] = subprocess.Popen(
                [*py, "agent", "--framework", fw], env=env, start_new_session=True)
        return self.settings

    def dead(self) -> list[str]:
        return [name for name, p in self.children.items() if p.poll() is not None]

    def stop(self, timeout: float = 15.0) -> None:
        for p in self.children.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.children.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.nats.stop()


def run_up(args: argparse.Namespace) -> int:
    settings: Settings = args.settings
    if args.data_dir is not None:
        settings = settings.with_(data_dir=args.data_dir.expanduser())
    frameworks = args.frameworks.split(",") if args.frameworks else installed_frameworks()
    stack = Stack(settings, nats_port=args.nats_port, frameworks=frameworks)
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        s = stack.start()
        print(f"mlscope up: NATS {s.nats_url}, data {s.data_dir}, database {s.dsn}, "
              f"agents: {', '.join(frameworks)}  (Ctrl-C stops everything)", flush=True)
        reported: set[str] = set()
        while not stopping:
            for name in stack.dead():
                if name not in reported:
                    reported.add(name)
                    print(f"mlscope up: {name} exited with {stack.children[name].returncode}",
                          file=sys.stderr, flush=True)
            if "server" in reported:
                return 1
            time.sleep(0.2)
    finally:
        stack.stop()
    return 0
