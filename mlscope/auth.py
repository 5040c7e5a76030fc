"""Least-privilege NATS users per role, as nkeys, and the server configuration for them.

``mlscope auth init --out DIR`` writes ``DIR/server.conf`` (one account with JetStream,
one nkey user per role with its permissions, a maximum payload, optional TLS) and one
nkey seed file per role (``submitter.creds``, ``server.creds``, ``agent.creds``,
``edge.creds``, ``reader.creds``). nats-py reads a seed file with ``nkeys_seed``;
:func:`mlscope.bus.connect_options` picks that (or a JWT ``.creds`` file) from
``MLSCOPE_NATS_CREDS``.

What each role may do (everything else is denied by the server):

* server: the whole ``mlscope.>`` namespace, the JetStream API and every bucket.
* submitter: publish jobs, ask the server's database responders, read the registry
  buckets, hear its jobs' events.
* agent: serve its capability and agent subjects, answer requests (inboxes),
  publish span batches, write registry keys, read stream information.
* edge: like an agent, but only its own agent subjects and its own registry key,
  and no path to submit jobs or read results.
* reader (dashboard): read the registry buckets, ask the database responders (read-
  only SQL), hear job events; it cannot publish jobs, spans, queries or keys.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys

from mlscope import names

__all__ = ["ROLES", "AuthFiles", "Role", "permissions", "write_auth"]

ROLES = ("submitter", "server", "agent", "edge", "reader")
Role = str
ACCOUNT = "MLSCOPE"
DEFAULT_MAX_PAYLOAD = 8 << 20
"""8 MiB: a batch of full-size images in one query; JetStream streams keep their own
(smaller) per-message limits."""

INBOX = "_INBOX.>"
P = names.PREFIX


def _kv_read(bucket: str) -> list[str]:
    """The JetStream API subjects that reading one bucket (get, keys, watch) uses."""
    stream = f"KV_{bucket}"
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>",
            f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.DELETE.{stream}.>", f"$JS.API.CONSUMER.INFO.{stream}.>",
            f"$JS.FC.{stream}.>"]


def _registry_read() -> list[str]:
    return ["$JS.API.INFO", *_kv_read(names.AGENTS_BUCKET), *_kv_read(names.MODELS_BUCKET)]


def permissions(role: Role, *, edge_id: str = "edge-1") -> dict[str, Any]:
    """The nats-server permissions block of one role."""
    jobs_events = f"{P}.job.*.events"
    db = f"{P}.db.>"
    if role == "server":
        subjects = [f"{P}.>", "$JS.>", "$KV.>", INBOX]
        return {"publish": {"allow": subjects}, "subscribe": {"allow": subjects}}
    if role == "submitter":
        return {"publish": {"allow": [names.JOBS_SUBJECT, db, *_registry_read(),
                                      f"$JS.API.STREAM.INFO.{names.JOBS_STREAM}"]},
                "subscribe": {"allow": [INBOX, jobs_events]}}
    if role == "reader":
        return {"publish": {"allow": [db, *_registry_read()]},
                "subscribe": {"allow": [INBOX, jobs_events]}}
    if role in ("agent", "edge"):
        own = names.token(edge_id)
        agent_subjects = [f"{P}.agent.*.query", f"{P}.agent.*.ctl"] if role == "agent" \
            else [f"{P}.agent.{own}.query", f"{P}.agent.{own}.ctl"]
        key = f"$KV.{names.AGENTS_BUCKET}.*" if role == "agent" \
            else f"$KV.{names.AGENTS_BUCKET}.{own}"
        return {
            # Replies go to the requesters' inboxes. (allow_responses alone lost
            # replies under load: the server's response-permission tracking is bounded.)
            "publish": {"allow": [INBOX, names.traces_wildcard(), key, "$JS.API.INFO",
                                  "$JS.API.STREAM.INFO.*", *_kv_read(names.MODELS_BUCKET)],
                        "deny": [names.JOBS_SUBJECT, db]},
            "subscribe": {"allow": [INBOX, f"{P}.cap.>", *agent_subjects]},
        }
    raise ValueError(f"unknown role {role!r} (one of {', '.join(ROLES)})")


@dataclass(frozen=True)
class AuthFiles:
    """What ``write_auth`` wrote."""

    directory: Path
    config: Path
    creds: dict[Role, Path]
    public_keys: dict[Role, str]


def write_auth(out: Path, *, edge_id: str = "edge-1", max_payload: int = DEFAULT_MAX_PAYLOAD,
               tls_cert: Path | None = None, tls_key: Path | None = None,
               tls_ca: Path | None = None) -> AuthFiles:
    """Create one nkey user per role and write the server config and seed files.

    The config is JSON (a subset of the nats-server format) so that it can be included
    from a cluster or leaf config with ``include``.
    """
    out.mkdir(parents=True, exist_ok=True)
    users, creds, public = [], {}, {}
    for role in ROLES:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        kp = nkeys.from_seed(bytearray(seed))
        public[role] = kp.public_key.decode()
        path = out / f"{role}.creds"
        path.write_bytes(seed + b"\n")
        path.chmod(0o600)
        creds[role] = path
        users.append({"nkey": public[role],
                      "permissions": permissions(role, edge_id=edge_id)})
    conf: dict[str, Any] = {
        "max_payload": max_payload,
        "accounts": {ACCOUNT: {"jetstream": "enabled", "users": users}},
    }
    if tls_cert and tls_key:
        tls: dict[str, Any] = {"cert_file": str(tls_cert), "key_file": str(tls_key)}
        if tls_ca:
            tls["ca_file"] = str(tls_ca)
        conf["tls"] = tls
    config = out / "server.conf"
    roles = "\n".join(f"#   {r:<9} {public[r]}" for r in ROLES)
    config.write_text(f"# Written by `mlscope auth init`: one nkey user per role.\n{roles}\n"
                      + json.dumps(conf, indent=2) + "\n")
    (out / "roles.json").write_text(json.dumps({"edge_id": edge_id, "public_keys": public},
                                               indent=2) + "\n")
    return AuthFiles(out, config, creds, public)
