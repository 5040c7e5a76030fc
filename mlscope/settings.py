"""Settings read from the environment, once, at a service's entry point.

Nothing reads the environment elsewhere; settings are passed down explicitly.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from mlscope.errors import ConfigError

__all__ = ["DEFAULT_JOB_ACK_WAIT_S", "DEFAULT_LOADGEN_READY_S", "Settings"]

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_DATA_DIR = Path("~/.mlscope").expanduser()
DEFAULT_LOADGEN_READY_S = 60.0
DEFAULT_JOB_ACK_WAIT_S = 15.0
MIN_JOB_ACK_WAIT_S, MAX_JOB_ACK_WAIT_S = 1.0, 3600.0
MAX_SQL_TIMEOUT_S = 86400.0
"""A day: ClickHouse refuses a ``max_execution_time`` whose microseconds overflow."""


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
    nats_inbox_prefix: str | None = None
    """Subject prefix of this client's reply inboxes (``MLSCOPE_NATS_INBOX_PREFIX``);
    default: the role's prefix that ``mlscope auth init`` recorded for ``nats_creds``,
    else NATS's ``_INBOX`` (see mlscope.auth)."""
    manifests_dir: Path | None = None
    """Extra trusted manifest directory (``MLSCOPE_MANIFESTS``)."""
    trace_retention_days: int | None = None
    """Days spans, system samples and agent history are kept
    (``MLSCOPE_TRACE_RETENTION_DAYS``); None: forever."""
    nats_tls_ca: Path | None = None
    """CA bundle that signed the NATS servers' certificates (``MLSCOPE_NATS_TLS_CA``)."""
    nats_tls_cert: Path | None = None
    """Client certificate for mutual TLS (``MLSCOPE_NATS_TLS_CERT``)."""
    nats_tls_key: Path | None = None
    """Key of the client certificate (``MLSCOPE_NATS_TLS_KEY``)."""
    js_replicas: int = 1
    """JetStream replicas of every stream and bucket (``MLSCOPE_JS_REPLICAS``): 3 on a
    3-node cluster."""
    js_domain: str | None = None
    """JetStream domain of the hub (``MLSCOPE_JS_DOMAIN``): set on an edge device whose
    leaf node has its own JetStream, so that registry and job operations reach the hub."""
    allow_custom_code: bool = False
    """Let an agent run the custom Python steps (``{python: {module, function}}``) of
    manifests loaded from its trusted local directories (``MLSCOPE_ALLOW_CUSTOM_CODE``;
    off by default). A manifest received over the bus never runs custom code."""
    clickhouse_read_dsn: str | None = None
    """DSN of the connections that run clients' SQL (``MLSCOPE_CLICKHOUSE_READ_DSN``):
    with a ClickHouse server, a user whose profile is read-only with the read limits as
    constraints; default: ``dsn`` (the limits and ``readonly`` as session settings)."""
    sql_timeout_s: float = 10.0
    """Longest a client's SQL on ``mlscope.db.sql`` may run before the database cancels
    it (``MLSCOPE_SQL_TIMEOUT_S``, at most ``MAX_SQL_TIMEOUT_S``; ``max_execution_time``,
    see broker.readonly)."""
    loadgen_ready_s: float = DEFAULT_LOADGEN_READY_S
    """Longest a server waits for the load-generator processes of a job with
    ``loadgens`` > 1 to say they are ready (``MLSCOPE_LOADGEN_READY_S``): one that is not
    fails the job, naming it. Raise it on a host where starting Python is slow."""
    job_ack_wait_s: float = DEFAULT_JOB_ACK_WAIT_S
    """How long a job taken by a server that stopped answering waits before JetStream
    gives it to another server (``MLSCOPE_JOB_ACK_WAIT_S``; from ``MIN_JOB_ACK_WAIT_S``
    to ``MAX_JOB_ACK_WAIT_S``): the failover time of a job. A running job's server renews
    its hold five times per period. Every server on a bus should use the same value:
    each sets it on the shared job consumer when it starts."""
    artifact_url_prefixes: tuple[str, ...] = ()
    """http(s) URL prefixes that manifests from the bus may download artifacts from
    (``MLSCOPE_ARTIFACT_URL_PREFIXES``, comma-separated; none by default: bus manifests
    then name only the bus's artifact store). See mlscope.fetchpolicy."""
    max_artifact_bytes: int = 4 << 30
    """Ceiling on any one download, whatever a manifest declares
    (``MLSCOPE_MAX_ARTIFACT_BYTES``; 4 GiB)."""
    scenario_modules: tuple[str, ...] = ()
    """Modules that declare scenarios of their own (``MLSCOPE_SCENARIO_MODULES``,
    comma-separated import names), imported by every process the CLI starts so that
    the submitter, the server and the agents know the same scenarios; see
    mlscope.scenario_traits. None by default: the built-in ones only."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        data_dir = Path(env.get("MLSCOPE_DATA_DIR", "~/.mlscope")).expanduser()
        creds = env.get("MLSCOPE_NATS_CREDS")
        manifests = env.get("MLSCOPE_MANIFESTS")

        def path(var: str) -> Path | None:
            value = env.get(var)
            return Path(value).expanduser() if value else None

        return cls(
            nats_url=env.get("MLSCOPE_NATS_URL", DEFAULT_NATS_URL),
            data_dir=data_dir,
            clickhouse_dsn=env.get("MLSCOPE_CLICKHOUSE_DSN") or None,
            nats_creds=Path(creds).expanduser() if creds else None,
            nats_inbox_prefix=env.get("MLSCOPE_NATS_INBOX_PREFIX") or None,
            manifests_dir=Path(manifests).expanduser() if manifests else None,
            trace_retention_days=_whole(env, "MLSCOPE_TRACE_RETENTION_DAYS", None, low=0),
            nats_tls_ca=path("MLSCOPE_NATS_TLS_CA"),
            nats_tls_cert=path("MLSCOPE_NATS_TLS_CERT"),
            nats_tls_key=path("MLSCOPE_NATS_TLS_KEY"),
            js_replicas=_whole(env, "MLSCOPE_JS_REPLICAS", 1, low=1) or 1,
            js_domain=env.get("MLSCOPE_JS_DOMAIN") or None,
            allow_custom_code=_flag(env, "MLSCOPE_ALLOW_CUSTOM_CODE"),
            clickhouse_read_dsn=env.get("MLSCOPE_CLICKHOUSE_READ_DSN") or None,
            sql_timeout_s=_number(env, "MLSCOPE_SQL_TIMEOUT_S", 10.0, high=MAX_SQL_TIMEOUT_S),
            loadgen_ready_s=_number(env, "MLSCOPE_LOADGEN_READY_S", DEFAULT_LOADGEN_READY_S),
            job_ack_wait_s=_number(
                env,
                "MLSCOPE_JOB_ACK_WAIT_S",
                DEFAULT_JOB_ACK_WAIT_S,
                low=MIN_JOB_ACK_WAIT_S,
                high=MAX_JOB_ACK_WAIT_S,
            ),
            artifact_url_prefixes=_names(env, "MLSCOPE_ARTIFACT_URL_PREFIXES"),
            max_artifact_bytes=int(_number(env, "MLSCOPE_MAX_ARTIFACT_BYTES", 4 << 30)),
            scenario_modules=_names(env, "MLSCOPE_SCENARIO_MODULES"),
        )

    def with_(self, **changes: object) -> Settings:
        return replace(self, **changes)  # type: ignore[arg-type]

    @property
    def dsn(self) -> str:
        """The ClickHouse DSN in force: the explicit one, or chDB under the data dir."""
        return self.clickhouse_dsn or f"chdb:///{(self.data_dir / 'chdb').resolve()}"

    @property
    def nats_servers(self) -> list[str]:
        """The server URLs of ``nats_url`` (comma-separated: the nodes of a cluster)."""
        return [u.strip() for u in self.nats_url.split(",") if u.strip()]

    @property
    def artifact_dir(self) -> Path:
        return self.data_dir / "artifacts"

    @property
    def zoo_dir(self) -> Path:
        return self.data_dir / "zoo"

    def as_env(self) -> dict[str, str]:
        """The environment a child process needs to see these same settings (a setting
        at its default is left out, so the child applies the same default)."""
        values: tuple[tuple[str, object], ...] = (
            ("MLSCOPE_CLICKHOUSE_DSN", self.clickhouse_dsn),
            ("MLSCOPE_NATS_CREDS", self.nats_creds),
            ("MLSCOPE_MANIFESTS", self.manifests_dir),
            ("MLSCOPE_TRACE_RETENTION_DAYS", self.trace_retention_days),
            ("MLSCOPE_NATS_TLS_CA", self.nats_tls_ca),
            ("MLSCOPE_NATS_TLS_CERT", self.nats_tls_cert),
            ("MLSCOPE_NATS_TLS_KEY", self.nats_tls_key),
            ("MLSCOPE_JS_DOMAIN", self.js_domain),
            ("MLSCOPE_NATS_INBOX_PREFIX", self.nats_inbox_prefix),
            ("MLSCOPE_JS_REPLICAS", self.js_replicas if self.js_replicas != 1 else None),
            ("MLSCOPE_ALLOW_CUSTOM_CODE", "1" if self.allow_custom_code else None),
            ("MLSCOPE_CLICKHOUSE_READ_DSN", self.clickhouse_read_dsn),
            (
                "MLSCOPE_SQL_TIMEOUT_S",
                repr(self.sql_timeout_s) if self.sql_timeout_s != 10.0 else None,
            ),
            (
                "MLSCOPE_LOADGEN_READY_S",
                repr(self.loadgen_ready_s)
                if self.loadgen_ready_s != DEFAULT_LOADGEN_READY_S
                else None,
            ),
            (
                "MLSCOPE_JOB_ACK_WAIT_S",
                repr(self.job_ack_wait_s)
                if self.job_ack_wait_s != DEFAULT_JOB_ACK_WAIT_S
                else None,
            ),
            ("MLSCOPE_ARTIFACT_URL_PREFIXES", ",".join(self.artifact_url_prefixes)),
            ("MLSCOPE_SCENARIO_MODULES", ",".join(self.scenario_modules)),
            (
                "MLSCOPE_MAX_ARTIFACT_BYTES",
                self.max_artifact_bytes if self.max_artifact_bytes != 4 << 30 else None,
            ),
        )
        env = {"MLSCOPE_NATS_URL": self.nats_url, "MLSCOPE_DATA_DIR": str(self.data_dir)}
        env.update({var: str(value) for var, value in values if value})
        return env


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _names(env: Mapping[str, str], var: str) -> tuple[str, ...]:
    """A comma-separated list (blanks dropped)."""
    return tuple(p.strip() for p in env.get(var, "").split(",") if p.strip())


def _flag(env: Mapping[str, str], var: str) -> bool:
    value = env.get(var, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{var}={env[var]!r}: want one of {', '.join(_TRUE + _FALSE[1:])}", field=var)


def _number(
    env: Mapping[str, str], var: str, default: float, *, low: float = 0.0, high: float = math.inf
) -> float:
    """A finite number above 0, from ``low`` to ``high``, or ``default`` when the
    variable is unset or empty."""
    value = env.get(var, "").strip()
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{var}={value!r}: want a number", field=var) from None
    if not 0 < number < math.inf:
        raise ConfigError(f"{var}={value!r}: want a positive number", field=var)
    if not low <= number <= high:
        want = f"a number from {low:g}" if low else "a positive number"
        upto = f" to {high:g}" if high < math.inf else ""
        raise ConfigError(f"{var}={value!r}: want {want}{upto}", field=var)
    return number


def _whole(env: Mapping[str, str], var: str, default: int | None, *, low: int) -> int | None:
    """A whole number from ``low``, or ``default`` when the variable is unset or empty."""
    value = env.get(var, "").strip()
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{var}={value!r}: want a whole number", field=var) from None
    if number < low:
        raise ConfigError(f"{var}={value!r}: want a whole number from {low}", field=var)
    return number
