"""``mlscope auth init --out DIR``: least-privilege users per role (see mlscope.auth);
``mlscope auth add-agent NAME --out DIR`` / ``add-loadgen NAME --out DIR``: one agent's
or load-generator service's own user (mlscope.agentauth)."""

from __future__ import annotations

import argparse
from pathlib import Path

from cli.flag_types import framework_name
from mlscope.agentauth import (
    add_agent,
    add_loadgen,
    agent_inbox_prefix,
    loadgen_inbox_prefix,
    reload_server,
)
from mlscope.auth import (
    DEFAULT_EDGE_DOMAIN,
    DEFAULT_HUB_DOMAIN,
    DEFAULT_MAX_PAYLOAD,
    INBOX_PREFIXES,
    REPLY_WINDOW_S,
    ROLES,
    token_problem,
)
from mlscope.auth_files import write_auth

__all__ = ["register", "subject_token"]


def subject_token(value: str) -> str:
    """An argparse type: one NATS subject token, refused (never rewritten) otherwise,
    because the value becomes part of permission subjects (see ``token_problem``)."""
    if problem := token_problem(value):
        raise argparse.ArgumentTypeError(problem)
    return value


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    auth = sub.add_parser("auth", help="NATS users and permissions per role")
    cmds = auth.add_subparsers(dest="auth_command", required=True, metavar="ACTION")
    init = cmds.add_parser("init", help="write server.conf and one .creds file per role")
    init.add_argument("--out", type=Path, required=True)
    init.add_argument(
        "--edge-id", default="edge-1", help="agent id the edge credentials are restricted to"
    )
    init.add_argument(
        "--edge-domain",
        type=subject_token,
        default=DEFAULT_EDGE_DOMAIN,
        help="JetStream domain of the edge leaf node (`mlscope edge init "
        "--domain`), whose span buffer the hub sources",
    )
    init.add_argument(
        "--hub-domain",
        type=subject_token,
        default=DEFAULT_HUB_DOMAIN,
        help="JetStream domain of the hub (`mlscope edge init --hub-domain`)",
    )
    init.add_argument(
        "--max-payload",
        type=int,
        default=DEFAULT_MAX_PAYLOAD,
        help="largest message in bytes the server accepts",
    )
    init.add_argument(
        "--reply-window",
        type=float,
        default=REPLY_WINDOW_S,
        metavar="SECONDS",
        help="how long a responder (agent, load generator, server) may answer a request "
        "after it was delivered; a local run's server renews it while the run lasts",
    )
    init.add_argument("--tls-cert", type=Path, default=None)
    init.add_argument("--tls-key", type=Path, default=None)
    init.add_argument("--tls-ca", type=Path, default=None)
    init.add_argument(
        "--force",
        action="store_true",
        help="replace an existing server.conf/roles.json: every role gets a new key, and "
        "the agents and load generators `auth add-agent` / `add-loadgen` added are dropped",
    )
    init.set_defaults(func=run_init)
    add = cmds.add_parser(
        "add-agent",
        help="issue one agent its own credentials, bound to its own subjects and registry key",
    )
    add.add_argument("name", help="the agent id (run it with `mlscope agent --agent-id NAME`)")
    add.add_argument("--out", type=Path, required=True, help="the `auth init` directory")
    add.add_argument(
        "--framework",
        action="append",
        type=framework_name,
        default=[],
        help="capability subjects it may serve (repeatable; default: all)",
    )
    _reload_flag(add)
    add.set_defaults(func=run_add_agent)
    lg = cmds.add_parser(
        "add-loadgen",
        help="issue one load-generator service its own credentials, bound to its own "
        "subjects and registry key",
    )
    lg.add_argument("name", help="the service id (run it with `mlscope loadgen --id NAME`)")
    lg.add_argument("--out", type=Path, required=True, help="the `auth init` directory")
    _reload_flag(lg)
    lg.set_defaults(func=run_add_loadgen)


def _reload_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--reload",
        type=int,
        default=None,
        metavar="PID",
        help="make the running nats-server PID reload its configuration "
        "(as `nats-server --signal reload=PID`)",
    )


def run_init(args: argparse.Namespace) -> int:
    files = write_auth(
        args.out,
        edge_id=args.edge_id,
        edge_domain=args.edge_domain,
        hub_domain=args.hub_domain,
        max_payload=args.max_payload,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        reply_window_s=args.reply_window,
        force=args.force,
    )
    print(f"wrote {files.config}")
    for role in ROLES:
        print(f"  {role:<9} {files.creds[role]}  (replies under {INBOX_PREFIXES[role]}.)")
    print(
        f"run: mlscope up --auth {files.directory}   "
        f"(clients: MLSCOPE_NATS_CREDS={files.creds['submitter']})"
    )
    return 0


def run_add_agent(args: argparse.Namespace) -> int:
    creds = add_agent(args.out, args.name, frameworks=args.framework)
    print(f"wrote {creds}  (replies under {agent_inbox_prefix(args.name)}.)")
    _reload(args)
    # One agent runs one framework: the one it was confined to, else the user's choice.
    fw = args.framework[0] if len(args.framework) == 1 else "F"
    print(f"run: MLSCOPE_NATS_CREDS={creds} mlscope agent --agent-id {args.name} --framework {fw}")
    return 0


def run_add_loadgen(args: argparse.Namespace) -> int:
    creds = add_loadgen(args.out, args.name)
    print(f"wrote {creds}  (replies under {loadgen_inbox_prefix(args.name)}.)")
    _reload(args)
    print(f"run: MLSCOPE_NATS_CREDS={creds} mlscope loadgen --id {args.name}")
    return 0


def _reload(args: argparse.Namespace) -> None:
    if args.reload is not None:
        reload_server(args.reload)
        print(f"nats-server {args.reload} reloads {args.out / 'server.conf'}")
    else:
        print("reload the server's configuration: nats-server --signal reload=PID")
