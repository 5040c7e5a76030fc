"""Per-service identities: one nkey user per agent or load-generator service, bound
to that service's own subjects.

The role-wide ``agent`` user of ``mlscope auth init`` may serve any agent id: a process
holding it could subscribe to another agent's query subject and answer first (its
replies land in the load generator's inbox and are taken as the victim's). An agent
user made by ``mlscope auth add-agent NAME`` may instead

* subscribe only to ``mlscope.agent.NAME.query`` / ``.ctl``, to its own inbox prefix
  ``_INBOX_agent_NAME`` and to capability subjects *as their queue group* (only its
  frameworks' ``mlscope.cap.<fw>.>`` when ``--framework`` is given);
* write only its own registry key ``$KV.mlscope_agents.NAME``;
* answer only what was delivered to it (``allow_responses``).

So the server's check that a reply came from the agent it addressed is made by the
broker itself: a query goes to ``mlscope.agent.NAME.query``, which only NAME's user
may hear, with a reply subject unique to the run, which only a connection that was
delivered a message carrying it may publish to. Capability subjects carry inputs,
not results: a member of a queue group answers only the requests it was handed.

Likewise the role-wide ``loadgen`` user may serve, report progress for and register
any load-generator id; a user made by ``mlscope auth add-loadgen NAME`` hears only
``mlscope.loadgen.NAME.ctl`` / ``.run`` and its inbox prefix ``_INBOX_loadgen_NAME``,
and publishes only ``mlscope.loadgen.NAME.progress`` and the registry key
``$KV.mlscope_loadgens.NAME``; ``mlscope loadgen`` refuses to run with it under
another id (:func:`bound_id`). The work object store ``mlscope_loadgen_work`` stays
shared by every load-generator user: its objects are named after runs
(``<run>/result-<j>``) and their chunks after random ids, so no subject names the
service a slice was dealt to; a service checks each slice it reads
(:func:`broker.lgwork.unpack_slice`).

Users are added to the ``server.conf`` that ``auth init`` wrote (its JSON body) and to
``roles.json`` (public key, inbox prefix; an agent's frameworks), and take effect when
the running nats-server reloads its configuration (:func:`reload_server`, the same as
``nats-server --signal reload``); adding a name again replaces its key.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import nkeys

from mlscope import names
from mlscope.auth import (
    ACCOUNT,
    INBOX_PREFIXES,
    REPLY_WINDOW_S,
    SERVICE_SECTIONS,
    Role,
    _agent_publish,
    _loadgen,
    responses,
)
from mlscope.auth_files import SEED_MAX_BYTES, read_roles
from mlscope.errors import ConfigError
from mlscope.regular_files import read_regular
from mlscope.secrets_io import write_atomic, write_secret

__all__ = [
    "add_agent",
    "add_loadgen",
    "agent_creds",
    "agent_inbox_prefix",
    "agent_permissions",
    "bound_id",
    "loadgen_creds",
    "loadgen_inbox_prefix",
    "loadgen_permissions",
    "own_inbox_prefix",
    "reload_server",
    "service_creds",
]

P = names.PREFIX


def own_inbox_prefix(role: Role, service_id: str) -> str:
    """The inbox prefix of ``service_id``'s own ``role`` user: ``_INBOX_<role>_<id>``."""
    return f"{INBOX_PREFIXES[role]}_{names.token(service_id)}"


def service_creds(directory: Path, role: Role, service_id: str) -> Path:
    """Where ``service_id``'s own ``role`` user's seed is written: ``<role>-<id>.creds``."""
    return directory / f"{role}-{names.token(service_id)}.creds"


def agent_inbox_prefix(agent_id: str) -> str:
    return own_inbox_prefix("agent", agent_id)


def agent_creds(directory: Path, agent_id: str) -> Path:
    """Where ``add_agent`` writes the seed of ``agent_id``."""
    return service_creds(directory, "agent", agent_id)


def loadgen_inbox_prefix(loadgen_id: str) -> str:
    return own_inbox_prefix("loadgen", loadgen_id)


def loadgen_creds(directory: Path, loadgen_id: str) -> Path:
    """Where ``add_loadgen`` writes the seed of ``loadgen_id``."""
    return service_creds(directory, "loadgen", loadgen_id)


def loadgen_permissions(
    loadgen_id: str, *, reply_window_s: float = REPLY_WINDOW_S
) -> dict[str, Any]:
    """The nats-server permissions of one load-generator service's own user."""
    own = names.token(loadgen_id)
    return _loadgen(f"{loadgen_inbox_prefix(own)}.>", responses(reply_window_s), own)


def agent_permissions(
    agent_id: str, *, frameworks: Sequence[str] = (), reply_window_s: float = REPLY_WINDOW_S
) -> dict[str, Any]:
    """The nats-server permissions of one agent's own user."""
    own = names.token(agent_id)
    caps = [f"{P}.cap.{names.token(fw)}.>" for fw in frameworks] or [f"{P}.cap.>"]
    return {
        "publish": {
            "allow": _agent_publish(f"$KV.{names.AGENTS_BUCKET}.{own}", own),
            "deny": [names.JOBS_SUBJECT, f"{P}.db.>"],
        },
        "subscribe": {
            "allow": [
                f"{agent_inbox_prefix(own)}.>",
                *(f"{c} {c}" for c in caps),  # only as its queue group
                names.agent_query(own),
                names.agent_ctl(own),
                names.agent_samples(own),
            ]
        },
        "allow_responses": responses(reply_window_s),
    }


def add_agent(directory: Path, agent_id: str, *, frameworks: Sequence[str] = ()) -> Path:
    """Issue (or re-issue) ``agent_id``'s nkey user; returns its seed file."""
    return _add_user(
        directory,
        "agent",
        agent_id,
        lambda window: agent_permissions(agent_id, frameworks=frameworks, reply_window_s=window),
        {"frameworks": list(frameworks)},
    )


def add_loadgen(directory: Path, loadgen_id: str) -> Path:
    """Issue (or re-issue) load-generator service ``loadgen_id``'s nkey user; returns
    its seed file."""
    return _add_user(
        directory,
        "loadgen",
        loadgen_id,
        lambda window: loadgen_permissions(loadgen_id, reply_window_s=window),
        {},
    )


def bound_id(creds: Path, role: Role) -> str | None:
    """The id whose own ``role`` user (``auth add-agent`` / ``add-loadgen``) the seed
    ``creds`` is, from ``roles.json`` beside it; None for any other credentials (a
    role-wide user, a JWT ``.creds`` file). A damaged ``roles.json`` is a ConfigError."""
    roles = read_roles(creds.parent)
    users = roles.get(_section(role), {})
    if not users:
        return None
    try:
        public = nkeys.from_seed(
            bytearray(read_regular(creds, SEED_MAX_BYTES).strip())
        ).public_key.decode()
    except (OSError, ValueError, nkeys.NkeysError):
        return None
    return next((name for name, u in users.items() if u["public_key"] == public), None)


def _section(role: Role) -> str:
    return next(s for s, r in SERVICE_SECTIONS.items() if r == role)


def _add_user(
    directory: Path,
    role: Role,
    service_id: str,
    permissions: Callable[[float], dict[str, Any]],
    entry: dict[str, Any],
) -> Path:
    """Add ``role`` user of ``service_id`` with ``permissions(reply window)`` to
    ``server.conf`` and ``roles.json`` (``entry`` besides its key and inbox prefix),
    replacing an earlier key of that id; returns its seed file."""
    if names.token(service_id) != service_id or not service_id:
        raise ConfigError(
            f"{role} id {service_id!r} must be one subject token (no '.', '*', '>' or spaces)",
            field=f"{role}_id",
        )
    config = directory / "server.conf"
    roles = read_roles(directory)
    if not config.is_file() or not roles:
        raise ConfigError(
            f"{directory} has no server.conf/roles.json: run `mlscope auth "
            f"init --out {directory}` first",
            field="directory",
        )
    header, conf = _read_conf(config)
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    issued: dict[str, Any] = roles.setdefault(_section(role), {})
    old = issued.get(service_id, {}).get("public_key")
    users = [u for u in conf["accounts"][ACCOUNT]["users"] if u.get("nkey") != old]
    window = float(roles.get("reply_window_s", REPLY_WINDOW_S))  # as `auth init` chose
    users.append({"nkey": public, "permissions": permissions(window)})
    conf["accounts"][ACCOUNT]["users"] = users
    issued[service_id] = {
        "public_key": public,
        "inbox_prefix": own_inbox_prefix(role, service_id),
        **entry,
    }
    path = service_creds(directory, role, service_id)
    write_secret(path, seed + b"\n")
    write_atomic(config, header + json.dumps(conf, indent=2) + "\n")
    write_atomic(directory / "roles.json", json.dumps(roles, indent=2) + "\n")
    return path


def _read_conf(config: Path) -> tuple[str, dict[str, Any]]:
    """(comment header, JSON body) of a ``server.conf`` written by ``auth init``."""
    text = config.read_text()
    lines = text.splitlines(keepends=True)
    header = "".join(line for line in lines if line.startswith("#"))
    try:
        conf = json.loads("".join(line for line in lines if not line.startswith("#")))
        users = conf["accounts"][ACCOUNT]["users"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{config} is not a config `mlscope auth init` wrote: {exc}", field="server.conf"
        ) from exc
    if not isinstance(users, list) or not all(isinstance(u, dict) for u in users):
        raise ConfigError(
            f"{config} is not a config `mlscope auth init` wrote: its users are not a list "
            "of objects",
            field="server.conf",
        )
    return header, conf


def reload_server(pid: int) -> None:
    """Make the nats-server ``pid`` re-read its configuration (SIGHUP: what
    ``nats-server --signal reload=PID`` sends)."""
    try:
        os.kill(pid, signal.SIGHUP)
    except OSError as exc:
        raise ConfigError(f"cannot signal nats-server {pid}: {exc}", field="pid") from exc
