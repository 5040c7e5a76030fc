"""The serving boundary: the one place that runs handlers and owns their failures.

Every core subscription (agent control and queries, database requests), every stream
consumer (jobs, traces) and every long-lived loop (KV watches, flushers) of a service
goes through one :class:`Boundary`:

* **Requests** (:meth:`Boundary.subscribe`): the message is decoded into its contract
  (a pydantic model or type adapter from :mod:`mlscope.contracts`), the handler runs,
  its result is the reply. *Any* exception (not only :class:`MLScopeError`) becomes a
  typed error reply (``ErrorReply``), is logged to stderr and counted. A handler never
  ends the subscription, let alone the process.
* **Stream messages** (:meth:`Boundary.settle`): a handler that fails is retried by
  JetStream (``nak`` with a delay) until the consumer's ``max_deliver``; a message that
  can never be decoded, or that still fails on its last delivery, is copied to the
  dead-letter stream (``mlscope.dead.<stream>``, error in its headers) and terminated.
  ``mlscope doctor`` lists them.
* **Loops** (:meth:`Boundary.keep_running`): a watch or flusher that raises is logged,
  counted and started again after a back-off, inside the service's task group.
* **Values** (:func:`decode_json`): bucket values are size- and depth-limited before
  they are parsed; a bad one is skipped with a log line by the caller.

nats-py hands each subscription's messages to one callback task in order; the
boundary's callback cannot raise, so that task (and the ordering) survives every input.
"""

from __future__ import annotations

import contextlib
import email.header
import json
import logging
import re
import sys
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
import nats.errors
from anyio.abc import TaskStatus
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import BaseModel, TypeAdapter, ValidationError

from mlscope import codec, names
from mlscope.bounded import json_depth
from mlscope.bus import Bus, answerable, bus_errors, if_found
from mlscope.contracts import ErrorReply
from mlscope.errors import (
    EvaluationNotFound,
    MLScopeError,
    ReplyTooLarge,
    ServiceError,
    WireError,
)
from mlscope.logbudget import LogBudget

__all__ = [
    "MAX_VALUE_BYTES",
    "MAX_VALUE_DEPTH",
    "Boundary",
    "DeadLetter",
    "as_error",
    "configure_logging",
    "dead_letters",
    "decode_json",
]

T = TypeVar("T")
MAX_ERROR_CHARS = codec.MAX_ERROR_CHARS
MAX_VALUE_BYTES = 256 * 1024
"""The largest bucket value a service parses (a manifest is a few KB)."""
MAX_VALUE_DEPTH = 64
"""The deepest nesting of a bucket value a service parses."""
DEAD_HEADER_LIMIT = 1000
"""Characters of an error kept in a dead letter's header."""


def configure_logging(level: str = "info") -> None:
    """Services log to stderr, one line per event, at ``level`` (debug ... error)."""
    logging.basicConfig(
        stream=sys.stderr,
        level=level.upper(),
        force=True,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def as_error(exc: BaseException, *, service: str = "") -> MLScopeError:
    """Any exception as a typed error: ours as they are, the rest translated."""
    if isinstance(exc, MLScopeError):
        return exc
    if isinstance(exc, ValidationError):
        why = str(exc.errors(include_url=False, include_input=False))
        return WireError(f"invalid message: {why}"[:MAX_ERROR_CHARS])
    if isinstance(exc, RecursionError):
        return WireError("a value nested too deeply to handle")
    return ServiceError(
        f"{service or 'a service'} failed: {type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS],
        service=service,
        exception=type(exc).__name__,
    )


def decode_json(
    data: bytes | None, *, max_bytes: int = MAX_VALUE_BYTES, max_depth: int = MAX_VALUE_DEPTH
) -> Any:
    """JSON bytes to Python, refusing oversize and deeply nested values before parsing
    (a 400 KB ``[[[[...`` would exhaust the recursion limit of the parser)."""
    data = data or b""
    if len(data) > max_bytes:
        raise WireError(
            f"a value of {len(data)} bytes is over the {max_bytes}-byte limit", size=len(data)
        )
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise WireError(f"not valid JSON: {exc}") from exc
    if json_depth(text) > max_depth:
        raise WireError(f"a value nested deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise WireError(f"not valid JSON: {exc}") from exc


class _Decoder(Generic[T]):
    def __init__(self, contract: type[T] | TypeAdapter[T]) -> None:
        self.adapter: TypeAdapter[T] = (
            contract if isinstance(contract, TypeAdapter) else TypeAdapter(contract)
        )
        self.name = getattr(contract, "__name__", "request")
        self.raw = contract is bytes
        """``bytes``: the handler decodes (a hot path that stamps arrival first)."""

    def __call__(self, data: bytes) -> T:
        if self.raw:
            return data  # type: ignore[return-value]
        raw = codec.decode(data)
        try:
            return self.adapter.validate_python(raw)
        except ValidationError as exc:
            why = str(exc.errors(include_url=False, include_input=False))
            raise WireError(f"invalid {self.name}: {why}"[:MAX_ERROR_CHARS]) from exc


Handler = Callable[[T, Msg], Awaitable[Any]]


class Boundary:
    """One service's serving boundary: its logger, its counters, its dead letters."""

    def __init__(self, bus: Bus, *, service: str, logger: logging.Logger | None = None) -> None:
        self.bus, self.service = bus, service
        self.log = logger or logging.getLogger(f"mlscope.{service.split()[0]}")
        self.handled = 0
        self.failures: Counter[str] = Counter()
        """Failures by error code (``wire``, ``service``, ``database`` ...)."""
        self.dead_lettered = 0
        self.log_budget = LogBudget()
        """Every failure line of this service, refusals and dead letters alike."""

    # ------------------------------------------------------------------ requests

    async def subscribe(
        self,
        subject: str,
        contract: type[T] | TypeAdapter[T],
        handler: Handler[T],
        *,
        queue: str = "",
    ) -> Subscription:
        """Subscribe ``handler``: decoded ``contract`` in, its result (a model, plain
        data or bytes; None: no reply) out, any failure as a typed error reply."""
        return await self.bus.nc.subscribe(
            subject, queue=queue, cb=self.responder(contract, handler)
        )

    def responder(
        self, contract: type[T] | TypeAdapter[T], handler: Handler[T]
    ) -> Callable[[Msg], Awaitable[None]]:
        decode = _Decoder(contract)

        async def respond(msg: Msg) -> None:
            try:
                result = await handler(decode(msg.data), msg)
            except Exception as exc:  # the boundary: every failure, whatever its type
                err = self.failed(exc, msg.subject)
                await self._reply(msg, ErrorReply(error=err.to_wire()))
                return
            self.handled += 1
            if result is not None:
                await self._reply(msg, result)

        return respond

    async def _reply(self, msg: Msg, result: Any) -> None:
        if not msg.reply:
            return
        if not answerable(msg.reply):  # never publish in a requester's stead
            self.failed(
                WireError(f"no answer to a reply subject that is no inbox: {msg.reply!r}"),
                msg.subject,
                what="reply to",
            )
            return
        try:
            try:
                data = (
                    result
                    if isinstance(result, bytes)
                    else codec.encode_model(result)
                    if isinstance(result, BaseModel)
                    else codec.encode(result)
                )
            except MLScopeError as exc:  # one it cannot encode: the requester hears why
                err = self.failed(exc, msg.subject, what="reply to")
                data = codec.encode_model(ErrorReply(error=err.to_wire()))
            limit = int(getattr(self.bus.nc, "max_payload", 0) or 0)
            if limit and len(data) > limit:  # the requester hears why, not a timeout
                err = self.failed(
                    ReplyTooLarge(
                        f"the reply would be {len(data):,} bytes, over the bus's max payload "
                        f"of {limit:,}: ask for less (fewer rows, or a page at a time)"
                    ),
                    msg.subject,
                    what="reply to",
                )
                data = codec.encode_model(ErrorReply(error=err.to_wire()))
            await msg.respond(data)
        except Exception as exc:  # connection closed: the requester times out
            self.failed(exc, msg.subject, what="reply to")

    def failed(self, exc: BaseException, subject: str, *, what: str = "message on") -> MLScopeError:
        """Count and log one failure; returns it as a typed error."""
        err = as_error(exc, service=self.service)
        if len(err.message) > MAX_ERROR_CHARS:  # never echo a hostile input back
            err.message = err.message[:MAX_ERROR_CHARS] + " ..."
        self.failures[err.code] += 1
        more = self.log_budget.take()
        if more is None:
            return err
        if isinstance(err, ServiceError):
            self.log.error("%s %s failed: %s%s", what, subject, err.message, more, exc_info=exc)
        elif isinstance(err, EvaluationNotFound):  # a waiting submitter's routine ask
            self.log.debug("%s %s answered: %s%s", what, subject, err.message, more)
        else:
            self.log.warning("%s %s refused: %s%s", what, subject, err.message, more)
        return err

    # ------------------------------------------------------------------ streams

    async def settle(
        self,
        msg: Msg,
        stream: str,
        handler: Callable[[Msg], Awaitable[None]],
        *,
        max_deliver: int,
        retry_s: float = 1.0,
    ) -> None:
        """Run ``handler`` on one JetStream message (the handler acks it). A failure
        is retried by redelivery; a message that can never be decoded (WireError) or
        that fails on its last delivery is dead-lettered and terminated."""
        try:
            await handler(msg)
            self.handled += 1
            return
        except Exception as exc:
            err = self.failed(exc, msg.subject)
        if isinstance(err, WireError) or delivered(msg) >= max_deliver:
            await self.dead_letter(msg, stream, err)
        else:
            with anyio.move_on_after(5):
                await _quietly(msg.nak(delay=retry_s))

    async def dead_letter(self, msg: Msg, stream: str, err: MLScopeError) -> None:
        """Copy ``msg`` with its error to the dead-letter stream, then terminate it."""
        reason = re.sub(r"[\r\n]+", " ", f"{err.code}: {err.message}")[:DEAD_HEADER_LIMIT]
        headers = {
            "Mlscope-Error": reason,
            "Mlscope-Subject": msg.subject,
            "Mlscope-Service": self.service,
            "Mlscope-Delivered": str(delivered(msg)),
        }
        with anyio.move_on_after(5):
            try:
                await self.bus.js.publish(
                    names.dead_letter(stream), msg.data or b"", headers=headers, timeout=2
                )
                self.dead_lettered += 1
            except Exception as exc:  # a full dead-letter stream must not block the source
                if (more := self.log_budget.take()) is not None:
                    self.log.error(
                        "cannot dead-letter a message of %s: %r%s", msg.subject, exc, more
                    )
            if (more := self.log_budget.take()) is not None:
                self.log.warning("gave up on a message of %s (%s)%s", msg.subject, reason, more)
            await _quietly(msg.term())

    # ------------------------------------------------------------------ loops

    async def keep_running(
        self,
        name: str,
        loop: Callable[..., Coroutine[Any, Any, None]],
        *,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run ``loop`` for ever; a failure is logged, counted and the loop started
        again (back-off doubling up to ``max_backoff_s``). A loop that takes a
        ``task_status`` is started with ``tg.start`` the first time: "started" still
        means its initial state is in."""
        started = False
        wait = backoff_s
        while True:
            try:
                async with anyio.create_task_group() as tg:
                    if not started and _takes_status(loop):
                        await tg.start(loop)
                    else:
                        tg.start_soon(loop)
                    if not started:
                        started = True
                        task_status.started()
                wait = backoff_s
                self.log.warning("%s ended; starting it again", name)
            except Exception as exc:
                err = self.failed(_unwrap(exc), name, what="loop")
                self.log.warning("%s failed (%s); again in %.1f s", name, err.code, wait)
                if not started:
                    started = True
                    task_status.started()
            await anyio.sleep(wait)
            wait = min(2 * wait, max_backoff_s)


def delivered(msg: Msg) -> int:
    """How many times JetStream has delivered ``msg`` (1 when it is not a JS message)."""
    try:
        return int(msg.metadata.num_delivered)
    except Exception:
        return 1


def _text(headers: dict[str, Any], name: str) -> str:
    """A dead letter's header as text. Anyone who may publish on the dead-letter
    subjects writes these headers, and nats-py parses them as e-mail headers: a value
    that is not ASCII comes back as an ``email.header.Header``, not a str."""
    value = headers.get(name) or ""
    if isinstance(value, str):
        return value
    parts = email.header.decode_header(value)  # the header's bytes, as they were sent
    return "".join(
        p.decode("utf-8", "replace") if isinstance(p, bytes) else str(p) for p, _ in parts
    )


def _count(text: str) -> int:
    """A count a header carries; 0 when it carries none (one that is not a number must
    not hide every other dead letter from ``mlscope doctor``)."""
    text = text.strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else 0


async def _quietly(aw: Awaitable[Any]) -> None:
    with contextlib.suppress(TimeoutError, nats.errors.Error, OSError):
        await aw


def _takes_status(fn: Callable[..., Any]) -> bool:
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None), "__code__", None)
    return (
        code is not None
        and "task_status" in code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    )


def _unwrap(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


@dataclass(frozen=True)
class DeadLetter:
    """A message a consumer gave up on, as ``mlscope doctor`` lists it."""

    seq: int
    subject: str
    """Where it was first published."""
    error: str
    service: str
    delivered: int
    size: int


async def dead_letters(bus: Bus, *, limit: int = 50) -> tuple[int, list[DeadLetter]]:
    """(how many dead letters are kept, the newest ``limit`` of them, oldest first)."""
    with bus_errors(f"cannot read {names.DEAD_STREAM}"):
        info = await if_found(bus.js.stream_info(names.DEAD_STREAM))
    if info is None:
        return 0, []
    state = info.state
    out: list[DeadLetter] = []
    if not state.messages:
        return 0, out
    for seq in range(max(state.first_seq, state.last_seq - limit + 1), state.last_seq + 1):
        with bus_errors(f"cannot read dead letter {seq}"):
            raw = await if_found(bus.js.get_msg(names.DEAD_STREAM, seq))
        if raw is None:
            continue  # aged out or removed
        h = raw.headers or {}
        out.append(
            DeadLetter(
                seq=seq,
                subject=_text(h, "Mlscope-Subject") or raw.subject or "",
                error=_text(h, "Mlscope-Error"),
                service=_text(h, "Mlscope-Service"),
                delivered=_count(_text(h, "Mlscope-Delivered")),
                size=len(raw.data or b""),
            )
        )
    return int(state.messages), out
