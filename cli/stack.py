"""A local stack: nats-server, the server and agents as child processes of this one.

What ``mlscope up`` supervises, and what tests and benchmarks start to run against the
real components: :class:`Stack` starts them (with per-role or per-agent credentials
when given an auth directory) and stops them; :func:`wait_provisioned` waits until the
server has made the streams and buckets.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio

from mlscope import names
from mlscope.agentauth import add_agent
from mlscope.errors import ConfigError
from mlscope.lifeline import ends_with_this_process
from mlscope.natsserver import NatsServer
from mlscope.settings import Settings

__all__ = ["LOOPBACK", "Stack", "wait_provisioned"]

LOOPBACK = "127.0.0.1"
"""Where ``mlscope up`` binds nats-server unless ``--host`` says otherwise."""


class Stack:
    """nats-server + server + agents as child processes of this one."""

    def __init__(
        self,
        settings: Settings,
        *,
        nats_port: int,
        frameworks: list[str],
        auth: Path | None = None,
        agents_per_framework: int = 1,
        host: str = LOOPBACK,
    ) -> None:
        self.settings, self.nats_port, self.frameworks = settings, nats_port, frameworks
        self.auth, self.per_framework = auth, agents_per_framework
        config = auth / "server.conf" if auth else None
        if config is not None and not config.exists():
            raise ConfigError(f"{config} does not exist: run `mlscope auth init --out {auth}`")
        self.nats = NatsServer(
            store_dir=settings.data_dir / "nats", port=nats_port, host=host, config_file=config
        )
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, before_services: Callable[[Settings], object] | None = None) -> Settings:
        """Start everything; returns the settings a client uses (with the auth
        directory, the submitter's credentials). ``before_services`` runs once
        nats-server is up and before the server and agents start, with the server's
        settings (every JetStream right): work it does cannot overlap a job."""
        self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        agents = self._agents()
        self.nats.start()
        self.settings = self.settings.with_(nats_url=self.nats.url)
        if before_services is not None:
            before_services(self._role_settings("server"))
        py = [sys.executable, "-m", "cli.main"]
        self.children["server"] = subprocess.Popen(
            [*py, "server"],
            env=self._env("server"),
            start_new_session=True,
            preexec_fn=ends_with_this_process(),
        )
        if self.auth is not None:
            # Agents may only read stream information: the server creates the streams.
            anyio.run(wait_provisioned, self._role_settings("server"), backend="asyncio")
        for name, fw, agent_id, creds in agents:
            extra = ["--agent-id", agent_id] if agent_id else []
            env = (
                {**os.environ, **self.settings.with_(nats_creds=creds).as_env()}
                if creds
                else self._env("agent")
            )
            self.children[name] = subprocess.Popen(
                [*py, "agent", "--framework", fw, *extra],
                env=env,
                start_new_session=True,
                preexec_fn=ends_with_this_process(),
            )
        return self._role_settings("submitter")

    def _agents(self) -> list[tuple[str, str, str | None, Path | None]]:
        """(child name, framework, agent id, credentials) of each agent. With ``auth``
        every agent gets its own user (``mlscope auth add-agent``), issued before the
        nats-server starts and reads its configuration."""
        out: list[tuple[str, str, str | None, Path | None]] = []
        host = names.token(socket.gethostname())
        for fw in self.frameworks:
            for n in range(self.per_framework):
                name = f"agent:{fw}" + (f":{n}" if n else "")
                if self.auth is None:
                    out.append((name, fw, None, None))
                    continue
                agent_id = names.token(f"{host}-{fw}" + (f"-{n}" if n else ""))
                creds = add_agent(self.auth, agent_id, frameworks=[fw]).resolve()
                out.append((name, fw, agent_id, creds))
        return out

    def _role_settings(self, role: str) -> Settings:
        if self.auth is None:
            return self.settings
        return self.settings.with_(nats_creds=(self.auth / f"{role}.creds").resolve())

    def _env(self, role: str) -> dict[str, str]:
        return {**os.environ, **self._role_settings(role).as_env()}

    def dead(self) -> list[str]:
        return [name for name, p in self.children.items() if p.poll() is not None]

    def stop(self, timeout: float = 15.0) -> None:
        for p in self.children.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.children.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.nats.stop()


async def wait_provisioned(settings: Settings, timeout: float = 60.0) -> None:
    """Until the server has created the streams and buckets."""
    from mlscope import bus as busmod
    from mlscope import names
    from mlscope.errors import BusError

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with busmod.connect(settings, name="mlscope up") as bus:
                with busmod.bus_errors("the server has not provisioned JetStream"):
                    await bus.js.stream_info(names.TRACES_STREAM)
                await bus.kv(names.AGENTS_BUCKET)
                await bus.kv(names.MODELS_BUCKET)
                return
        except BusError:
            await anyio.sleep(0.2)
    raise ConfigError(f"the server did not provision JetStream within {timeout:g} s")
