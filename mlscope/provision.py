"""What the stack keeps on JetStream: its streams, its buckets, object stores, and the
trace stream's sources at edge leaf nodes.

:func:`ensure_infrastructure` creates what is missing of every stream and bucket (a
service connects with :func:`provisioned`); :func:`object_store` and :func:`attach_edge` make the
rest on first use. It calls nats-py inside :func:`mlscope.bus.bus_errors`, where its
exceptions become mlscope's.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from nats.js.api import (
    DiscardPolicy,
    ExternalStream,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamSource,
    SubjectTransform,
)
from nats.js.object_store import ObjectStore

from mlscope import names
from mlscope.bus import Bus, bus_errors, connect, if_found
from mlscope.errors import BusRefused
from mlscope.settings import Settings

__all__ = [
    "AGENT_TRACE_BATCHES",
    "AGENT_TTL_S",
    "CANCELS_MAX_BYTES",
    "CANCEL_MAX_MSG_BYTES",
    "EDGE_TRACES_STREAM",
    "JOB_MAX_BYTES",
    "TRACE_BATCH_MAX_BYTES",
    "attach_edge",
    "ensure_infrastructure",
    "find_object_store",
    "object_store",
    "provisioned",
]

AGENT_TTL_S = 5.0
"""Registry entries expire this long after their last heartbeat (SIGKILL bound)."""
TRACES_MAX_AGE_S = 7 * 24 * 3600.0
TRACES_MAX_BYTES = 2 << 30
"""Byte cap of the traces stream: ~5 h at 500 QPS traced at model level; the ingester
normally takes batches within a second. Past it new batches are refused (never an
older batch not yet stored)."""
TRACE_BATCH_MAX_BYTES = 1 << 20
"""The largest span or sample batch the traces stream takes (nats-server's default max
payload; the tracer splits a batch to fit)."""
AGENT_TRACE_BATCHES = 8192
"""Each agent's trace budget: batches of its own not yet stored that the traces stream
holds (the ingester purges what it stored every ~10 s, which frees the budget). One
more is refused, to that agent only: an agent flooding its own subject with small
batches cannot push out another's spans. The server's ingester waits out each load, so
a traced run's batches wait in the stream while it runs: 8,192 batches are ~34 min of
one evaluation's spans (a batch per 0.25 s flush), ~800 MB at model level. The budget
counts batches, not bytes: at full size (:data:`TRACE_BATCH_MAX_BYTES`) one agent can
fill :data:`TRACES_MAX_BYTES`, and then every agent's new batches are refused, counted
and reported, never older ones dropped."""
DEAD_MAX_BYTES = 256 << 20
DEAD_MAX_AGE_S = 30 * 24 * 3600.0
"""Dead letters are kept for the operator (``mlscope doctor``) a month, 256 MiB at most."""
EDGE_TRACES_STREAM = "MLSCOPE_EDGE_TRACES"
"""The stream on an edge device's leaf node that buffers its span batches."""

CANCELS_TTL_S = 7 * 24 * 3600.0
"""How long a cancel request of a job no server ran is kept (``mlscope_cancels``)."""
CANCELS_MAX_BYTES = 32 << 20
"""Most bytes the remembered cancels take together (~100k of them); past it the
oldest are forgotten first: any submitter may cancel any id, so a storm of cancels of
jobs that never existed would otherwise grow the bucket for a week."""
CANCEL_MAX_MSG_BYTES = 4096
"""Largest remembered cancel (its reason is cut at 1,024 bytes)."""
JOB_MAX_BYTES = 1 << 20
"""The largest job the job stream stores (a replay schedule of ~100k arrivals)."""


@asynccontextmanager
async def provisioned(settings: Settings, *, name: str) -> AsyncIterator[Bus]:
    """A connection (:func:`mlscope.bus.connect`) to a bus holding every stream and
    bucket of the stack: what was missing is made first."""
    async with connect(settings, name=name) as bus:
        await ensure_infrastructure(bus, replicas=settings.js_replicas)
        yield bus


async def ensure_infrastructure(bus: Bus, *, replicas: int = 1) -> None:
    """Create what is missing of every stream and bucket; idempotent.

    An existing stream is updated only when its subjects, subject transform, limits,
    discard policy or replicas differ
    (its edge sources are kept), so a process whose credentials may only read stream
    information (an agent) passes through without touching anything.
    """
    with bus_errors("cannot provision JetStream"):
        for cfg in _streams(replicas):
            await _ensure_stream(bus, cfg)
        for kv in _buckets(replicas):
            await _ensure_bucket(bus, kv)
        await _bound_cancels(bus)


def _streams(replicas: int) -> list[StreamConfig]:
    """The jobs' work queue, the span batches and the dead letters."""
    return [
        StreamConfig(
            name=names.JOBS_STREAM,
            subjects=[names.JOBS_SUBJECT],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_msg_size=JOB_MAX_BYTES,
        ),
        _traces_stream(replicas),
        StreamConfig(
            name=names.DEAD_STREAM,
            subjects=[names.dead_letters_wildcard()],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=DEAD_MAX_AGE_S,
            max_bytes=DEAD_MAX_BYTES,
            num_replicas=replicas,
        ),
    ]


def _traces_stream(replicas: int) -> StreamConfig:
    """Span and sample batches, stored per agent (:func:`mlscope.names.stored_traces`)
    within each agent's budget (:data:`AGENT_TRACE_BATCHES`)."""
    src, dest = names.STORED_TRACES_TRANSFORM
    return StreamConfig(
        name=names.TRACES_STREAM,
        subjects=[src],
        subject_transform=SubjectTransform(src=src, dest=dest),
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=True,
        max_msgs_per_subject=AGENT_TRACE_BATCHES,
        max_msg_size=TRACE_BATCH_MAX_BYTES,
        max_age=TRACES_MAX_AGE_S,
        max_bytes=TRACES_MAX_BYTES,
        num_replicas=replicas,
        duplicate_window=120.0,
    )


def _buckets(replicas: int) -> list[KeyValueConfig]:
    """The agent registry, the models' manifests and the remembered cancels."""
    return [
        KeyValueConfig(bucket=names.AGENTS_BUCKET, ttl=AGENT_TTL_S, history=1, replicas=replicas),
        KeyValueConfig(bucket=names.MODELS_BUCKET, history=5, replicas=replicas),
        KeyValueConfig(
            bucket=names.CANCELS_BUCKET, ttl=CANCELS_TTL_S, history=1, replicas=replicas
        ),
    ]


async def _ensure_stream(bus: Bus, cfg: StreamConfig) -> None:
    """Create the stream, or update it where its subjects, transform, limits, discard
    policy or replicas differ from ``cfg`` (keeping its sources: the stream's transform
    applies to sourced batches as well)."""
    info = await if_found(bus.js.stream_info(str(cfg.name)))
    if info is None:
        await _create_once(
            functools.partial(bus.js.add_stream, cfg),
            functools.partial(bus.js.stream_info, str(cfg.name)),
        )
        return
    have = info.config
    if (
        sorted(have.subjects or []) != sorted(cfg.subjects or [])
        or (have.num_replicas or 1) != (cfg.num_replicas or 1)
        or (have.max_msg_size or -1) != (cfg.max_msg_size or -1)
        or (have.max_age or 0.0) != (cfg.max_age or 0.0)
        or (have.max_bytes or -1) != (cfg.max_bytes or -1)
        or (have.discard or DiscardPolicy.OLD) != (cfg.discard or DiscardPolicy.OLD)
        or bool(have.discard_new_per_subject) != bool(cfg.discard_new_per_subject)
        or (have.max_msgs_per_subject or -1) != (cfg.max_msgs_per_subject or -1)
        or _transform(have) != _transform(cfg)
    ):
        cfg.sources = have.sources
        await bus.js.update_stream(cfg)


def _transform(cfg: StreamConfig) -> tuple[str, str] | None:
    t = cfg.subject_transform
    return None if t is None else (t.src, t.dest)


async def _ensure_bucket(bus: Bus, kv: KeyValueConfig) -> None:
    """Create the bucket when missing (an existing one is left as it is)."""
    if await if_found(bus.js.key_value(kv.bucket)) is None:
        await _create_once(
            functools.partial(bus.js.create_key_value, kv),
            functools.partial(bus.js.key_value, kv.bucket),
        )


async def _create_once(
    create: Callable[[], Awaitable[Any]], exists: Callable[[], Awaitable[Any]]
) -> None:
    """Create a stream or bucket found missing, or take it as created when another
    process provisioning the same bus at the same time got there first (``mlscope up``
    starts the server and its agents at once): JetStream refuses the second create
    when the first one's stream was updated since (the cancels bucket's bound), and
    then ``exists`` must find it (else the refusal stands)."""
    try:
        with bus_errors("cannot provision JetStream"):
            await create()
    except BusRefused:
        if await if_found(exists()) is None:
            raise


async def _bound_cancels(bus: Bus) -> None:
    """The cancels bucket's stream keeps at most :data:`CANCELS_MAX_BYTES`, dropping
    the oldest (a key-value bucket refuses new values when full, which would refuse
    the next real cancel instead); updated only when it differs."""
    cfg = (await bus.js.stream_info(f"KV_{names.CANCELS_BUCKET}")).config
    if (
        cfg.max_bytes != CANCELS_MAX_BYTES
        or cfg.discard != DiscardPolicy.OLD
        or cfg.max_msg_size != CANCEL_MAX_MSG_BYTES
    ):
        cfg.max_bytes, cfg.discard = CANCELS_MAX_BYTES, DiscardPolicy.OLD
        cfg.max_msg_size = CANCEL_MAX_MSG_BYTES
        await bus.js.update_stream(cfg)


async def attach_edge(bus: Bus, domain: str, agent_id: str | None) -> None:
    """Make the hub's trace stream source the span buffer of the edge leaf ``domain``,
    whose agent runs as ``agent_id``.

    The hub pulls from the leaf's ``MLSCOPE_EDGE_TRACES`` stream through the JetStream
    domain ``domain``; while the link is down the leaf keeps the batches, and the
    source resumes where it stopped when the link returns. The device owns its leaf, so
    its buffer takes any subject published there: the source takes only
    ``agent_id``'s trace subjects (:func:`mlscope.names.agent_traces`), the ones its
    edge user may publish, so the device cannot store spans under another agent's id
    (None, on a bus without credentials where no user is bound to an id: any agent's).
    Idempotent; an existing source of ``domain`` that takes anything else (unfiltered,
    or another agent) is replaced.
    """
    api = f"$JS.{domain}.API"
    source = StreamSource(
        name=EDGE_TRACES_STREAM,
        filter_subject=names.agent_traces(names.token(agent_id) if agent_id else "*"),
        external=ExternalStream(api=api),
    )
    with bus_errors(f"cannot attach edge domain {domain}", domain=domain):
        cfg = (await bus.js.stream_info(names.TRACES_STREAM)).config
        sources = list(cfg.sources or [])
        others = [s for s in sources if not (s.external and s.external.api == api)]
        if len(others) < len(sources) and all(
            s.filter_subject == source.filter_subject and not s.subject_transforms
            for s in sources
            if s not in others
        ):
            return
        cfg.sources = [*others, source]
        await bus.js.update_stream(cfg)


async def find_object_store(bus: Bus, name: str) -> ObjectStore | None:
    """The JetStream object store ``name``; None when it does not exist."""
    with bus_errors(f"cannot open the object store {name}"):
        return await if_found(bus.js.object_store(name))


async def object_store(
    bus: Bus, name: str, *, description: str, replicas: int = 1, ttl_s: float | None = None
) -> ObjectStore:
    """The JetStream object store ``name``, created when missing."""
    found = await find_object_store(bus, name)
    if found is not None:
        return found
    config = ObjectStoreConfig(  # nats-py overwrites config.bucket with its argument
        bucket=name,
        storage=StorageType.FILE,
        replicas=replicas,
        description=description,
        ttl=ttl_s,
    )
    with bus_errors(f"cannot create the object store {name}"):
        return await bus.js.create_object_store(name, config)
