"""``mlscope auth init --out DIR``: least-privilege users per role (see mlscope.auth)."""

from __future__ import annotations

import argparse
from pathlib import Path

from mlscope.auth import (
    DEFAULT_EDGE_DOMAIN,
    DEFAULT_HUB_DOMAIN,
    DEFAULT_MAX_PAYLOAD,
    INBOX_PREFIXES,
    ROLES,
    write_auth,
)

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    auth = sub.add_parser("auth", help="NATS users and permissions per role")
    cmds = auth.add_subparsers(dest="auth_command", required=True, metavar="ACTION")
    init = cmds.add_parser("init", help="write server.conf and one .creds file per role")
    init.add_argument("--out", type=Path, required=True)
    init.add_argument("--edge-id", default="edge-1",
                      help="agent id the edge credentials are restricted to")
    init.add_argument("--edge-domain", default=DEFAULT_EDGE_DOMAIN,
                      help="JetStream domain of the edge leaf node (`mlscope edge init "
                           "--domain`), whose span buffer the hub sources")
    init.add_argument("--hub-domain", default=DEFAULT_HUB_DOMAIN,
                      help="JetStream domain of the hub (`mlscope edge init --hub-domain`)")
    init.add_argument("--max-payload", type=int, default=DEFAULT_MAX_PAYLOAD,
                      help="largest message in bytes the server accepts")
    init.add_argument("--tls-cert", type=Path, default=None)
    init.add_argument("--tls-key", type=Path, default=None)
    init.add_argument("--tls-ca", type=Path, default=None)
    init.set_defaults(func=run_init)


def run_init(args: argparse.Namespace) -> int:
    files = write_auth(args.out, edge_id=args.edge_id, edge_domain=args.edge_domain,
                       hub_domain=args.hub_domain, max_payload=args.max_payload,
                       tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca)
    print(f"wrote {files.config}")
    for role in ROLES:
        print(f"  {role:<9} {files.creds[role]}  (replies under {INBOX_PREFIXES[role]}.)")
    print(f"run: mlscope up --auth {files.directory}   "
          f"(clients: MLSCOPE_NATS_CREDS={files.creds['submitter']})")
    return 0
