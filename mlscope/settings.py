"""Settings read from the environment, once, at a service's entry point.

Nothing reads the environment elsewhere; settings are passed down explicitly.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["Settings"]

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_DATA_DIR = Path("~/.mlscope").expanduser()


@dataclass(frozen=True, kw_only=True)
class Settings:
    """Where mlscope finds its bus, its database and its files."""

    nats_url: str = DEFAULT_NATS_URL
    """NATS server URL (``MLSCOPE_NATS_URL``)."""
    data_dir: Path = DEFAULT_DATA_DIR
    """Root of the local state: nats store, chDB, artifact cache (``MLSCOPE_DATA_DIR``)."""
    clickhouse_dsn: str | None = None
    """clickhouse-connect DSN (``MLSCOPE_CLICKHOUSE_DSN``); default: chDB under data_dir."""
    nats_creds: Path | None = None
    """NATS credentials file (``MLSCOPE_NATS_CREDS``)."""
    manifests_dir: Path | None = None
    """Extra trusted manifest directory (``MLSCOPE_MANIFESTS``)."""
    trace_retention_days: int | None = None
    """Days spans, system samples and agent history are kept
    (``MLSCOPE_TRACE_RETENTION_DAYS``); None: forever."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        data_dir = Path(env.get("MLSCOPE_DATA_DIR", "~/.mlscope")).expanduser()
        creds = env.get("MLSCOPE_NATS_CREDS")
        manifests = env.get("MLSCOPE_MANIFESTS")
        return cls(
            nats_url=env.get("MLSCOPE_NATS_URL", DEFAULT_NATS_URL),
            data_dir=data_dir,
            clickhouse_dsn=env.get("MLSCOPE_CLICKHOUSE_DSN") or None,
            nats_creds=Path(creds).expanduser() if creds else None,
            manifests_dir=Path(manifests).expanduser() if manifests else None,
            trace_retention_days=int(env["MLSCOPE_TRACE_RETENTION_DAYS"])
            if env.get("MLSCOPE_TRACE_RETENTION_DAYS") else None,
        )

    def with_(self, **changes: object) -> Settings:
        return replace(self, **changes)  # type: ignore[arg-type]

    @property
    def dsn(self) -> str:
        """The ClickHouse DSN in force: the explicit one, or chDB under the data dir."""
        return self.clickhouse_dsn or f"chdb:///{(self.data_dir / 'chdb').resolve()}"

    @property
    def artifact_dir(self) -> Path:
        return self.data_dir / "artifacts"

    @property
    def zoo_dir(self) -> Path:
        return self.data_dir / "zoo"

    def as_env(self) -> dict[str, str]:
        """The environment a child process needs to see these same settings."""
        env = {"MLSCOPE_NATS_URL": self.nats_url, "MLSCOPE_DATA_DIR": str(self.data_dir)}
        if self.clickhouse_dsn:
            env["MLSCOPE_CLICKHOUSE_DSN"] = self.clickhouse_dsn
        if self.nats_creds:
            env["MLSCOPE_NATS_CREDS"] = str(self.nats_creds)
        if self.manifests_dir:
            env["MLSCOPE_MANIFESTS"] = str(self.manifests_dir)
        if self.trace_retention_days:
            env["MLSCOPE_TRACE_RETENTION_DAYS"] = str(self.trace_retention_days)
        return env
