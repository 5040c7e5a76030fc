"""A lean NATS connection for a load generator's queries and their replies.

nats-py serves every message through the event loop: a publish wakes its flusher
task; a reply passes its reader task, the subscription's queue and a callback task.
At 1,000 QPS a load generator built on it spent ~430 µs of CPU per query on the
2-core VM of docs/BENCHMARKS.md, and each hop stood between a reply's arrival and
its timestamp.

An open loop needs two things on its hot path: write a query's prebuilt bytes the
moment it is due, and stamp each reply the moment it arrives. :class:`QueryLink`
does both over a socket of its own, on plain threads: the pacer's thread writes (no
hop to the event loop) and a reader thread parses the replies and hands each one,
with the time its last byte was read, to the caller. It speaks the part of the NATS
client protocol this needs: CONNECT with the bus's credentials (an nkey seed, a user
JWT, a user and password or a token in the URL) and TLS, SUB, PUB, PING/PONG.

While the server is unreachable the link says so at once to whoever sends (the load
generator records those queries as lost, with the reason) and connects again, to the
same server or another of the bus's, as nats-py would; a query is never held back to
be sent late. Over TLS one lock covers reads and writes (an OpenSSL
connection is not used by two threads at once); the reader takes it only once the
socket has bytes. Its failures are :class:`mlscope.errors.BusError`, raised here.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any
from urllib.parse import ParseResult, urlparse

import nkeys

from mlscope.errors import BusError
from mlscope.pacer import RealtimeThread

__all__ = ["QueryLink"]

log = logging.getLogger(__name__)

OnReply = Callable[[bytes, int], None]
"""``on_reply(data, t_ns)``: one reply's payload and its ``perf_counter_ns`` arrival."""
RECONNECT_WAIT_S = 0.25
"""How long a lost link waits before each try to connect again."""
MAX_LINE = 64 * 1024
"""A protocol line longer than this (a MSG line holds two subjects) is a broken stream."""
READ_SIZE = 256 * 1024
SID = b"1"


class QueryLink:
    """One socket to one NATS server: ``send`` from any thread, replies to a callback.

    Build with :meth:`open`; :meth:`start` the reader; :meth:`close` when done. While
    the server is unreachable, :meth:`send` raises at once (the caller records those
    queries as lost) and the reader connects again, to the same server or another of
    the bus's, every RECONNECT_WAIT_S.
    """

    def __init__(
        self,
        connection: tuple[socket.socket, int, bytearray],
        servers: list[ParseResult],
        options: Mapping[str, Any],
        *,
        inbox: str,
        name: str,
        timeout: float,
    ) -> None:
        """Use :meth:`open`; ``connection`` is what :func:`_handshake` returned."""
        self.inbox = inbox
        self.error: str | None = None
        """Why the link failed for good (the server refused what it was sent), or None."""
        self.outages = 0
        """How many times the connection was lost (and connected again)."""
        self.outage: str | None = None
        """Why it was last lost."""
        self.bad_replies = 0
        """Replies the callback raised on (each skipped, the link goes on)."""
        self.bad_reply: str | None = None
        """Why the last of them could not be read."""
        self.reader_cpu_s = 0.0
        """CPU time of the reader thread (reading, stamping, a closed loop's next
        sends), set when it ends."""
        self._servers, self._options, self._name = servers, options, name
        self._timeout = timeout
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reader: threading.Thread | None = None
        self._use(*connection)

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        url: ParseResult,
        options: Mapping[str, Any],
        *,
        inbox: str,
        name: str,
        timeout: float = 5.0,
    ) -> QueryLink:
        """Connect to the server at ``url`` with the bus's connect ``options`` (as
        :func:`mlscope.bus.connect_options` builds them) and subscribe to ``inbox``;
        the other servers of ``options["servers"]`` are where it reconnects next."""
        others = [urlparse(str(u)) for u in options.get("servers") or ()]
        servers = [url, *(u for u in others if (u.hostname, u.port) != (url.hostname, url.port))]
        first = _handshake(url, options, inbox=inbox, name=name, timeout=timeout)
        return cls(first, servers, options, inbox=inbox, name=name, timeout=timeout)

    def _use(self, sock: socket.socket, max_payload: int, rest: bytearray) -> None:
        """Send and read through this connection from now on."""
        self._sock, self._buf = sock, rest
        self._ssl = sock if isinstance(sock, ssl.SSLSocket) else None
        self.max_payload = max_payload
        self._up = True

    # ------------------------------------------------------------------ running

    def frame(self, subject: str, payload: bytes) -> bytes:
        """The bytes that publish ``payload`` to ``subject`` with this link's inbox."""
        if len(payload) > self.max_payload:
            raise BusError(
                f"a query of {len(payload)} bytes exceeds the server's limit of "
                f"{self.max_payload} (max_payload)"
            )
        head = f"PUB {subject} {self.inbox} {len(payload)}\r\n".encode()
        return head + payload + b"\r\n"

    def send(self, data: bytes) -> None:
        """Write ``data`` (whole frames) now, from any thread; BusError if it cannot."""
        with self._lock:
            if not self._up:
                raise BusError(f"the bus was unreachable ({self.outage})")
            try:
                self._sock.sendall(data)
            except OSError as exc:
                self._lost(f"the connection broke while sending: {exc}")
                raise BusError(f"the bus was unreachable ({self.outage})") from exc

    def start(
        self,
        on_reply: OnReply,
        *,
        on_end: Callable[[], None] | None = None,
        realtime: bool = True,
    ) -> None:
        """Start the reader thread: ``on_reply(data, t_ns)`` for each reply, in order,
        and ``on_end()`` once it stops (closed, or failed: :attr:`error` is set first).

        ``realtime``: the reader runs in SCHED_FIFO (no effect without CAP_SYS_NICE):
        preempted while it holds the GIL, it would stall the pacer's thread too.
        """
        if self._reader is not None:
            raise BusError("a query link's reader starts once")
        self._reader = threading.Thread(
            target=self._run,
            args=(on_reply, on_end, realtime),
            name="mlscope-replies",
            daemon=True,
        )
        self._reader.start()

    def close(self) -> None:
        """Stop the reader and close the socket (what arrives after is dropped)."""
        self._closed.set()
        with suppress(OSError):  # already down
            self._sock.shutdown(socket.SHUT_RDWR)
        if self._reader is not None:  # past a handshake under way, if any
            self._reader.join(timeout=self._timeout + RECONNECT_WAIT_S + 1)
        self._sock.close()  # the last connection the reader made

    def report(self) -> None:
        """Log what the link went through (its lost queries say why themselves)."""
        if self.outages:
            log.warning(
                "the bus was unreachable %d time(s) during the run: %s", self.outages, self.outage
            )
        if self.bad_replies:
            log.warning("%d replies could not be read: %s", self.bad_replies, self.bad_reply)

    def _lost(self, why: str) -> None:
        """The connection is gone (called with the send lock held, or by the reader)."""
        if self._up and not self._closed.is_set():
            self._up = False
            self.outages += 1
            self.outage = why
            with suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # the reader's recv returns

    def _run(self, on_reply: OnReply, on_end: Callable[[], None] | None, realtime: bool) -> None:
        cpu0 = time.thread_time()
        priority = RealtimeThread(enable=realtime)
        try:
            while not self._closed.is_set() and self.error is None:
                why = self._read(on_reply)
                with self._lock:
                    self._lost(why)
                self._reconnect()
        except Exception as exc:  # whatever it was, the run hears of it, the process goes on
            self.error = self.error or f"the query link's reader failed: {exc!r}"
            with self._lock:
                self._lost(self.error)
        finally:
            priority.restore()
            self.reader_cpu_s = time.thread_time() - cpu0
            if on_end is not None:
                on_end()

    def _reconnect(self) -> None:
        """Connect again, to each server in turn, until connected or closed."""
        old = self._sock
        for k in itertools.count():
            if self._closed.wait(RECONNECT_WAIT_S):
                return
            url = self._servers[k % len(self._servers)]
            try:
                new = _handshake(
                    url, self._options, inbox=self.inbox, name=self._name, timeout=self._timeout
                )
            except BusError as exc:
                self.outage = str(exc)
                continue
            with self._lock:
                self._use(*new)
            old.close()
            return

    def _recv(self) -> bytes:
        sock = self._ssl
        if sock is None:
            return self._sock.recv(READ_SIZE)
        if not sock.pending():  # decrypted bytes already held need no wait
            select.select([sock], [], [])
        with self._lock:
            return sock.recv(READ_SIZE)

    def _read(self, on_reply: OnReply) -> str:
        """Read replies until the connection ends; return why it ended."""
        clock, buf = time.perf_counter_ns, self._buf  # this connection's
        try:
            while True:
                chunk = self._recv()
                t = clock()
                if not chunk:
                    return "the NATS server closed the connection"
                buf += chunk
                pos = self._parse(buf, t, on_reply)
                del buf[:pos]
                if len(buf) > MAX_LINE and buf.find(b"\r\n") < 0:
                    return "the NATS server sent a line too long to be its protocol"
        except (OSError, ValueError, BusError) as exc:
            return f"the connection broke while reading: {exc}"

    def _parse(self, buf: bytearray, t: int, on_reply: OnReply) -> int:
        """Handle every whole message in ``buf``; return how many bytes they took."""
        pos = 0
        while (end := buf.find(b"\r\n", pos)) >= 0:
            if buf.startswith(b"MSG ", pos):
                size = int(buf[buf.rfind(b" ", pos, end) + 1 : end])
                stop = end + 2 + size
                if len(buf) < stop + 2:
                    break  # the payload is still arriving
                try:
                    on_reply(bytes(buf[end + 2 : stop]), t)
                except Exception as exc:  # one bad reply never stops the reader
                    self.bad_replies += 1
                    self.bad_reply = repr(exc)
                pos = stop + 2
                continue
            line = bytes(buf[pos:end])
            pos = end + 2
            if line == b"PING":
                self.send(b"PONG\r\n")
            elif line.startswith(b"-ERR") and self.error is None:
                self.error = f"the NATS server said: {_err(line)}"
        return pos


def _handshake(
    url: ParseResult, options: Mapping[str, Any], *, inbox: str, name: str, timeout: float
) -> tuple[socket.socket, int, bytearray]:
    """A new connection to ``url``, signed in and subscribed to ``inbox``: the socket,
    the server's max_payload, and what it sent beyond the handshake."""
    host, port = url.hostname or "127.0.0.1", url.port or 4222
    where = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise BusError(f"no NATS server at {where} for the query link: {exc}") from exc
    buf = bytearray()
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        info = json.loads(_line(sock, buf, expect=b"INFO ")[5:])
        if not isinstance(info, dict):
            raise BusError(f"{where} sent an INFO that is not an object")
        max_payload = info.get("max_payload", 1 << 20)
        if not isinstance(max_payload, int) or isinstance(max_payload, bool) or max_payload < 1:
            raise BusError(f"{where} sent an INFO with max_payload {max_payload!r}")
        tls = options.get("tls")
        if info.get("tls_required") or url.scheme == "tls" or tls is not None:
            ctx = tls if isinstance(tls, ssl.SSLContext) else ssl.create_default_context()
            sock = ctx.wrap_socket(sock, server_hostname=host)
        fields = {
            "verbose": False,
            "pedantic": False,
            "protocol": 1,
            "headers": False,
            "lang": "python3-mlscope",
            "name": name,
            **_credentials(info, url, options),
        }
        hello = b"CONNECT " + json.dumps(fields).encode() + b"\r\n"
        sock.sendall(hello + b"SUB " + inbox.encode() + b" " + SID + b"\r\nPING\r\n")
        while (line := _line(sock, buf)) != b"PONG":
            if line.startswith(b"-ERR"):
                raise BusError(f"{where} refused the query link: {_err(line)}")
            if line == b"PING":
                sock.sendall(b"PONG\r\n")
        sock.settimeout(None)
    except BusError:
        sock.close()
        raise
    except (OSError, ValueError, KeyError, nkeys.NkeysError) as exc:  # SSLError: OSError
        sock.close()
        raise BusError(f"the query link to {where} failed to open: {exc}") from exc
    return sock, max_payload, buf


def _line(sock: socket.socket, buf: bytearray, *, expect: bytes = b"") -> bytes:
    """One protocol line of a handshake (blocking, within the socket's timeout)."""
    while (end := buf.find(b"\r\n")) < 0:
        if len(buf) > MAX_LINE:
            raise BusError("the NATS server sent a line too long to be its protocol")
        chunk = sock.recv(READ_SIZE)
        if not chunk:
            raise BusError("the NATS server closed the query link during its handshake")
        buf += chunk
    line = bytes(buf[:end])
    del buf[: end + 2]
    if expect and not line.startswith(expect):
        raise BusError(f"the NATS server sent {line[:200]!r} where {expect!r} was due")
    return line


def _err(line: bytes) -> str:
    return line[4:].strip().strip(b"'").decode(errors="replace")


def _credentials(
    info: Mapping[str, Any], url: ParseResult, options: Mapping[str, Any]
) -> dict[str, str]:
    """CONNECT's auth fields for the bus's credentials, as nats-py sends them."""
    creds, seed_file = options.get("user_credentials"), options.get("nkeys_seed")
    nonce = info.get("nonce")
    if nonce and (creds or seed_file):
        fields: dict[str, str] = {}
        if creds:
            jwt, seed = _read_creds(Path(creds))
            fields["jwt"] = jwt
        else:
            seed = Path(str(seed_file)).read_bytes().strip()
        kp = nkeys.from_seed(bytearray(seed))
        try:
            if not creds:
                fields["nkey"] = kp.public_key.decode()
            fields["sig"] = base64.b64encode(kp.sign(str(nonce).encode())).decode()
        finally:
            kp.wipe()
        return fields
    if url.username and url.password is not None:
        return {"user": url.username, "pass": url.password}
    if url.username:
        return {"auth_token": url.username}
    return {}


def _read_creds(path: Path) -> tuple[str, bytes]:
    """The user JWT and the nkey seed of a ``.creds`` file."""
    lines = path.read_text().splitlines()
    jwt = seed = None
    for k, line in enumerate(lines[:-1]):
        if "BEGIN NATS USER JWT" in line:
            jwt = lines[k + 1].strip()
        elif "BEGIN USER NKEY SEED" in line:
            seed = lines[k + 1].strip().encode()
    if jwt is None or seed is None:
        raise BusError(f"{path} holds no user JWT and nkey seed", path=str(path))
    return jwt, seed
