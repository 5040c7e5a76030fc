"""Helpers of the scale, cluster, edge and auth tests: a TCP link we can cut, service
processes, and counting what reached the database."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from pathlib import Path

from broker.db import Database
from mlscope.settings import Settings
from tests.conftest import child_env, python


class CuttableLink:
    """A loopback TCP proxy between a leaf node and its hub that the test can cut.

    ``cut()`` closes the listener and every open connection (the leaf sees its link
    drop and cannot reconnect); ``restore()`` listens again on the same port.
    """

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.host, self.target = host, target_port
        self.port = 0
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.restore()

    def restore(self) -> None:
        lst = socket.socket()
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind((self.host, self.port))
        self.port = lst.getsockname()[1]
        lst.listen(16)
        self._listener = lst
        threading.Thread(target=self._accept, args=(lst,), daemon=True).start()

    def cut(self) -> None:
        lst, self._listener = self._listener, None
        if lst is not None:
            with contextlib.suppress(OSError):
                lst.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            lst.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    close = cut

    def _accept(self, lst: socket.socket) -> None:
        while True:
            try:
                client, _ = lst.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((self.host, self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def start(settings: Settings, *args: str, log: Path | None = None) -> subprocess.Popen[bytes]:
    """``python -m cli.main ARGS`` with these settings in its environment."""
    out = open(log, "ab") if log else None  # noqa: SIM115 - lives as long as the child
    return subprocess.Popen(
        [python(), "-m", "cli.main", *args],
        env=child_env(settings),
        stdout=out,
        stderr=subprocess.STDOUT if out else None,
    )


def stop(*procs: subprocess.Popen[bytes] | None) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            p.terminate()
    for p in procs:
        if p is not None:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def count(db_dir: Path, sql: str, **params: object) -> int:
    """One number from a chDB directory no server owns any more."""
    db = Database(f"chdb:///{db_dir}")
    try:
        return int(db.rows(sql, params or None)[0][0])
    finally:
        db.close()


def wait_until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(predicate) and predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} within {timeout}s")
