"""Helpers for the attack tests: an HTTP listener that records every request, and a
stack started with ``--auth``."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio

from cli.main import main as mlscope_main
from cli.stack import Stack
from mlscope.natsserver import NatsServer
from mlscope.settings import Settings
from tests.conftest import make_data_dir, wait_agents, wait_server


class Recorder:
    """A local HTTP server that answers 200 with a body and remembers each request."""

    def __init__(
        self,
        body: bytes = b"secret bytes",
        *,
        redirect_to: str | None = None,
        content_length: bool = True,
    ) -> None:
        self.requests: list[str] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                recorder.requests.append(self.path)
                if redirect_to is not None:
                    self.send_response(302)
                    self.send_header("Location", redirect_to + self.path)
                    self.end_headers()
                    return
                self.send_response(200)
                if content_length:  # without it, HTTP/1.0: the body ends at close
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> Recorder:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextmanager
def auth_stack(
    base: Path, zoo_dir: Path, frameworks: list[str], **settings: object
) -> Iterator[tuple[Stack, Path]]:
    """``mlscope auth init`` + ``mlscope up --auth`` under ``base``; yields the stack
    and the auth directory once the server answers and every agent registered."""
    auth = base / "auth"
    assert mlscope_main(["auth", "init", "--out", str(auth)]) == 0
    data = make_data_dir(base / "data", zoo_dir)
    stack = Stack(
        Settings(data_dir=data).with_(**settings), nats_port=0, frameworks=frameworks, auth=auth
    )
    client = stack.start()
    try:
        reader = client.with_(nats_creds=(auth / "reader.creds").resolve())
        anyio.run(wait_server, reader, 60.0)
        if frameworks:
            anyio.run(wait_agents, reader, len(frameworks))
        yield stack, auth
    finally:
        stack.stop()


def role(stack: Stack, auth: Path, name: str) -> Settings:
    """The client settings of one role of an ``auth_stack``."""
    return stack.settings.with_(nats_creds=(auth / f"{name}.creds").resolve())


def issued_auth(out: Path, *users: tuple[str, ...]) -> Path:
    """``mlscope auth init`` into ``out``, then each of ``users``: the arguments of one
    ``mlscope auth`` command (``("add-agent", "alice")``, ``("add-loadgen", "lg-a")``,
    with any flags after the name)."""
    assert mlscope_main(["auth", "init", "--out", str(out)]) == 0
    for command, name, *flags in users:
        assert mlscope_main(["auth", command, name, "--out", str(out), *flags]) == 0
    return out


@contextmanager
def secured_nats(store: Path, auth: Path) -> Iterator[NatsServer]:
    """A nats-server under the configuration ``auth init`` wrote into ``auth``."""
    with NatsServer(store_dir=store, config_file=auth / "server.conf") as srv:
        yield srv
