"""The raw per-query record of one run: every timestamp, kept, from which every figure
is derived (:mod:`broker.summary`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlscope.outcomes import Outcome, classify

__all__ = ["ARRAYS", "ROW_BYTES", "TIME_ARRAYS", "RunRecord"]

TIME_ARRAYS = (
    "scheduled",
    "paced",
    "issued",
    "completed",
    "agent_received",
    "predict_start",
    "predict_end",
    "agent_replied",
)
"""Per-query times (ns from t0, 0 where it did not happen)."""
ARRAYS = (*TIME_ARRAYS, "ok", "refused", "correct", "prediction")
"""Every per-query array of a :class:`RunRecord`."""
_DTYPES = {"ok": np.uint8, "refused": np.uint8, "correct": np.int32, "prediction": np.int32}
ROW_BYTES = sum(np.dtype(_DTYPES.get(name, np.int64)).itemsize for name in ARRAYS)
"""Bytes one query takes in a record's arrays (74): also the least a local run's row
takes in the columns that carry it to the server, which add its top-1."""


@dataclass
class RunRecord:
    """Raw per-query samples of one run (ns, load-generator clock, relative to t0).

    ``paced``: when the pacer thread released the query; ``issued``: when the event
    loop handed it to the bus client (the issue time every figure uses); a closed loop
    stamps both at once. ``refused``: the agent answered "overloaded". The first
    ``warmup`` queries are warm-up (kept, flagged, left out of statistics).
    """

    n: int
    batch_size: int
    t0_ns: int = 0
    warmup: int = 0
    scheduled: np.ndarray = field(init=False)
    paced: np.ndarray = field(init=False)
    issued: np.ndarray = field(init=False)
    completed: np.ndarray = field(init=False)
    agent_received: np.ndarray = field(init=False)
    predict_start: np.ndarray = field(init=False)
    predict_end: np.ndarray = field(init=False)
    agent_replied: np.ndarray = field(init=False)
    ok: np.ndarray = field(init=False)
    refused: np.ndarray = field(init=False)
    correct: np.ndarray = field(init=False)
    prediction: np.ndarray = field(init=False)
    errors: dict[int, str] = field(default_factory=dict)
    not_issued: int = 0
    done: int = 0
    time_up_ns: int = 0
    """A closed loop: when it found its duration up and issued no more (0: it ended for
    another reason: its query count, a stop, a failure). Its window lasts at least
    until then, though its last answer may have come just before."""
    cpu_s: float = 0.0
    """CPU time (s) the load generator used during the run: its own threads' (placement
    server: its pacer's and its query link's reader's; an agent's local run: its
    pacer's), not its process's (0 where not told apart)."""
    process_cpu_s: float | None = None
    """An agent's local run (placement agent): CPU time (s) of the agent's process
    during the run, model and load generator together; None for other runs."""
    sources: tuple[dict[str, Any], ...] = ()
    """Which load-generator service ran which slice (distributed load over services)."""
    preprocessed: bool = False
    """The samples were pre-processed before the clock started (held by the agent):
    no query's time includes pre-processing."""
    streamed: bool = False
    """The queries ran as one stream whose answers were post-processed in blocks: each
    query's completion waited for its block (``RunStarted.streamed``)."""

    def __post_init__(self) -> None:
        for name in ARRAYS:
            setattr(self, name, np.zeros(self.n, _DTYPES.get(name, np.int64)))
        self.prediction[:] = -1

    def trim(self, count: int) -> None:
        """Keep the first ``count`` queries (a closed loop stops when time is up)."""
        for name in ARRAYS:
            setattr(self, name, getattr(self, name)[:count])
        self.n = count

    def grow(self) -> None:
        """Double the room for queries (a closed loop that outran its first estimate)."""
        for name in ARRAYS:
            old = getattr(self, name)
            new = np.zeros(max(2 * self.n, 1), old.dtype)
            if name == "prediction":
                new[:] = -1
            new[: self.n] = old
            setattr(self, name, new)
        self.n = max(2 * self.n, 1)

    def drop(self, count: int) -> None:
        """Forget the first ``count`` queries (shipped), keeping the room: the rest move
        to the front (an agent's long closed loop holds only what it has not shipped)."""
        for name in ARRAYS:
            old = getattr(self, name)
            new = np.zeros(self.n, old.dtype)
            if name == "prediction":
                new[:] = -1
            new[: self.n - count] = old[count:]
            setattr(self, name, new)

    def outcomes(self) -> np.ndarray:
        """Each query's :class:`mlscope.outcomes.Outcome`."""
        return classify(
            issued=self.issued, completed=self.completed, ok=self.ok, refused=self.refused
        )

    def answered_ns(self) -> np.ndarray:
        """Each query's completion offset when the system answered it (with outputs or
        with an error), else 0: what the overload rule and the backlog count. A query
        refused as "overloaded" is not answered (it was never run), nor is a lost one;
        a failed one was (its failure is judged on its own)."""
        out = self.outcomes()
        answered = (out == Outcome.OK) | (out == Outcome.FAILED)
        done: np.ndarray = np.where(answered, self.completed, 0)
        return done

    def measured(self) -> np.ndarray:
        """Mask of the queries statistics count: all but the warm-up."""
        mask: np.ndarray = np.arange(self.n) >= self.warmup
        return mask
