"""What an evaluation leaves in the database: its query rows, then its evaluation row
(a stored evaluation row means its evaluation is whole); each run of a sweep or search
on its own, under the id its queries named (so its spans are its own), a cancelled
one's too as far as it got (:mod:`broker.cancel`); and the removal of what an
unfinished attempt stored."""

from __future__ import annotations

import functools
import json
from datetime import UTC, datetime
from typing import Any

import anyio
import numpy as np

from broker import scenario
from broker.db import EVALUATION_COLUMNS, QUERY_COLUMNS, Database
from broker.evalsummary import Summarizer
from broker.run import Run
from mlscope import schema
from mlscope.contracts import EvaluationSummary
from mlscope.outcomes import Outcome
from mlscope.record import RunRecord

__all__ = [
    "ATTEMPT_TABLES",
    "LOST",
    "forget_attempt",
    "store_evaluation",
    "store_runs",
    "store_separate",
]

ATTEMPT_TABLES = tuple(
    t.name
    for t in (
        schema.QUERIES,
        schema.SPANS,
        schema.SYSTEM_SAMPLES,
        schema.OUTPUTS,
        schema.MLPERF_LOGS,
        schema.EVALUATIONS,
    )
)
"""Every table that holds an evaluation's rows under its id."""
LOST = "lost in transit: no reply before the run ended"
"""The error stored for a query that never got an answer (no agent known lost)."""


def store_evaluation(
    db: Database,
    s: EvaluationSummary,
    rec: RunRecord | None,
    spec_doc: dict[str, Any],
    *,
    t0_ns: int | None = None,
) -> None:
    """The evaluation row, and its query rows when ``rec`` is given (a sweep's
    parent has none: its runs are stored on their own; ``t0_ns`` is then its
    first run's). A lost query's error names the lost agent when it was. The
    query rows go first: a stored evaluation row means its evaluation is whole."""
    if rec is not None and rec.n:
        db.insert("queries", [list(c) for c in _query_columns(s, rec)], QUERY_COLUMNS)
    row = [
        s.evaluation_id,
        s.job_id,
        spec_doc["job"].get("rerun_of") or "",
        datetime.fromtimestamp(s.started_at, UTC),
        s.model["name"],
        s.model["version"],
        s.framework["name"],
        s.framework["version"],
        s.agent_id,
        s.host,
        s.device,
        str(s.scenario["name"]),
        s.trace_level,
        s.status,
        int(s.valid),
        t0_ns if t0_ns is not None else rec.t0_ns if rec else 0,
        s.clock_offset_ns,
        json.dumps(spec_doc, default=str),
        s.model_dump_json(by_alias=True),
    ]
    db.insert("evaluations", [[v] for v in row], EVALUATION_COLUMNS)


def _query_columns(s: EvaluationSummary, rec: RunRecord) -> list[Any]:
    """The query rows of ``rec``, column by column: a lost query's error names the lost
    agent when it was."""
    outcomes = rec.outcomes()
    lost = next(
        (r for r in s.invalid_reasons if r.startswith("agent ") and " lost after " in r), ""
    )
    why = f"lost: {lost}" if lost else LOST
    err = [rec.errors.get(i) or (why if outcomes[i] == Outcome.LOST else "") for i in range(rec.n)]
    return [
        [s.evaluation_id] * rec.n,
        np.arange(rec.n, dtype=np.uint32),
        [rec.batch_size] * rec.n,
        rec.scheduled,
        rec.issued,
        rec.completed,
        rec.agent_received,
        rec.predict_start,
        rec.predict_end,
        rec.agent_replied,
        rec.ok,
        err,
        rec.correct,
        rec.prediction,
        rec.outcomes(),
        (~rec.measured()).astype(np.uint8),
        rec.paced,
    ]


async def store_runs(
    db: Database,
    summarize: Summarizer,
    summary: EvaluationSummary,
    outcome: scenario.Outcome,
    spec_doc: dict[str, Any],
) -> None:
    """Each run of a sweep or search that has its own id on its own (its spans are
    under that id too), then the parent (with the query rows of a single run)."""
    separate = outcome.separate(summary.evaluation_id)
    await store_separate(db, summarize, separate, spec_doc)
    # A parent of several runs has no query rows and no spans of its runs (each run's
    # are under its own id); its t0 is its first run's, the zero of its own timeline:
    # the system samples its agent took before the first run's first query (and
    # during an accuracy pass after the last), on the clock its runs' rows share.
    main = outcome.main
    t0 = separate[0].record.t0_ns if separate else main.record.t0_ns
    await anyio.to_thread.run_sync(
        functools.partial(
            store_evaluation,
            db,
            summary,
            None if separate else main.record,
            spec_doc,
            t0_ns=t0,
        )
    )


async def store_separate(
    db: Database, summarize: Summarizer, runs: list[Run], spec_doc: dict[str, Any]
) -> None:
    """Each of ``runs`` (runs with their own id: a sweep's, a search's) as its own
    evaluation, with its verdict and its query rows: every run of a finished one, and
    those a cancelled one finished before its cancel (:mod:`broker.cancel`)."""
    for run in runs:
        await anyio.to_thread.run_sync(store_evaluation, db, summarize(run), run.record, spec_doc)


def forget_attempt(db: Database, eval_id: str) -> None:
    """Delete what an earlier, unfinished attempt of ``eval_id`` stored (its job
    was redelivered after the server running it was lost): its query rows, spans,
    samples, outputs and logs, and those of its sweep's or search's runs
    (``<eval_id>-<k>``: their query rows and spans, samples the agent took during
    them, their evaluation rows when stored). A run stores rows by query index, so
    the indices the new attempt does not reach would otherwise keep the lost
    attempt's rows."""
    present = {
        str(r[0])
        for r in db.rows(  # some are made by their first row (MLPerf's logs)
            "SELECT name FROM system.tables WHERE database = currentDatabase() "
            "AND name IN {t:Array(String)}",
            {"t": list(ATTEMPT_TABLES)},
        )
    }
    for table in (t for t in ATTEMPT_TABLES if t in present):
        db.command(
            f"DELETE FROM {table} WHERE evaluation_id = {{e:String}} "
            "OR startsWith(evaluation_id, {p:String})",
            {"e": eval_id, "p": f"{eval_id}-"},
        )
