"""The files of an auth directory: what ``mlscope auth init`` writes and who reads them.

:func:`write_auth` creates one nkey user per role (:data:`mlscope.auth.ROLES`) with the
permissions of :func:`mlscope.auth.permissions`, and writes the server configuration,
one private seed file per role and ``roles.json`` (each role's public key, inbox prefix
and reply window). :func:`read_roles` reads ``roles.json`` back, refusing a damaged one;
:func:`inbox_prefix_for` finds a seed's inbox prefix there.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys

from mlscope.auth import (
    ACCOUNT,
    DEFAULT_EDGE_DOMAIN,
    DEFAULT_HUB_DOMAIN,
    DEFAULT_MAX_PAYLOAD,
    INBOX_PREFIXES,
    REPLY_WINDOW_S,
    ROLES,
    SERVICE_SECTIONS,
    Role,
    permissions,
    token_problem,
)
from mlscope.errors import ConfigError
from mlscope.regular_files import read_regular
from mlscope.secrets_io import write_atomic, write_secret

__all__ = ["SEED_MAX_BYTES", "AuthFiles", "inbox_prefix_for", "read_roles", "write_auth"]

SEED_MAX_BYTES = 4096
"""Largest seed file read for its public key: an nkey seed is 58 characters, and a
FIFO or device named as one is refused rather than waited on or read without end."""


@dataclass(frozen=True)
class AuthFiles:
    """What ``write_auth`` wrote."""

    directory: Path
    config: Path
    creds: dict[Role, Path]
    public_keys: dict[Role, str]


def write_auth(
    out: Path,
    *,
    edge_id: str = "edge-1",
    edge_domain: str = DEFAULT_EDGE_DOMAIN,
    hub_domain: str = DEFAULT_HUB_DOMAIN,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    tls_ca: Path | None = None,
    reply_window_s: float = REPLY_WINDOW_S,
    force: bool = False,
) -> AuthFiles:
    """Create one nkey user per role and write the server config and seed files.

    The config is JSON (a subset of the nats-server format) so that it can be included
    from a cluster or leaf config with ``include``. Seeds are created private (0600)
    and replace any file or link at their names. A directory that already holds a
    config is refused unless ``force``: new keys for every role would lock out every
    client and every agent added since, at the server's next reload.
    """
    for what, value in (("edge domain", edge_domain), ("hub domain", hub_domain)):
        if problem := token_problem(value):
            raise ConfigError(f"the {what} {problem}", field=what.replace(" ", "_"))
    _refuse_existing(out, force=force)
    out.mkdir(parents=True, exist_ok=True)
    users, creds, public = [], {}, {}
    for role in ROLES:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
        public[role] = nkeys.from_seed(bytearray(seed)).public_key.decode()
        creds[role] = out / f"{role}.creds"
        write_secret(creds[role], seed + b"\n")
        perms = permissions(
            role,
            edge_id=edge_id,
            edge_domain=edge_domain,
            hub_domain=hub_domain,
            reply_window_s=reply_window_s,
        )
        users.append({"nkey": public[role], "permissions": perms})
    conf: dict[str, Any] = {
        "max_payload": max_payload,
        "accounts": {ACCOUNT: {"jetstream": "enabled", "users": users}},
    }
    if tls_cert and tls_key:
        conf["tls"] = _tls(tls_cert, tls_key, tls_ca)
    config = out / "server.conf"
    roles = "\n".join(f"#   {r:<9} {public[r]}" for r in ROLES)
    header = f"# Written by `mlscope auth init`: one nkey user per role.\n{roles}\n"
    write_atomic(config, header + json.dumps(conf, indent=2) + "\n")
    record = {
        "edge_id": edge_id,
        "edge_domain": edge_domain,
        "hub_domain": hub_domain,
        "public_keys": public,
        "inbox_prefixes": INBOX_PREFIXES,
        "reply_window_s": reply_window_s,
    }
    write_atomic(out / "roles.json", json.dumps(record, indent=2) + "\n")
    return AuthFiles(out, config, creds, public)


def _refuse_existing(out: Path, *, force: bool) -> None:
    found = [name for name in ("server.conf", "roles.json") if os.path.lexists(out / name)]
    if found and not force:
        raise ConfigError(
            f"{out} already holds {' and '.join(found)}: --force issues every role a new "
            "key (clients and agents added since lose access)",
            field="out",
        )


def _tls(cert: Path, key: Path, ca: Path | None) -> dict[str, Any]:
    tls: dict[str, Any] = {"cert_file": str(cert), "key_file": str(key)}
    if ca:
        tls["ca_file"] = str(ca)
    return tls


def read_roles(directory: Path) -> dict[str, Any]:
    """``roles.json`` of an auth directory (empty when there is none).

    A damaged one is a ConfigError that names it: it decides inbox prefixes and reply
    windows, and a guess would surface later as a refused subscription far from here.
    """
    path = directory / "roles.json"
    if not path.exists():
        return {}
    if not path.is_file():
        raise ConfigError(f"{path} is not a regular file", field="roles.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", field="roles.json") from exc
    if problem := _roles_problem(data):
        raise ConfigError(
            f"{path} is damaged: {problem} (`mlscope auth init --force` rewrites it)",
            field="roles.json",
        )
    return dict(data)


def _roles_problem(data: object) -> str | None:
    """What makes ``data`` not a ``roles.json`` as :func:`write_auth` and
    ``add_agent`` / ``add_loadgen`` write it, or None."""
    if not isinstance(data, dict):
        return "not a JSON object"
    for key in ("edge_id", "edge_domain", "hub_domain"):
        if key in data and not isinstance(data[key], str):
            return f'"{key}" is not a string'
    for key in ("public_keys", "inbox_prefixes"):
        value = data.get(key, {})
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            return f'"{key}" is not an object of strings'
    for section in SERVICE_SECTIONS:
        users = data.get(section, {})
        if not isinstance(users, dict) or not all(
            isinstance(a, dict) and isinstance(a.get("public_key"), str) for a in users.values()
        ):
            return f'"{section}" is not an object of {{"public_key": ...}} entries'
    window = data.get("reply_window_s", REPLY_WINDOW_S)
    if isinstance(window, bool) or not isinstance(window, int | float):
        return '"reply_window_s" is not a number'
    if not 0 < window < math.inf:
        return '"reply_window_s" is not a positive number of seconds'
    return None


def inbox_prefix_for(creds: Path) -> str | None:
    """The inbox prefix of the role whose nkey seed ``creds`` is, from ``roles.json``
    in the same directory; None when that file does not name this key (a JWT ``.creds``
    file, a seed from elsewhere: NATS's default prefix then applies). A damaged
    ``roles.json`` is a ConfigError (see :func:`read_roles`)."""
    roles = read_roles(creds.parent)
    if not roles:
        return None
    try:
        public = nkeys.from_seed(
            bytearray(read_regular(creds, SEED_MAX_BYTES).strip())
        ).public_key.decode()
    except (OSError, ValueError, nkeys.NkeysError):
        return None
    for role, key in roles.get("public_keys", {}).items():
        if key == public:
            prefix = roles.get("inbox_prefixes", {}).get(role)
            return str(prefix) if prefix else None
    for section in SERVICE_SECTIONS:  # users of `auth add-agent` / `add-loadgen`
        for entry in roles.get(section, {}).values():
            if entry["public_key"] == public:
                prefix = entry.get("inbox_prefix")
                return str(prefix) if prefix else None
    return None
