"""``mlscope edge``: an edge device behind a leaf-node nats-server.

``mlscope edge init --hub URL --out DIR`` writes ``DIR/leaf.conf`` (outbound to the
hub's leaf port, its own JetStream domain; readable by its owner only, since with
``--creds`` it holds the edge user's seed) and ``DIR/edge.env`` (what ``mlscope agent``
on the device needs). ``mlscope edge up --dir DIR --framework tflite`` runs the leaf,
creates its span buffer stream, and runs the agent against it. ``mlscope edge attach
DOMAIN`` (on the hub side, server credentials) makes the hub's trace stream source that
buffer, so spans recorded while the link is down arrive when it returns.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

import anyio
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from cli.auth_cmd import subject_token
from cli.flag_types import framework_name, port_or_zero
from mlscope import bus as busmod
from mlscope import names, provision
from mlscope.auth import INBOX_PREFIXES
from mlscope.auth_files import inbox_prefix_for, read_roles
from mlscope.bounded import MAX_DOCUMENT_BYTES
from mlscope.errors import ConfigError
from mlscope.lifeline import ends_with_this_process
from mlscope.natsserver import NatsServer, leaf_config
from mlscope.regular_files import read_text
from mlscope.secrets_io import write_atomic, write_secret
from mlscope.settings import Settings

__all__ = ["EDGE_AGENT_ID", "attach_agent_id", "create_edge_stream", "edge_agent_id", "register"]

EDGE_BUFFER_MAX_AGE_S = 7 * 24 * 3600.0
EDGE_AGENT_ID = "MLSCOPE_EDGE_AGENT_ID"
"""``edge.env``'s record of the agent id the edge credentials are bound to
(``mlscope auth init --edge-id``)."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    edge = sub.add_parser("edge", help="edge devices: leaf-node config, run, attach")
    cmds = edge.add_subparsers(dest="edge_command", required=True, metavar="ACTION")
    init = cmds.add_parser("init", help="write the leaf-node config of an edge device")
    init.add_argument(
        "--hub", required=True, help="the hub's leaf-node URL, e.g. nats-leaf://hub.example:7422"
    )
    init.add_argument("--out", type=Path, required=True)
    init.add_argument(
        "--domain",
        type=subject_token,
        default="edge1",
        help="JetStream domain of this device (unique per device)",
    )
    init.add_argument("--hub-domain", type=subject_token, default="hub")
    init.add_argument(
        "--creds",
        type=Path,
        default=None,
        help="edge.creds of `mlscope auth init` for the link to the hub",
    )
    init.add_argument(
        "--port",
        type=port_or_zero,
        default=4222,
        help="local client port of the leaf (0: any free one, chosen by `edge up`)",
    )
    init.set_defaults(func=run_init)

    up = cmds.add_parser("up", help="run the leaf node and an agent on this device")
    up.add_argument("--dir", type=Path, required=True, help="the directory of `edge init`")
    up.add_argument("--framework", type=framework_name, default="tflite")
    up.add_argument(
        "--agent-id",
        default=None,
        help="the agent's id (default: the edge id `edge init --creds` recorded, else "
        "HOST-FRAMEWORK)",
    )
    up.set_defaults(func=run_up)

    attach = cmds.add_parser("attach", help="(hub side) pull an edge domain's span buffer")
    attach.add_argument("domain", type=subject_token)
    attach.add_argument(
        "--agent-id",
        type=subject_token,
        default=None,
        help="the agent id the device's edge credentials are bound to: the hub stores "
        "spans from its buffer under this id only (default: edge_id of the roles.json "
        "beside MLSCOPE_NATS_CREDS)",
    )
    attach.set_defaults(func=run_attach)


def run_init(args: argparse.Namespace) -> int:
    out: Path = args.out
    edge_id = None
    if args.creds is not None:
        _check_domains(args.creds, domain=args.domain, hub_domain=args.hub_domain)
        edge_id = read_roles(args.creds.parent).get("edge_id")
    out.mkdir(parents=True, exist_ok=True)
    # With --creds the config carries the edge user's seed: private from the start.
    write_secret(
        out / "leaf.conf", leaf_config(hub_url=args.hub, domain=args.domain, seed_file=args.creds)
    )
    env = (
        f"MLSCOPE_NATS_URL=nats://127.0.0.1:{args.port}\n"
        f"MLSCOPE_JS_DOMAIN={args.hub_domain}\n"
        f"MLSCOPE_EDGE_DOMAIN={args.domain}\n"
        f"MLSCOPE_EDGE_PORT={args.port}\n"
    )
    if args.creds is not None:
        # The agent reaches the hub through the leaf's link, as the edge user: its
        # replies must arrive under the inbox prefix that user may subscribe to.
        prefix = inbox_prefix_for(args.creds) or INBOX_PREFIXES["edge"]
        env += f"MLSCOPE_NATS_INBOX_PREFIX={prefix}\n"
    if edge_id:
        # The edge user may write only this id's registry key and spans: an agent
        # under any other id is never advertised.
        env += f"{EDGE_AGENT_ID}={edge_id}\n"
    write_atomic(out / "edge.env", env)
    print(f"wrote {out / 'leaf.conf'} and {out / 'edge.env'}")
    attach = f"mlscope edge attach {args.domain}"
    print(f"on the hub (server credentials): {attach} --agent-id {edge_id or 'AGENT_ID'}")
    print(f"on this device: mlscope edge up --dir {out}")
    return 0


def _check_domains(creds: Path, *, domain: str, hub_domain: str) -> None:
    """The edge user's permissions name both domains: a mismatch would let the agent
    connect and then lose its registry writes or its span buffer."""
    roles = read_roles(creds.parent)
    for flag, want, have in (
        ("--domain", roles.get("edge_domain"), domain),
        ("--hub-domain", roles.get("hub_domain"), hub_domain),
    ):
        if want is not None and want != have:
            raise ConfigError(
                f"{creds.parent} was written for {flag} {want}, not {have}: "
                f"pass {flag} {want} or rerun `mlscope auth init`"
            )


def read_env(directory: Path) -> dict[str, str]:
    path = directory / "edge.env"
    if not path.exists():
        raise ConfigError(f"{path} does not exist: run `mlscope edge init` first")
    try:  # a FIFO would block, a device read without end
        text = read_text(path, MAX_DOCUMENT_BYTES)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}", field="edge.env") from exc
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs}


async def create_edge_stream(leaf_url: str) -> None:
    """The leaf's own buffer of span batches (local JetStream, no domain prefix)."""
    settings = Settings(nats_url=leaf_url)
    async with busmod.connect(settings, name="mlscope edge") as bus:
        cfg = StreamConfig(
            name=provision.EDGE_TRACES_STREAM,
            subjects=[names.traces_wildcard()],
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=EDGE_BUFFER_MAX_AGE_S,
            duplicate_window=120.0,
        )
        with busmod.bus_errors(f"cannot create the edge span buffer on {leaf_url}"):
            if await busmod.if_found(bus.js.stream_info(provision.EDGE_TRACES_STREAM)) is None:
                await bus.js.add_stream(cfg)


def run_up(args: argparse.Namespace) -> int:
    """The leaf, then the agent, until the agent exits or this process is told to stop:
    Ctrl-C, or SIGTERM (systemd, ``docker stop``, ``kill``), which unwinds the same way,
    so that the agent and then the leaf (its own session: no signal of ours reaches it)
    are stopped before this process ends."""
    env = read_env(args.dir)
    agent_id = edge_agent_id(args.agent_id, env, args.dir)
    settings: Settings = args.settings
    leaf = NatsServer(
        store_dir=settings.data_dir / "edge-nats",
        port=int(env.get("MLSCOPE_EDGE_PORT", "4222")),
        config_file=args.dir / "leaf.conf",
    )
    agent: subprocess.Popen[bytes] | None = None
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        leaf.start()
        anyio.run(create_edge_stream, leaf.url, backend="asyncio")
        print(
            f"mlscope edge: leaf {leaf.url} (domain {env.get('MLSCOPE_EDGE_DOMAIN')}), "
            f"agent {args.framework}",
            flush=True,
        )
        agent = subprocess.Popen(
            _agent_command(args.framework, agent_id),
            env=_agent_env(settings, env, leaf.url),
            preexec_fn=ends_with_this_process(),
        )
        return agent.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut this short
        _stop(agent)
        leaf.stop()
        signal.signal(signal.SIGTERM, previous)


def _terminated(signum: int, _frame: object) -> NoReturn:
    """SIGTERM as an exit that unwinds (its default ends the process where it stands)."""
    raise SystemExit(128 + signum)


def edge_agent_id(requested: str | None, env: dict[str, str], directory: Path) -> str | None:
    """The agent's id: the one the edge credentials are bound to (recorded in
    ``edge.env``), which ``--agent-id`` may only repeat; without credentials,
    ``--agent-id`` or the agent's default (None)."""
    bound = env.get(EDGE_AGENT_ID)
    if bound and requested and requested != bound:
        raise ConfigError(
            f"the edge credentials of {directory} are bound to agent id {bound!r} "
            f"(`mlscope auth init --edge-id`): the hub would refuse every registry write "
            f"and span of {requested!r}; run without --agent-id or with --agent-id {bound}",
            field="agent_id",
        )
    return bound or requested


def _agent_command(framework: str, agent_id: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "cli.main", "agent", "--framework", framework]
    return [*cmd, "--agent-id", agent_id] if agent_id else cmd


def _agent_env(settings: Settings, env: dict[str, str], leaf_url: str) -> dict[str, str]:
    """The agent's environment: this one's settings, on the leaf, in the hub's domain."""
    child_env = {
        **os.environ,
        **settings.as_env(),
        "MLSCOPE_NATS_URL": leaf_url,
        "MLSCOPE_JS_DOMAIN": env.get("MLSCOPE_JS_DOMAIN", "hub"),
    }
    if env.get("MLSCOPE_NATS_INBOX_PREFIX"):
        child_env["MLSCOPE_NATS_INBOX_PREFIX"] = env["MLSCOPE_NATS_INBOX_PREFIX"]
    return child_env


def _stop(agent: subprocess.Popen[bytes] | None, timeout: float = 20.0) -> None:
    """SIGTERM to the agent (it deregisters and flushes its spans), SIGKILL if it has
    not exited within ``timeout`` s."""
    if agent is None or agent.poll() is not None:
        return
    agent.terminate()
    try:
        agent.wait(timeout)
    except subprocess.TimeoutExpired:
        agent.kill()
        agent.wait()


def run_attach(args: argparse.Namespace) -> int:
    agent_id = attach_agent_id(args.agent_id, args.settings)

    async def main() -> None:
        async with busmod.connect(args.settings, name="mlscope edge attach") as bus:
            await provision.attach_edge(bus, args.domain, agent_id)

    anyio.run(main, backend="asyncio")
    whose = f"agent {agent_id}" if agent_id else "any agent"
    print(f"hub trace stream now sources edge domain {args.domain} ({whose})")
    return 0


def attach_agent_id(requested: str | None, settings: Settings) -> str | None:
    """The agent whose spans the hub takes from an edge buffer: ``--agent-id``, else
    the edge id ``mlscope auth init`` recorded beside the credentials in use. The
    device owns its buffer, so under credentials an id is required (nothing else binds
    what the device sends); without them (None: any agent's spans) no user is bound to
    an id anyway."""
    if requested:
        return requested
    creds = settings.nats_creds
    if creds is None:
        return None
    edge_id = read_roles(creds.parent).get("edge_id")
    if not edge_id:
        raise ConfigError(
            f"mlscope edge attach needs the agent id of the device ({creds.parent}/roles.json "
            "records no edge_id): pass --agent-id, the --edge-id of `mlscope auth init`",
            field="agent_id",
        )
    return str(edge_id)
