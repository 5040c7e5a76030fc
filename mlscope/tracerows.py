"""An evaluation's trace rows: the spans and system samples of the agent it ran on.

An agent publishes trace batches only on its own subjects, and the ingester stores a
batch only in the name of the agent whose subject it came on (``broker/ingest.py``).
The evaluation a batch names, though, is the agent's word: its credentials let it add
rows, in its own name, under any evaluation id. What an evaluation ran on is its
stored row's ``agent_id`` (one agent per evaluation: load spread over several load
generators still has one agent; each run of a sweep or search, ``<id>-<k>``, has a
row of its own; a job run again after a lost attempt stores the agent of the attempt
that finished). So every read of an evaluation's trace rows goes through
:func:`trace_rows`, which keeps the rows of that agent only, and the ingester refuses
a batch naming a stored evaluation of another agent (:data:`RAN_ON`).

An evaluation still running has no row yet: its trace rows are read as stored, every
agent's, until its row names the agent (nothing else in the cluster records it; the
server that deals the job may be another replica than the one reading or ingesting).
"""

from __future__ import annotations

__all__ = ["MANY", "ONE", "RAN_ON", "TRACE_TABLES", "trace_rows"]

ONE = "evaluation_id = {e:String}"
"""One evaluation: its id in the query parameter ``e``."""
MANY = "evaluation_id IN {ids:Array(String)}"
"""Several evaluations: their ids in the query parameter ``ids``."""
TRACE_TABLES = ("spans", "system_samples")
"""The tables an agent writes trace rows into, each with the agent's id per row."""
RAN_ON = "SELECT evaluation_id, agent_id FROM evaluations FINAL WHERE " + MANY
"""The agent each stored evaluation of ``ids`` ran on (evaluations not stored are not
listed)."""


def trace_rows(table: str, which: str = ONE) -> str:
    """``<table> FINAL WHERE ...``: the ``FROM`` and ``WHERE`` of a read of the trace
    rows (``table``: spans or system samples) of the evaluations ``which`` selects
    (:data:`ONE` or :data:`MANY`), each stored evaluation's of the agent its row
    names, and every agent's of one not stored yet. A reader may add ``AND ...``
    conditions, then ``GROUP BY``, ``ORDER BY`` or ``LIMIT``; ``FINAL`` hides a
    redelivered batch's repeat."""
    if table not in TRACE_TABLES:
        raise ValueError(f"not a trace table: {table!r} (one of {', '.join(TRACE_TABLES)})")
    if which not in (ONE, MANY):
        raise ValueError(f"which must be ONE or MANY, not {which!r}")
    stored = f"SELECT evaluation_id, agent_id FROM evaluations FINAL WHERE {which}"
    return (
        f"{table} FINAL WHERE {which} AND ((evaluation_id, agent_id) IN ({stored}) "
        f"OR evaluation_id NOT IN (SELECT evaluation_id FROM evaluations WHERE {which}))"
    )
