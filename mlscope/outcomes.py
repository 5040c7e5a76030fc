"""What became of each query of a run: one definition, for the server and analysis alike.

Every scheduled query ends in exactly one of these (``Outcome``):

========== ======================================================================
ok         answered with outputs
failed     answered with an error: the model, the pre-processing or the agent
           failed on it
refused    answered "overloaded": the agent's queue was full and it never ran the
           query (:class:`mlscope.errors.OverloadedError`)
lost       issued, never answered (no reply before the load generator stopped
           waiting)
not issued scheduled, never sent: the load generator's outstanding-query bound was
           reached when it was due
========== ======================================================================

``errors`` in a summary is ``failed + refused + lost``: the issued queries that got no
answer with outputs. ``not issued`` is never an error of the system under test, but
either makes a run INVALID (:mod:`mlscope.validity`).

Warm-up queries (the first ``warmup_queries`` of a run) are classified like any other
and flagged apart: statistics leave them out, the stored rows keep them.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import numpy.typing as npt

__all__ = ["ERROR_OUTCOMES", "UNKNOWN_OUTCOME", "Outcome", "classify", "count", "was_sent"]


UNKNOWN_OUTCOME = 255
"""The stored ``queries.outcome`` of rows stored before outcomes were recorded: readers
classify those from their times (:func:`classify`)."""


class Outcome(IntEnum):
    """Stored in the ``queries.outcome`` column (UInt8)."""

    OK = 0
    FAILED = 1
    REFUSED = 2
    LOST = 3
    NOT_ISSUED = 4

    @property
    def label(self) -> str:
        return self.name.lower()


ERROR_OUTCOMES = (Outcome.FAILED, Outcome.REFUSED, Outcome.LOST)
"""Issued queries that got no answer with outputs: together, a summary's ``errors``."""


def classify(
    *,
    issued: npt.ArrayLike,
    completed: npt.ArrayLike,
    ok: npt.ArrayLike,
    refused: npt.ArrayLike | None = None,
) -> npt.NDArray[np.uint8]:
    """The :class:`Outcome` of every query from its raw columns.

    ``issued`` / ``completed``: ns offsets, 0 where it did not happen (a closed loop
    may issue at offset 0: a query with a completion counts as issued). ``ok``: answered
    with outputs. ``refused``: answered "overloaded" (None: no refusals known, as in
    rows stored before refusals were told apart, which then count as failed).
    """
    done = np.asarray(completed, np.int64)
    good = np.asarray(ok).astype(bool)
    out = np.full(done.shape, Outcome.NOT_ISSUED, np.uint8)
    sent = was_sent(issued, done)
    out[sent & (done == 0)] = Outcome.LOST
    out[sent & (done > 0)] = Outcome.FAILED
    if refused is not None:
        out[sent & (done > 0) & np.asarray(refused).astype(bool)] = Outcome.REFUSED
    out[sent & (done > 0) & good] = Outcome.OK
    return out


def was_sent(issued: npt.ArrayLike, completed: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """Which queries were sent: an issue time, or a completion (a closed loop may issue
    its first query at offset 0, so a completion alone says it was sent)."""
    sent: npt.NDArray[np.bool_] = (np.asarray(issued, np.int64) > 0) | (
        np.asarray(completed, np.int64) > 0
    )
    return sent


def count(outcomes: npt.ArrayLike) -> dict[str, int]:
    """``{"ok", "failed", "refused", "lost", "not_issued", "errors"}`` counts."""
    arr = np.asarray(outcomes, np.uint8)
    got = {o.label: int(np.count_nonzero(arr == o)) for o in Outcome}
    got["errors"] = sum(got[o.label] for o in ERROR_OUTCOMES)
    return got
