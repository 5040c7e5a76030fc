"""Least-privilege NATS users per role: who may publish and subscribe where.

``mlscope auth init --out DIR`` (:mod:`mlscope.auth_files`) writes ``DIR/server.conf``
(one account with JetStream, one nkey user per role with the permissions below, a
maximum payload, optional TLS) and one nkey seed file per role (``submitter.creds``,
``server.creds``, ``agent.creds``, ``edge.creds``, ``reader.creds``), each readable by
its owner only from the moment it exists. A directory that already holds a config is
refused without ``--force``: new keys would lock out every client, and every agent
``auth add-agent`` added. nats-py reads a seed file with ``nkeys_seed``;
:func:`mlscope.bus.connect_options` picks that (or a JWT ``.creds`` file) from
``MLSCOPE_NATS_CREDS``; ``loadgen.creds`` too, for ``mlscope loadgen`` services.

What each role may do (everything else is denied by the server):

* server: the whole ``mlscope.>`` namespace, the JetStream API and every bucket.
* submitter: publish (and cancel) jobs, ask the server's database responders, read the registry
  buckets, hear its jobs' events.
* agent: serve its capability and agent subjects, answer requests,
  publish span batches, write registry keys, read stream information. This user may
  act as any agent id; ``mlscope auth add-agent NAME`` (:mod:`mlscope.agentauth`)
  issues one bound to NAME's own subjects and key instead.
* edge: like an agent, but only its own agent subjects and its own registry key,
  and no path to submit jobs or read results.
* reader (dashboard): read the registry buckets, ask the database responders (read-
  only SQL), hear job events; it cannot publish jobs, spans, queries or keys.
* loadgen (``mlscope loadgen`` services): serve the load-generator control and run
  subjects, send queries to agents (their own and capability subjects), report progress
  on its progress subject, keep its registry key, and read and write the work object
  store (dealt slices in, results out); it cannot submit jobs, read results or spans,
  or write agents' keys.

Replies. Every role has its own inbox prefix (:data:`INBOX_PREFIXES`): a client's
replies (request/reply, JetStream API and KV answers, pull and push deliveries) arrive
under it, and only that role may subscribe there, so no role reads another's replies.
The server keeps NATS's default ``_INBOX`` (its load generator names its reply subjects
under it); the others get ``_INBOX_<role>``. ``roles.json`` beside the seeds records
each role's public key and prefix, where
:func:`mlscope.auth_files.inbox_prefix_for` finds a seed's prefix, and
``MLSCOPE_NATS_INBOX_PREFIX`` sets it explicitly (an edge agent behind its
leaf node, which connects without credentials). Nobody may publish into an inbox:
responders (server, agent, edge) answer through ``allow_responses``, which lets a
connection publish only to the reply subjects of messages delivered to it.
"""

from __future__ import annotations

import re
from typing import Any

from mlscope import names

__all__ = [
    "INBOX_PREFIXES",
    "ROLES",
    "SERVICE_SECTIONS",
    "Role",
    "permissions",
    "responses",
    "token_problem",
]

ROLES = ("submitter", "server", "agent", "edge", "reader", "loadgen")
Role = str
SERVICE_SECTIONS = {"agents": "agent", "loadgens": "loadgen"}
"""``roles.json`` sections of per-service users (``auth add-agent`` / ``add-loadgen``),
each with the role whose permissions its users narrow to their own id."""
ACCOUNT = "MLSCOPE"
DEFAULT_MAX_PAYLOAD = 8 << 20
"""8 MiB: a batch of full-size images in one query; JetStream streams keep their own
(smaller) per-message limits."""

INBOX_PREFIXES: dict[Role, str] = {
    role: "_INBOX" if role == "server" else f"_INBOX_{role}" for role in ROLES
}
"""Each role's inbox prefix (nats-py ``connect(inbox_prefix=...)``)."""
REPLY_WINDOW_S = 900
"""How long a responder may answer a request after receiving it (``allow_responses``
``expires``; nats-server's default is 2 minutes). It must outlive the longest request
a responder serves: an agent's prepare (``PREPARE_TIMEOUT_S``, 300 s)."""


def responses(window_s: float = REPLY_WINDOW_S) -> dict[str, Any]:
    """A responder's ``allow_responses``: any number of replies per delivered request
    (the load generator sends all of a run's queries with one reply subject, and each
    delivery renews the grant; the default ``max: 1`` refused all but one reply of
    queries that overlapped), for ``window_s`` after the delivery."""
    if not window_s > 0:
        raise ValueError(f"the reply window must be positive, not {window_s!r}")
    return {"max": -1, "expires": f"{window_s:g}s"}


EDGE_BUFFER_STREAM = "MLSCOPE_EDGE_TRACES"
"""= ``mlscope.provision.EDGE_TRACES_STREAM`` (the bus client imports this module)."""
DEFAULT_EDGE_DOMAIN = "edge1"
DEFAULT_HUB_DOMAIN = "hub"
P = names.PREFIX
_TOKEN = re.compile(r"[A-Za-z0-9_-]+")


def token_problem(value: str) -> str | None:
    """Why ``value`` cannot be one subject token, or None when it can.

    Domains go into permission subjects verbatim (``$JS.<domain>.API.>``): a ``*``
    there grants every domain's JetStream API, a ``>`` or a ``.`` makes a subject the
    server refuses or one that means something else. Such a value is refused, not
    rewritten, so that both sides of the link agree on the name the user typed.
    """
    if _TOKEN.fullmatch(value):
        return None
    return f"must be one subject token (letters, digits, '-', '_'), not {value!r}"


def _kv_read(bucket: str, *, stream: str | None = None) -> list[str]:
    """The JetStream API subjects that reading one bucket (get, keys, watch; an object
    store's metadata and chunks) uses."""
    stream = stream or f"KV_{bucket}"
    return [
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.STREAM.MSG.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.DELETE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _registry_read() -> list[str]:
    return ["$JS.API.INFO", *_kv_read(names.AGENTS_BUCKET), *_kv_read(names.MODELS_BUCKET)]


def permissions(
    role: Role,
    *,
    edge_id: str = "edge-1",
    edge_domain: str = DEFAULT_EDGE_DOMAIN,
    hub_domain: str = DEFAULT_HUB_DOMAIN,
    reply_window_s: float = REPLY_WINDOW_S,
) -> dict[str, Any]:
    """The nats-server permissions block of one role."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
    jobs_events = f"{P}.job.*.events"
    db = f"{P}.db.>"
    inbox = f"{INBOX_PREFIXES[role]}.>"
    grant = responses(reply_window_s)
    if role == "server":
        subjects = [f"{P}.>", "$JS.>", "$KV.>", "$O.>"]  # $O: object-store chunks
        return {
            "publish": {"allow": subjects},
            "subscribe": {"allow": [*subjects, inbox]},
            "allow_responses": grant,
        }
    if role == "submitter":
        return {
            "publish": {
                "allow": [
                    names.JOBS_SUBJECT,
                    names.job_cancel_wildcard(),
                    db,
                    *_registry_read(),
                    f"$JS.API.STREAM.INFO.{names.JOBS_STREAM}",
                ]
            },
            "subscribe": {"allow": [inbox, jobs_events]},
        }
    if role == "reader":
        return {
            "publish": {"allow": [db, *_registry_read()]},
            "subscribe": {"allow": [inbox, jobs_events]},
        }
    if role == "agent":
        return _agent(inbox, grant)
    if role == "loadgen":
        return _loadgen(inbox, grant)
    edge = _edge(inbox, names.token(edge_id), edge_domain=edge_domain, hub_domain=hub_domain)
    return {**edge, "allow_responses": grant}


def _agent_publish(key: str, own: str = "*") -> list[str]:
    """What an agent publishes: spans, its registry key ``key``, the rows of its local
    runs (on agent ``own``'s subjects), and the JetStream API of the buckets it reads."""
    return [
        names.agent_traces(own),
        key,
        f"{P}.agent.{own}.rows.>",
        "$JS.API.INFO",
        "$JS.API.STREAM.NAMES",  # an object get finds its stream by subject
        "$JS.API.STREAM.INFO.*",
        *_kv_read(names.MODELS_BUCKET),
        *_kv_read(names.ARTIFACTS_BUCKET, stream=f"OBJ_{names.ARTIFACTS_BUCKET}"),
    ]


def _agent(inbox: str, grant: dict[str, Any]) -> dict[str, Any]:
    return {
        "publish": {
            "allow": _agent_publish(f"$KV.{names.AGENTS_BUCKET}.*"),
            "deny": [names.JOBS_SUBJECT, f"{P}.db.>"],
        },
        # Capability subjects only as a member of their queue group (the agent names
        # the group after the subject): a plain subscription would hear every query.
        "subscribe": {
            "allow": [
                inbox,
                f"{P}.cap.> {P}.cap.>",
                f"{P}.agent.*.query",
                f"{P}.agent.*.ctl",
                f"{P}.agent.*.samples",
            ]
        },
        "allow_responses": grant,
    }


def _loadgen(inbox: str, grant: dict[str, Any], own: str = "*") -> dict[str, Any]:
    """A load-generator service's user: any service id's subjects and registry key
    (``own`` ``*``), or service ``own``'s only (``mlscope auth add-loadgen``). The work
    object store stays shared: its objects are named after runs and its chunks after
    random ids, so no subject belongs to one service."""
    registry, work = f"KV_{names.LOADGENS_BUCKET}", f"OBJ_{names.LOADGEN_WORK_BUCKET}"
    return {
        "publish": {
            "allow": [
                f"{P}.agent.*.query",
                f"{P}.cap.>",
                f"{P}.loadgen.{own}.progress",
                f"$KV.{names.LOADGENS_BUCKET}.{own}",
                f"$O.{names.LOADGEN_WORK_BUCKET}.>",
                "$JS.API.INFO",
                "$JS.API.STREAM.NAMES",  # an object get finds its stream by subject
                *_kv_read(names.LOADGENS_BUCKET),
                *_kv_read(names.LOADGEN_WORK_BUCKET, stream=work),
                # The first service creates both when missing; a replaced result's old
                # chunks are purged (object-store put).
                f"$JS.API.STREAM.CREATE.{registry}",
                f"$JS.API.STREAM.CREATE.{work}",
                f"$JS.API.STREAM.PURGE.{work}",
            ],
            "deny": [names.JOBS_SUBJECT, f"{P}.db.>"],
        },
        "subscribe": {"allow": [inbox, f"{P}.loadgen.{own}.ctl", f"{P}.loadgen.{own}.run"]},
        "allow_responses": grant,
    }


def _edge(inbox: str, own: str, *, edge_domain: str, hub_domain: str) -> dict[str, Any]:
    """An agent restricted to its own id, usually behind its device's leaf node.

    Over a leaf link the leaf node filters what crosses by these lists itself, and it
    knows neither ``allow_responses`` (nats-server issue #2949) nor queue permissions.
    So the edge may publish into the server's inbox space ``_INBOX.>`` (its replies to
    the server's queries and control requests; it cannot subscribe there, so it learns
    only the reply subjects it was sent) and subscribes to capability subjects plainly.
    The hub sources the leaf's span buffer through the device's JetStream domain: API
    requests in (``$JS.<edge>.API.>``), answers to ``$JSC.R.>``, deliveries to
    ``$JS.S.>``, flow control back.
    """
    api = (f"$JS.{hub_domain}.API.", "$JS.API.")
    own_key = f"{names.AGENTS_BUCKET}.{own}"
    publish = _agent_publish(f"$KV.{own_key}", own)
    publish += [s.replace(api[1], api[0], 1) for s in publish if s.startswith(api[1])]
    return {
        "publish": {
            "allow": [
                *publish,
                f"{api[0]}$KV.{own_key}",
                f"{INBOX_PREFIXES['server']}.>",
                "$JSC.R.>",
                "$JS.S.>",
            ],
            "deny": [names.JOBS_SUBJECT, f"{P}.db.>"],
        },
        "subscribe": {
            "allow": [
                inbox,
                f"{P}.cap.>",
                f"{P}.agent.{own}.query",
                f"{P}.agent.{own}.ctl",
                f"{P}.agent.{own}.samples",
                f"$JS.{edge_domain}.API.>",
                f"$JS.FC.{EDGE_BUFFER_STREAM}.>",
            ]
        },
    }
