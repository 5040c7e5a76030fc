"""The NATS boundary: connecting, typed requests, reading and publishing.

nats-py's exceptions become mlscope's here and nowhere else (:class:`BusError`, and
its :class:`BusNotFound`, :class:`BusRefused` and :class:`BusDenied`). A module that
drives JetStream, a bucket or the object store itself wraps the calls in
:func:`bus_errors`, reads an entry that may be missing with :func:`if_found` and a
subscription with :func:`next_msg`; it catches mlscope's errors only. What the stack
keeps on JetStream (streams, buckets, object stores) is made by
:mod:`mlscope.provision`, inside :func:`bus_errors`.
"""

from __future__ import annotations

import logging
import re
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any, TypeVar
from urllib.parse import ParseResult

import anyio
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.kv import KeyValue
from nats.protocol.parser import PERMISSIONS_ERR
from pydantic import BaseModel

from mlscope import codec, names
from mlscope.auth_files import inbox_prefix_for
from mlscope.errors import (
    BusDenied,
    BusError,
    BusNotFound,
    BusRefused,
    ConfigError,
    MLScopeError,
    error_from_wire,
)
from mlscope.logbudget import LogBudget
from mlscope.regular_files import read_text
from mlscope.settings import Settings

__all__ = [
    "HEARTBEAT_S",
    "PAYLOAD_HEADROOM",
    "Bus",
    "answerable",
    "bus_errors",
    "connect",
    "connect_options",
    "error_reply",
    "fetch_one",
    "if_found",
    "next_msg",
    "publish_persistent",
    "request",
    "request_model",
]

log = logging.getLogger("mlscope.bus")

HEARTBEAT_S = 1.0
"""How often an agent refreshes its registry entry (which expires
:data:`mlscope.provision.AGENT_TTL_S` after the last)."""
PAYLOAD_HEADROOM = 1024
"""Bytes of a message left for its subject, reply inbox and headers."""
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class Bus:
    """A connected client with its JetStream context and the registry buckets."""

    def __init__(
        self,
        nc: Client,
        js: JetStreamContext,
        domain: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.nc = nc
        self.js = js
        self.domain = domain
        self.options = options or {}
        """The options it connected with (:func:`connect_options`): credentials, TLS."""
        self._kv: dict[str, KeyValue] = {}

    def payload_budget(self) -> int:
        """The most bytes one message body may take on this connection: the server's
        max payload less :data:`PAYLOAD_HEADROOM`."""
        return int(self.nc.max_payload) - PAYLOAD_HEADROOM

    def server_url(self) -> ParseResult:
        """The URL of the server the client is connected to now."""
        url = self.nc.connected_url
        if url is None:
            raise BusError("not connected to a NATS server")
        return url

    async def kv(self, bucket: str) -> KeyValue:
        if bucket not in self._kv:
            try:
                kv = await self.js.key_value(bucket)
            except nats.js.errors.BucketNotFoundError as exc:
                raise BusNotFound(
                    f"bucket {bucket} does not exist; is an mlscope server up?", bucket=bucket
                ) from exc
            except (TimeoutError, nats.errors.Error) as exc:
                raise BusError(f"cannot open bucket {bucket}: {_said(exc)}", bucket=bucket) from exc
            if self.domain:
                # Behind a leaf node with its own JetStream, writes reach the hub's
                # bucket only through the domain's API prefix (nats-py has no option).
                kv = KeyValue(
                    name=bucket,
                    stream=f"KV_{bucket}",
                    pre=f"$JS.{self.domain}.API.$KV.{bucket}.",
                    js=self.js,
                    direct=False,
                )
            self._kv[bucket] = kv
        return self._kv[bucket]


_MAX_CREDS_BYTES = 64 << 10
"""Largest credentials file read: a JWT ``.creds`` file is a few kilobytes."""


def connect_options(settings: Settings) -> dict[str, Any]:
    """nats-py connection options for these settings: servers, credentials, TLS, inboxes.

    ``MLSCOPE_NATS_CREDS`` is either a JWT ``.creds`` file (``-----BEGIN NATS USER
    JWT-----`` then the seed) or an nkey seed file as ``mlscope auth init`` writes it.
    The inbox prefix is ``MLSCOPE_NATS_INBOX_PREFIX`` if set, else the one ``mlscope
    auth init`` recorded for that seed's role: each role may subscribe only under its
    own prefix, so a client with the default ``_INBOX`` would never hear its replies.
    """
    options: dict[str, Any] = {"servers": settings.nats_servers}
    prefix = settings.nats_inbox_prefix or (
        inbox_prefix_for(settings.nats_creds) if settings.nats_creds else None
    )
    if prefix:
        if not answerable(f"{prefix}.x"):
            raise ConfigError(
                f"inbox prefix {prefix!r}: replies never go to a subject of the stack "
                f"({names.PREFIX}.) or of nats-server's APIs ($...); use an _INBOX prefix",
                field="MLSCOPE_NATS_INBOX_PREFIX",
            )
        options["inbox_prefix"] = prefix
    if settings.nats_creds:
        try:  # a FIFO would block every service at start-up, /dev/zero fill its memory
            text = read_text(settings.nats_creds, _MAX_CREDS_BYTES)
        except OSError as exc:
            raise BusError(
                f"cannot read NATS credentials {settings.nats_creds}: {exc.strerror or exc}",
                path=str(settings.nats_creds),
            ) from exc
        if "BEGIN NATS USER JWT" in text:
            options["user_credentials"] = str(settings.nats_creds)
        else:
            options["nkeys_seed"] = str(settings.nats_creds)
    if settings.nats_tls_ca or settings.nats_tls_cert:
        try:
            ctx = ssl.create_default_context(
                cafile=str(settings.nats_tls_ca) if settings.nats_tls_ca else None
            )
            if settings.nats_tls_cert:
                ctx.load_cert_chain(
                    str(settings.nats_tls_cert),
                    str(settings.nats_tls_key) if settings.nats_tls_key else None,
                )
        except (OSError, ssl.SSLError) as exc:
            raise BusError(f"cannot load the NATS TLS files: {exc}") from exc
        options["tls"] = ctx
    return options


FIRST_CONNECT_ATTEMPTS = 3
"""Tries per server before the first connection counts as failed (about 1 s when
nothing listens): a command run with no bus says so at once instead of retrying."""


@asynccontextmanager
async def connect(
    settings: Settings, *, name: str, connect_timeout: float = 2.0
) -> AsyncIterator[Bus]:
    """Connect to NATS; drain on exit (a service then makes what is missing of the
    stack's streams and buckets: :func:`mlscope.provision.ensure_infrastructure`).

    ``nats_url`` may list several servers (a cluster); the client fails over between
    them. ``js_domain`` addresses the hub's JetStream from behind a leaf node.

    The first connection is bounded (:data:`FIRST_CONNECT_ATTEMPTS` per server, each
    within ``connect_timeout``): with no server the caller gets a BusError within
    seconds. Once connected, the client reconnects forever, which is what a
    long-running service wants through a bus outage. (nats-py applies its reconnect
    limit to the first connection too, so the limit is lifted only after it.)
    """
    options: dict[str, Any] = {
        **connect_options(settings),
        "name": name,
        "connect_timeout": connect_timeout,
        "max_reconnect_attempts": FIRST_CONNECT_ATTEMPTS,
        "reconnect_time_wait": 0.5,
        "allow_reconnect": True,
    }
    try:
        nc = _Client()
        await nc.connect(
            **options,
            error_cb=nc.on_error,
            disconnected_cb=_noop,
            reconnected_cb=_noop,
            closed_cb=_noop,
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        raise BusError(
            f"no NATS server at {settings.nats_url} (is `mlscope up` running?){_reason(exc)}",
            url=settings.nats_url,
        ) from exc
    nc.options["max_reconnect_attempts"] = -1
    try:
        js = nc.jetstream(domain=settings.js_domain) if settings.js_domain else nc.jetstream()
        yield Bus(nc, js, settings.js_domain, options)
    finally:
        # Shielded: a cancelled service must still flush what it published and close
        # the client, or nats-py's reader tasks outlive the event loop.
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(3), suppress(TimeoutError, nats.errors.Error, OSError):
                await nc.flush(timeout=2)
            await nc.close()


class _Client(Client):
    """nats-py's client, reading any subject a message arrives on, whose requests end
    when the server denies their subject.

    nats-py decodes a message's subject and reply subject as strict UTF-8 in its read
    loop, and a byte that is not UTF-8 ends that loop for good: the connection stays
    open but hears nothing more until the server's ping timeout. Any user may publish
    such a subject where its permissions allow (``mlscope.job.\\xff.cancel``), and a
    stream would redeliver it to a consumer after every restart. Here the bytes that
    are not UTF-8 read as U+FFFD: the message is delivered under a subject that no
    handler accepts (a trace batch's subject names its own evaluation, a job's
    cancel subject its job), and the loop goes on.

    A permission violation reaches only the error callback, so a denied request
    (JetStream's API calls and publishes are requests too) would wait out its timeout:
    ``awaiting`` holds the scopes of the requests waiting for answers by lower-cased
    subject, and the callback cancels those of a subject the server denied; such a
    request raises :class:`_DeniedWait` at once. Per connection, so in its loop."""

    def __init__(self) -> None:
        super().__init__()
        self.awaiting: dict[str, set[anyio.CancelScope]] = {}

    async def request(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float = 0.5,
        old_style: bool = False,
        headers: dict[str, Any] | None = None,
    ) -> Msg:
        key, scope = subject.lower(), anyio.CancelScope()
        waiting = self.awaiting.setdefault(key, set())
        waiting.add(scope)
        try:
            with scope:
                return await super().request(
                    subject, payload, timeout=timeout, old_style=old_style, headers=headers
                )
        finally:
            waiting.discard(scope)
            if not waiting:
                self.awaiting.pop(key, None)
        raise _DeniedWait(subject)

    async def on_error(self, exc: Exception) -> None:
        words = await _on_error(exc)
        named = _DENIED_SUBJECT.search(words.lower()) if words else None
        for scope in self.awaiting.get(named[1], ()) if named else ():
            scope.cancel()

    def _build_message(
        self,
        sid: int,
        subject: bytes,
        reply: bytes,
        data: bytes,
        headers: dict[str, str] | None,
    ) -> Msg:
        return self.msg_class(
            subject=subject.decode(errors="replace"),
            reply=reply.decode(errors="replace"),
            data=data,
            headers=headers,
            _client=self,
            _sid=sid,
        )


class _DeniedWait(nats.errors.TimeoutError):
    """A request whose subject the server denied: no answer will come, so its wait
    ended early. A timeout to every handler, which then finds the denial
    (:func:`_denied`) and raises :class:`BusDenied`."""

    def __init__(self, subject: str) -> None:
        super().__init__()
        self.subject = subject

    def __str__(self) -> str:
        return f"nats: the server denied {self.subject}"


def _reason(exc: BaseException) -> str:
    """What to add to the one-line failure: nothing when simply nobody listens (nats-py
    says only "no servers available"), else the client's own words (authorization...)."""
    if isinstance(exc, nats.errors.NoServersError | OSError | TimeoutError):
        return ""
    return f": {exc}"


SLOW_LOG_S = 10.0
"""A subscription that drops messages is logged at most once in this long."""
_slow_logged: dict[str, LogBudget] = {}
_denials: deque[tuple[float, str]] = deque(maxlen=16)
"""The latest permission violations NATS servers sent this process: (monotonic time,
the server's words). A server drops what a client may not publish and says so only
through this callback, so the publish or request then looks like a timeout; a failure
that follows one is a :class:`BusDenied` naming it (:func:`_denied`)."""
_denials_logged = LogBudget(burst=5, window_s=60.0)
_DENIED_SUBJECT = re.compile(r'publish to "([^"]+)"')
"""The subject in a denial's words (lower-cased, as nats-py gives them)."""


async def _on_error(exc: Exception) -> str | None:
    """nats-py reports reconnect noise through this callback; the caller sees BusError.
    A message dropped because its subscription held more than its pending limit (a
    slow consumer) is logged: nothing else would say it was lost. Per subscription, not
    per message subject: a wildcard subscription's publishers choose the latter. A
    permission violation is kept for :func:`_denied` and logged (a denied plain
    publish, spans or a reply, fails nowhere else); its words are returned."""
    if isinstance(exc, nats.errors.SlowConsumerError):
        subject = str(getattr(exc.sub, "subject", exc.subject))
        budget = _slow_logged.setdefault(subject, LogBudget(burst=1, window_s=SLOW_LOG_S))
        more = budget.take()
        if more is not None:
            log.warning(
                "dropped messages on %s: they came faster than this process read them "
                "(slow consumer; logged at most every %g s)%s",
                subject,
                SLOW_LOG_S,
                more,
            )
    elif PERMISSIONS_ERR in str(exc).lower():
        words = str(exc).removeprefix("nats: ")
        _denials.append((time.monotonic(), words))
        more = _denials_logged.take()
        if more is not None:
            log.info("the NATS server denied this client: %s%s", words, more)
        return words
    return None


def _denied(since: float) -> str | None:
    """The newest permission violation this process was sent at or after ``since``
    (``time.monotonic()``), in the server's words."""
    for at, words in reversed(_denials):
        if at >= since:
            return words
    return None


def _denial(what: str, words: str, **fields: Any) -> BusDenied:
    return BusDenied(
        f"{what}: the NATS server denied it ({words}): the credentials this client "
        "connected with (MLSCOPE_NATS_CREDS) do not allow it",
        **fields,
    )


async def _noop() -> None:
    return None


def _said(exc: BaseException) -> str:
    """What went wrong, in words: a JetStream API error's description and codes, "no
    answer in time" for a timeout, else the client's own words (nats-py's reprs are
    only class names: ``ServerError()``)."""
    if isinstance(exc, nats.js.errors.APIError):
        return (
            f"{exc.description or type(exc).__name__} "
            f"(JetStream error {exc.err_code}, status {exc.code})"
        )
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    return str(exc).removeprefix("nats: ").strip() or type(exc).__name__


@contextmanager
def bus_errors(what: str, **fields: Any) -> Iterator[None]:
    """NATS's exceptions inside the block as mlscope's, each message starting with
    ``what`` ("cannot read the agent registry"): what the request named is not there
    -> :class:`BusNotFound`; the server refused it (over the max payload, a JetStream
    API error) -> :class:`BusRefused`; a failure after the server denied this process
    a subject (a permission violation) -> :class:`BusDenied`; anything else, timeouts
    included -> :class:`BusError`. mlscope's own errors pass through unchanged."""
    since = time.monotonic()
    try:
        yield
    except nats.js.errors.NotFoundError as exc:
        why = getattr(exc, "description", None) or "not found"
        raise BusNotFound(f"{what}: {why}", **fields) from exc
    except (nats.errors.MaxPayloadError, nats.js.errors.APIError) as exc:
        raise BusRefused(f"{what}: {_said(exc)}", **fields) from exc
    except (TimeoutError, nats.errors.Error) as exc:
        words = _denied(since)
        if words is not None:
            raise _denial(what, words, **fields) from exc
        raise BusError(f"{what}: {_said(exc)}", **fields) from exc


async def if_found(pending: Awaitable[T]) -> T | None:
    """``await pending``; None when what it names (a key, a bucket, an object, a
    stream) is not on the bus. Other NATS errors are raised as they are: call it
    inside :func:`bus_errors`."""
    try:
        return await pending
    except nats.js.errors.NotFoundError:
        return None


async def next_msg(sub: Subscription, timeout: float) -> Msg | None:
    """The subscription's next message; None when none came within ``timeout`` s (a
    closed connection or subscription is a BusError)."""
    try:
        return await sub.next_msg(timeout=timeout)
    except TimeoutError:  # nats-py's TimeoutError is the builtin one too
        return None
    except nats.errors.Error as exc:
        raise BusError(f"cannot read {sub.subject}: {_said(exc)}", subject=sub.subject) from exc


async def fetch_one(sub: JetStreamContext.PullSubscription, timeout: float) -> Msg | None:
    """One message of a pull consumer; None when none came within ``timeout`` s (any
    other failure, a cluster failover moving the consumer's leader, is a BusError)."""
    try:
        msgs = await sub.fetch(1, timeout=timeout)
    except TimeoutError:
        return None
    except nats.errors.Error as exc:
        raise BusError(f"cannot fetch from the consumer: {_said(exc)}") from exc
    return msgs[0] if msgs else None


MAX_PER_SUBJECT_ERR_CODE = 10077
"""JetStream's ``maximum messages per subject exceeded`` (a 503 like "no leader", but
final: the subject's budget is full until a consumer's messages are purged)."""


async def publish_persistent(
    bus: Bus, subject: str, payload: bytes, *, msg_id: str, attempts: int = 20, timeout: float = 2.0
) -> bool:
    """JetStream publish that retries until the stream acknowledges it. False when the
    stream already held ``msg_id`` before this call (its first attempt was answered as a
    duplicate): the message was not stored again.

    The message id makes a retry after a lost acknowledgement harmless (the stream
    deduplicates it); retries ride out a reconnect or a cluster leader election.
    """
    last: Exception | None = None
    since = time.monotonic()
    for attempt in range(attempts):
        try:
            ack = await bus.js.publish(
                subject, payload, timeout=timeout, headers={"Nats-Msg-Id": msg_id}
            )
            return attempt > 0 or not ack.duplicate
        except nats.errors.MaxPayloadError as exc:
            raise BusRefused(
                f"a message of {len(payload)} bytes on {subject} is over the "
                f"server's max payload of {bus.nc.max_payload} bytes",
                subject=subject,
            ) from exc
        except nats.js.errors.APIError as exc:
            if (
                isinstance(exc, nats.js.errors.ServiceUnavailableError)
                and exc.err_code != MAX_PER_SUBJECT_ERR_CODE
            ):
                last = exc  # no leader right now: retry
            else:  # the stream refused it (too large, wrong subject ...): final
                raise BusRefused(
                    f"JetStream refused a message on {subject}: {_said(exc)}",
                    subject=subject,
                ) from exc
        except (TimeoutError, nats.errors.Error) as exc:
            words = _denied(since)
            if words is not None:  # final: the server drops every try
                raise _denial(f"cannot publish on {subject}", words, subject=subject) from exc
            last = exc
            await anyio.sleep(min(0.1 * 2**attempt, 2.0))
    said = _said(last) if last is not None else "no attempt"
    raise BusError(f"JetStream did not store a message on {subject}: {said}", subject=subject)


_NO_ANSWER = ("$", f"{names.PREFIX}.")
"""Where no answer goes (:func:`answerable`), built once: it is checked per query."""


def answerable(reply: str) -> bool:
    """Whether a responder may publish its answer to ``reply``: a subject, and none of
    the stack's (``mlscope.``) nor of nats-server's APIs (``$JS``, ``$KV``, ``$O``,
    ``$SYS``: any ``$``). A responder answers with its own permissions, so a requester
    that named such a subject would have it publish there in the requester's stead: a
    server's empty answer on ``$JS.API.STREAM.DELETE.<stream>`` deletes the stream, an
    agent's answer on ``$KV.mlscope_agents.<id>`` overwrites a registry entry. Answers
    go to inboxes, and no inbox prefix is under those (:func:`connect_options`)."""
    return bool(reply) and not reply.startswith(_NO_ANSWER)


def error_reply(exc: MLScopeError) -> bytes:
    """The bytes of an error reply (decoded by :func:`request`)."""
    return codec.encode({"kind": "error", "error": exc.to_wire()})


async def request(bus: Bus, subject: str, payload: bytes, *, timeout: float) -> Any:
    """Request/reply; an error reply is raised as its typed error, a request the server
    denied this client as :class:`BusDenied`."""
    since = time.monotonic()
    try:
        msg = await bus.nc.request(subject, payload, timeout=timeout)
    except nats.errors.NoRespondersError as exc:
        raise BusError(f"nobody serves {subject}", subject=subject) from exc
    except (TimeoutError, nats.errors.TimeoutError) as exc:
        words = _denied(since)
        if words is not None:
            raise _denial(f"cannot ask {subject}", words, subject=subject) from exc
        raise BusError(f"no reply on {subject} within {timeout}s", subject=subject) from exc
    data = codec.decode(msg.data)
    if isinstance(data, dict) and data.get("kind") == "error":
        raise error_from_wire(data["error"])
    return data


async def request_model(
    bus: Bus, subject: str, payload: bytes, model: type[M], *, timeout: float
) -> M:
    """:func:`request` whose answer must be a ``model`` (else a WireError naming what
    is wrong with it): a peer's reply is checked where it arrives, not where a field
    of it is first read."""
    return codec.validate(model, await request(bus, subject, payload, timeout=timeout))
