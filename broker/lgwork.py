"""The work bucket of distributed load and what travels through it.

The server puts each dealt slice of a run over load-generator services
(:mod:`broker.multihost`) into the object store ``mlscope_loadgen_work``
(:func:`pack_slice`), a service reads it back, refused unless a run could have it
(:func:`unpack_slice`), and puts its slice's raw arrays there under
:func:`result_name`. Both sides open the bucket with :func:`work_bucket`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from nats.js.object_store import ObjectStore

from mlscope import codec, names
from mlscope.bus import Bus
from mlscope.contracts import MAX_BATCH, MAX_DURATION_S, MAX_SCHEDULED_QUERIES
from mlscope.errors import ConfigError, WireError
from mlscope.provision import object_store
from mlscope.schedule import Schedule

__all__ = ["SLICE_KEYS", "WORK_TTL_S", "pack_slice", "result_name", "unpack_slice", "work_bucket"]

WORK_TTL_S = 3600.0
"""Slices and results left behind by a run that died expire after this long."""


async def work_bucket(bus: Bus, *, replicas: int = 1) -> ObjectStore:
    """The object store that carries slices and results, created when missing with
    ``replicas`` (``MLSCOPE_JS_REPLICAS``: the server makes it at start, a
    load-generator service if it comes first)."""
    return await object_store(
        bus,
        names.LOADGEN_WORK_BUCKET,
        description="dealt schedule slices and their results (distributed load)",
        replicas=replicas,
        ttl_s=WORK_TTL_S,
    )


def pack_slice(part: Schedule, payloads: list[bytes], labels: np.ndarray | None) -> bytes:
    """One dealt slice: offsets, global indices, each query's bytes, labels (or None)."""
    return codec.encode(
        {
            "offsets": part.offsets_ns,
            "index": part.index,
            "samples_per_query": part.samples_per_query,
            "payloads": payloads,
            "labels": labels,
        }
    )


SLICE_KEYS = frozenset({"offsets", "index", "samples_per_query", "payloads", "labels"})
"""The members of a packed slice (:func:`pack_slice`)."""


def unpack_slice(data: bytes) -> tuple[Schedule, list[bytes], np.ndarray | None]:
    """A dealt slice as the server packed it, refused unless a run could have it.

    Anyone who may write the work bucket can put a slice there: one not shaped as
    :func:`pack_slice` makes it (members, integer offsets and indices, a payload of
    bytes and a label row per query) is a WireError; one with more than a run's queries,
    or spread over more than a run's duration (its last query years away would hold its
    service for good), is a ConfigError."""
    doc = codec.decode(data)
    if not isinstance(doc, dict) or set(doc) != SLICE_KEYS:
        raise WireError(f"a slice is a map of {', '.join(sorted(SLICE_KEYS))}")
    spq, payloads = doc["samples_per_query"], doc["payloads"]
    if type(spq) is not int:
        raise WireError("a slice's samples_per_query is not an integer")
    if not isinstance(payloads, list) or not all(isinstance(p, bytes) for p in payloads):
        raise WireError("a slice's payloads are not a list of bytes")
    sched = Schedule(_integers(doc, "offsets"), spq, _integers(doc, "index"))
    if len(sched) > MAX_SCHEDULED_QUERIES or sched.duration_s > MAX_DURATION_S:
        raise ConfigError(
            f"a slice of {len(sched):,} queries over {sched.duration_s:.3g} s: over what one "
            f"run may have ({MAX_SCHEDULED_QUERIES:,} queries, {MAX_DURATION_S:.0f} s)"
        )
    if sched.samples_per_query > MAX_BATCH:
        raise ConfigError(f"a slice's samples_per_query is over {MAX_BATCH:,}")
    if len(payloads) != len(sched):
        raise ConfigError(f"a slice of {len(payloads)} payloads for {len(sched)} queries")
    labels = doc["labels"]
    if labels is None:
        return sched, payloads, None
    if not (
        isinstance(labels, np.ndarray)
        and labels.ndim >= 1
        and labels.shape[0] == len(sched)
        and labels.dtype.kind in "iufb"
    ):
        raise WireError(
            f"a slice's labels are not a numeric row for each of its {len(sched)} queries"
        )
    return sched, payloads, labels


def _integers(doc: dict[str, Any], name: str) -> np.ndarray:
    """``doc[name]`` as a one-dimensional array of integers (a WireError otherwise)."""
    value = doc[name]
    arr = value if isinstance(value, np.ndarray) else None
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise WireError(f"a slice's {name} are not a one-dimensional array of integers")
    return arr


def result_name(run_id: str, j: int) -> str:
    """The work-bucket object in which slice ``j`` of run ``run_id`` puts its arrays."""
    return f"{run_id}/result-{j}"
