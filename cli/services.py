"""``mlscope up``, ``mlscope server`` and ``mlscope agent``: their flags and how each runs
(the processes ``mlscope up`` supervises are :class:`cli.stack.Stack`)."""

from __future__ import annotations

import argparse
import importlib.util
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio

from cli.artifacts_cmd import built_models
from cli.flag_types import device_name, framework_name, framework_names, port, positive_int
from cli.stack import LOOPBACK, Stack
from mlscope import artifact_bucket
from mlscope import bus as busmod
from mlscope.errors import ArtifactError, MLScopeError
from mlscope.serving import configure_logging
from mlscope.settings import Settings
from mlscope.zoo.build import BUILDERS

__all__ = ["register"]

# Frameworks `up` starts an agent for, with the module that must be importable.
FRAMEWORK_MODULES = {
    "onnxruntime": "onnxruntime",
    "pytorch": "torch",
    "tensorflow": "tensorflow",
    "tflite": "ai_edge_litert",
    "noop": None,
}


MAX_AGENTS_PER_FRAMEWORK = 64
"""Most agents ``mlscope up`` starts for one framework: each is a process holding its
models and runtime on this one machine; more is a typo, not a deployment."""


def agent_count(text: str) -> int:
    """An argparse type: agents per framework, 1 to :data:`MAX_AGENTS_PER_FRAMEWORK`."""
    n = positive_int(text)
    if n > MAX_AGENTS_PER_FRAMEWORK:
        raise argparse.ArgumentTypeError(
            f"{text!r} is more than {MAX_AGENTS_PER_FRAMEWORK} agents per framework"
        )
    return n


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _register_up(sub)
    _register_server(sub)
    _register_agent(sub)


def _register_up(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``mlscope up``: the whole stack on this machine."""
    up = sub.add_parser("up", help="run nats-server, the server and one agent per framework")
    up.add_argument("--nats-port", type=port, default=4222)
    up.add_argument(
        "--host",
        default=LOOPBACK,
        help="address nats-server listens on (default: 127.0.0.1, this machine "
        "only); to listen on a network use --auth as well",
    )
    up.add_argument("--data-dir", type=Path, default=None)
    up.add_argument(
        "--frameworks",
        type=framework_names,
        default=None,
        help="comma-separated frameworks (default: every installed one)",
    )
    up.add_argument(
        "--auth",
        type=Path,
        default=None,
        metavar="DIR",
        help="run with the users of `mlscope auth init --out DIR`: the server "
        "and agents connect with their role's credentials",
    )
    up.add_argument(
        "--agents-per-framework",
        type=agent_count,
        default=1,
        help="agents started for each framework (they share its queue groups; "
        f"1 to {MAX_AGENTS_PER_FRAMEWORK})",
    )
    up.set_defaults(func=run_up)


def _register_server(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``mlscope server``: one server against the bus."""
    srv = sub.add_parser("server", help="run the server against MLSCOPE_NATS_URL")
    _log_level(srv)
    srv.set_defaults(func=run_server)


def _register_agent(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``mlscope agent``: one agent against the bus."""
    ag = sub.add_parser("agent", help="run one agent against MLSCOPE_NATS_URL")
    ag.add_argument("--framework", type=framework_name, required=True)
    ag.add_argument(
        "--device",
        type=device_name,
        default="cpu",
        help="where models run: cpu (default), cuda, cuda:N, tensorrt, fpga:N...",
    )
    ag.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="intra-op threads per model (default: the framework manifest's, else the "
        "runtime's choice)",
    )
    ag.add_argument("--agent-id", default=None)
    _agent_limits(ag)
    _log_level(ag)
    ag.set_defaults(func=run_agent)


def _agent_limits(ag: argparse.ArgumentParser) -> None:
    """What an agent accepts: custom code, local runs, the memory its samples take."""
    ag.add_argument(
        "--allow-custom-code",
        action="store_true",
        help="run custom Python steps of manifests from trusted local "
        "directories (as MLSCOPE_ALLOW_CUSTOM_CODE=1; never bus manifests)",
    )
    ag.add_argument(
        "--no-local-runs",
        dest="local_runs",
        action="store_false",
        help="refuse to generate a run's load here (jobs with placement agent go elsewhere)",
    )
    ag.add_argument(
        "--sample-memory",
        type=positive_int,
        default=1024,
        metavar="MIB",
        help="memory the samples this agent holds may take: MLPerf runs' sample libraries and "
        "local runs' pre-processed data sets (default 1024 MiB)",
    )
    ag.add_argument(
        "--inflight-memory",
        type=positive_int,
        default=1024,
        metavar="MIB",
        help="memory the inputs of the queries waiting for one model may take; a query past "
        "it is answered overloaded (default 1024 MiB)",
    )


LOG_LEVELS = ("debug", "info", "warning", "error")


def _log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level", default="info", choices=LOG_LEVELS, help="stderr log level (default info)"
    )


def run_server(args: argparse.Namespace) -> int:
    from broker.server import Server

    configure_logging(args.log_level)
    return _serve(Server(args.settings).run)


def run_agent(args: argparse.Namespace) -> int:
    from agent.service import Agent, AgentConfig
    from mlscope.catalog import Catalog, default_manifest_dirs

    configure_logging(args.log_level)
    settings: Settings = args.settings
    if args.allow_custom_code:
        settings = settings.with_(allow_custom_code=True)
    config = AgentConfig(
        framework=args.framework,
        agent_id=args.agent_id,
        device=args.device,
        threads=args.threads,
        local_runs=args.local_runs,
        sample_memory_bytes=args.sample_memory << 20,
        inflight_memory_bytes=args.inflight_memory << 20,
    )
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
    return [
        fw
        for fw, mod in FRAMEWORK_MODULES.items()
        if mod is None or importlib.util.find_spec(mod) is not None
    ]


def _share_zoo(settings: Settings) -> None:
    """Say which zoo models are not built here, and push the built ones to the bus's
    artifact bucket so that agents joining from other machines can fetch them. ``mlscope
    up`` does this before its server and agents start, with the server's credentials,
    so that no job's measurement shares the machine with the push. Nothing here stops
    the stack: a model directory that does not match its lock is skipped with a notice,
    and a bus that refuses the push costs the push only."""
    have = {d.parent.name for d in built_models(settings.zoo_dir)}
    missing = [name for name in BUILDERS if name not in have]
    if missing:
        print(
            f"mlscope up: zoo models not built here: {', '.join(missing)} (run `mlscope "
            f"zoo build --only {' '.join(missing)}`)",
            flush=True,
        )
    try:
        shared, sent = anyio.run(_push_each, settings, backend="asyncio")
    except MLScopeError as exc:
        print(
            f"mlscope up: the built zoo was not pushed to the artifact bucket: {exc}",
            file=sys.stderr,
            flush=True,
        )
        return
    if shared:
        print(
            f"mlscope up: zoo shared on the bus: {', '.join(shared)} ({sent} sent now)", flush=True
        )


async def _push_each(settings: Settings) -> tuple[list[str], int]:
    """Push each built model on its own, so one broken directory does not keep the
    others from the bucket; (the models in the bucket, how many were sent now)."""
    dirs = built_models(settings.zoo_dir)
    shared: list[str] = []
    sent = 0
    if not dirs:
        return shared, sent
    async with busmod.connect(settings, name="mlscope up") as bus:
        for d in dirs:
            try:
                sent += await artifact_bucket.push(bus, d, replicas=settings.js_replicas)
            except ArtifactError as exc:
                print(
                    f"mlscope up: {d.parent.name} {d.name} not pushed: {exc}",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                shared.append(f"{d.parent.name} {d.name}")
    return shared, sent


def listen_notice(host: str, *, auth: bool) -> str:
    """What ``mlscope up`` says about who can reach its nats-server."""
    if host in (LOOPBACK, "localhost", "::1"):
        return (
            f"mlscope up: NATS listens on {host} only (this machine); to serve other "
            "machines use --host ADDR with --auth DIR"
        )
    if not auth:
        return (
            f"mlscope up: WARNING: NATS listens on {host} WITHOUT credentials: anyone "
            "who reaches it may submit jobs, read results and pose as an agent; use "
            "--auth DIR (`mlscope auth init`)"
        )
    return f"mlscope up: NATS listens on {host}; clients need the credentials in --auth"


def run_up(args: argparse.Namespace) -> int:
    settings: Settings = args.settings
    if args.data_dir is not None:
        settings = settings.with_(data_dir=args.data_dir.expanduser())
    frameworks = args.frameworks.split(",") if args.frameworks else installed_frameworks()
    print(listen_notice(args.host, auth=args.auth is not None), flush=True)
    stack = Stack(
        settings,
        nats_port=args.nats_port,
        frameworks=frameworks,
        auth=args.auth,
        host=args.host,
        agents_per_framework=args.agents_per_framework,
    )
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        s = stack.start(before_services=_share_zoo)
        print(
            f"mlscope up: NATS {s.nats_url}, data {s.data_dir}, database {s.dsn}, "
            f"agents: {', '.join(frameworks)}  (Ctrl-C stops everything)",
            flush=True,
        )
        if s.nats_creds:
            print(f"mlscope up: clients connect with MLSCOPE_NATS_CREDS={s.nats_creds}", flush=True)
        reported: set[str] = set()
        while not stopping:
            for name in stack.dead():
                if name not in reported:
                    reported.add(name)
                    print(
                        f"mlscope up: {name} exited with {stack.children[name].returncode}",
                        file=sys.stderr,
                        flush=True,
                    )
            if "server" in reported:
                return 1
            time.sleep(0.2)
    finally:
        stack.stop()
    return 0
