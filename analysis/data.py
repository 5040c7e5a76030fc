"""Loading evaluations into data frames (their per-query and span rows:
:mod:`analysis.rows`).

No statistics here: rows as stored, the summary JSON flattened into columns. A stored
``spec`` or ``summary`` is read by :func:`stored_json` alone: a listing
(:func:`find_evaluations`, :func:`evaluations` of all) shows a row whose JSON cannot be
read with what its columns say; a read of evaluations by id names the row instead.
Every figure flattened from a summary (a rate, a count, a duration, top-1) is a finite
float within :data:`MAX_FIGURE` or None, and ``batch_size`` a whole number in
1..:data:`MAX_BATCH` (1 otherwise): a string, a mapping or a huge integer in a stored
summary is missing, never a value that a page or a figure has to convert.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pandas as pd

from analysis.source import Source
from mlscope.bounded import MAX_DEPTH, json_depth
from mlscope.errors import DatabaseError, EvaluationNotFound

__all__ = [
    "COUNT_TYPES",
    "EVALUATION_FIELDS",
    "MEASURED_AS",
    "RunFilter",
    "evaluations",
    "find_evaluations",
    "latest_per_key",
    "stored_json",
    "stored_spec",
    "stored_summary",
    "with_sweep_runs",
]

# Columns of :func:`evaluations` (the flattened summary and specification).
EVALUATION_FIELDS = (
    "evaluation_id",
    "created_at",
    "model",
    "model_version",
    "framework",
    "framework_version",
    "agent_id",
    "host",
    "device",
    "system",
    "scenario",
    "batch_size",
    "requested_qps",
    "trace_level",
    "status",
    "valid",
    "invalid_reasons",
    "queries",
    "warmup_queries",
    "samples",
    "errors",
    "duration_s",
    "throughput_ips",
    "top1",
    "t0_ns",
    "clock_offset_ns",
    "rerun_of",
    "role",
    "runs",
    "parallel",
    "placement",
    "preprocess",
    "artifact_sha256",
    "peak_rss_mb",
    "rss_growth_mb",
    "energy_j",
    "host_other_cores",
)
"""``role``: ``run`` (one measured run with its queries) or ``sweep`` (the parent of a
batch-size sweep or rate search: the summary only, its runs stored on their own, their
ids in ``runs``). ``artifact_sha256``: the model file the agent loaded ("" when not
recorded). ``preprocess``: ``ahead`` when the samples were pre-processed before the
clock started, ``timed`` when inside each query's time. ``peak_rss_mb`` /
``rss_growth_mb``: the agent process's peak resident memory and its growth over the run
(MB); ``energy_j``: None unless a power source was read; ``host_other_cores``: the
cores other processes kept busy on the agent's host on average (None: not reported).
``queries``: every query the run sent, as the server stored it, warm-up included
(``warmup_queries`` of them; the figures of :func:`analysis.summary.summary` count the
others only)."""

COUNT_TYPES = dict.fromkeys(("queries", "warmup_queries", "samples", "errors"), "Int64")
"""The counts of :data:`EVALUATION_FIELDS`, as nullable integers: whole numbers in every
row (``17``, never ``17.0``), missing where a stored summary has none."""

MEASURED_AS = {"placement": "server", "preprocess": "timed"}
"""How a run was measured, beyond its scenario, and the value of each where a stored
summary does not say: ``placement`` (``server``: the server's load generator times
each query; ``agent``: the agent's own) and ``preprocess``. Runs that differ in
either are different measurements (not compared, never one row of a figure)."""


def _ids_clause(ids: Sequence[str] | None) -> tuple[str, dict[str, Any]]:
    if ids is None:
        return "", {}
    return " WHERE evaluation_id IN {ids:Array(String)}", {"ids": list(ids)}


_EVALUATION_SELECT = (
    "SELECT evaluation_id, created_at, model, model_version, framework, "
    "framework_version, agent_id, host, device, scenario, trace_level, status, valid, "
    "t0_ns, clock_offset_ns, rerun_of, spec, summary FROM evaluations FINAL"
)


def _frame_of(raw: pd.DataFrame, *, named: bool = False) -> pd.DataFrame:
    """The rows of :data:`_EVALUATION_SELECT` flattened; ``named``: the caller named
    these evaluations, so one whose stored JSON cannot be read is a DatabaseError."""
    rows = [_flatten(r, named=named) for r in raw.to_dict("records")]
    frame = pd.DataFrame(rows, columns=list(EVALUATION_FIELDS)).astype(COUNT_TYPES)
    frame["created_at"] = pd.to_datetime(frame["created_at"])
    return frame


def evaluations(source: Source, ids: Sequence[str] | None = None) -> pd.DataFrame:
    """One row per evaluation (all, or ``ids`` in the order given), newest first."""
    where, params = _ids_clause(ids)
    raw = source.frame(
        _EVALUATION_SELECT + where + " ORDER BY created_at DESC, evaluation_id", params
    )
    frame = _frame_of(raw, named=ids is not None)
    if ids is not None:
        missing = [i for i in ids if i not in set(frame["evaluation_id"])]
        if missing:
            raise EvaluationNotFound(
                f"no evaluation {', '.join(missing)}", evaluation_id=missing[0]
            )
        frame = frame.set_index("evaluation_id").loc[list(ids)].reset_index()
    return frame


def with_sweep_runs(
    source: Source, shown: pd.DataFrame, *, listed: pd.DataFrame | None = None
) -> pd.DataFrame:
    """``shown`` (rows of :func:`evaluations`) and, after them, the runs of the sweeps
    among them that ``shown`` lacks: a sweep's parent holds its summary only, its batch
    sizes or rates are its runs', so every surface that shows a sweep (``mlscope
    report``, the dashboard's Results page) shows them with it. ``listed``: rows of
    :func:`evaluations` already read (a listing of every evaluation): the runs are taken
    from there, and one that is not stored is left out; without it they are read, and
    one that is not stored is a :class:`~mlscope.errors.DatabaseError` naming it."""
    have = set(shown["evaluation_id"])
    extra = [r for r in dict.fromkeys(r for runs in shown["runs"] for r in runs) if r not in have]
    if not extra:
        return shown
    if listed is None:
        runs = evaluations(source, extra)
    else:
        runs = listed[listed["evaluation_id"].isin(extra)].drop_duplicates("evaluation_id")
    return pd.concat([shown, runs], ignore_index=True) if len(runs) else shown


@dataclass(frozen=True, kw_only=True)
class RunFilter:
    """Which evaluations :func:`find_evaluations` returns; ``None`` leaves a field open."""

    model: str | None = None
    """The model's name (any version)."""
    framework: str | None = None
    """The framework's name."""
    scenario: str | None = None
    """The scenario's name (``online``, ``batched``, ...)."""
    valid: bool | None = None
    """``True``: VALID completed runs only; ``False``: INVALID or not completed ones."""
    since: datetime | None = None
    """Created at or after this moment (UTC)."""
    limit: int | None = None
    """At most this many, the newest."""


def find_evaluations(source: Source, which: RunFilter) -> pd.DataFrame:
    """Evaluations matching ``which``, newest first (the columns of :func:`evaluations`).

    The filter runs in the database, so listing a few recent runs reads a few rows.
    A run is VALID only when it also completed: a cancelled run is never a valid one.
    """
    clauses: list[str] = []
    params: dict[str, Any] = {}
    for name in ("model", "framework", "scenario"):
        value = getattr(which, name)
        if value is not None:
            clauses.append(f"{name} = {{{name}:String}}")
            params[name] = value
    if which.valid is True:
        clauses.append("valid = 1 AND status = 'completed'")
    elif which.valid is False:
        clauses.append("NOT (valid = 1 AND status = 'completed')")
    if which.since is not None:
        clauses.append("created_at >= fromUnixTimestamp64Milli({since:Int64})")
        params["since"] = int(which.since.timestamp() * 1000)
    sql = _EVALUATION_SELECT
    if clauses:
        sql += " WHERE " + " AND ".join(clauses)
    sql += " ORDER BY created_at DESC, evaluation_id"
    if which.limit is not None:
        sql += f" LIMIT {int(which.limit)}"
    return _frame_of(source.frame(sql, params))


_JSON_TYPES = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def stored_json(evaluation_id: str, column: str, text: object) -> dict[str, Any]:
    """An evaluation's stored ``spec`` or ``summary`` (``column``: JSON text) as a
    mapping; empty text is an empty one. Anything else that is not a JSON object is a
    DatabaseError naming the evaluation, the column and what is wrong, in one line."""
    if text is None or text in ("", b""):
        return {}
    value, problem = _json_value(text)
    if problem is None:
        if isinstance(value, dict):
            return value
        problem = f"is {_JSON_TYPES.get(type(value), 'a number')}, not a JSON object"
    raise DatabaseError(
        f"evaluation {evaluation_id}: its stored {column} {problem}",
        evaluation_id=evaluation_id,
        column=column,
    )


def stored_spec(source: Source, evaluation_id: str) -> dict[str, Any]:
    """The stored specification of ``evaluation_id`` (its ``job``, manifest, agent...):
    what ``mlscope rerun`` runs again; a DatabaseError names an evaluation not stored."""
    return _stored(source, evaluation_id, "spec")


def stored_summary(source: Source, evaluation_id: str) -> dict[str, Any]:
    """The stored summary of ``evaluation_id`` (of a sweep's run: its own ``scenario``,
    the point it ran); a DatabaseError names an evaluation not stored."""
    return _stored(source, evaluation_id, "summary")


def _stored(source: Source, evaluation_id: str, column: str) -> dict[str, Any]:
    raw = source.frame(
        f"SELECT {column} FROM evaluations FINAL WHERE evaluation_id = {{id:String}}",
        {"id": evaluation_id},
    )
    if raw.empty:
        raise EvaluationNotFound(f"no evaluation {evaluation_id}", evaluation_id=evaluation_id)
    return stored_json(evaluation_id, column, raw.iloc[0, 0])


STORED_MAX_DEPTH = 4 * MAX_DEPTH
"""Deepest stored spec or summary read: a spec embeds the run's manifest (itself up to
:data:`mlscope.bounded.MAX_DEPTH` deep) a level or two down, and json's parser
recurses about a thousand levels before the stack gives out."""


def _json_value(text: object) -> tuple[object, str | None]:
    """``text`` read as JSON (anything but text or bytes: as it is), or None and why it
    cannot be read. Its nesting is checked first (:func:`mlscope.bounded.json_depth`):
    json's parser recurses, and a deep enough text would overflow the stack."""
    if not isinstance(text, str | bytes):
        return text, None
    try:  # bytes decoded as json.loads decodes them
        raw = (
            text
            if isinstance(text, str)
            else text.decode(json.detect_encoding(text), "surrogatepass")
        )
    except UnicodeDecodeError as exc:
        return None, f"is not JSON ({exc})"
    # Only a text with more brackets than the limit can nest past it (counting is cheap).
    if raw.count("[") + raw.count("{") > STORED_MAX_DEPTH and json_depth(raw) > STORED_MAX_DEPTH:
        return None, f"is JSON nested deeper than {STORED_MAX_DEPTH} levels"
    try:
        return json.loads(raw), None
    except ValueError as exc:  # json.JSONDecodeError
        return None, f"is not JSON ({exc})"


def _readable(r: dict[str, Any], column: str, *, named: bool) -> dict[str, Any]:
    """``r[column]`` by :func:`stored_json`; where unreadable and not ``named``, {}."""
    try:
        return stored_json(str(r["evaluation_id"]), column, r.pop(column))
    except DatabaseError:
        if named:
            raise
        return {}


def _mapping(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


MAX_BATCH = 2**31 - 1
"""The largest batch size a stored summary may name (``Int32``, like the scenario's)."""
MAX_FIGURE = 1e15
"""The largest magnitude a stored figure (a rate, a duration, a count) may have."""


def _whole(value: object, default: int) -> int:
    """``value`` when it is a batch size (an int in 1..:data:`MAX_BATCH`), else default."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_BATCH:
        return value
    return default


def _figure(value: object) -> float | None:
    """``value`` as a float when it is a finite number within :data:`MAX_FIGURE` (an int
    or a float, not a bool); None for anything else, so that no reader of the flattened
    columns converts a string, a mapping or a huge integer from a stored summary."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value) if abs(value) <= MAX_FIGURE else math.nan
    return number if math.isfinite(number) else None


def _count(value: object) -> int | None:
    """:func:`_figure` of a count, as an int: None where negative or not whole."""
    number = _figure(value)
    return int(number) if number is not None and number >= 0 and number.is_integer() else None


def _flatten(r: dict[str, Any], *, named: bool) -> dict[str, Any]:
    summary = _readable(r, "summary", named=named)
    spec = _readable(r, "spec", named=named)
    scenario = _mapping(summary.get("scenario"))
    agent = _mapping(spec.get("agent"))
    accuracy = _mapping(summary.get("accuracy"))
    reasons = summary.get("invalid_reasons")
    runs = _runs_of(str(r["evaluation_id"]), summary)
    return {
        **r,
        "valid": bool(r["valid"]),
        "system": _system_name(agent, r.get("device", "cpu")),
        "batch_size": _whole(scenario.get("batch_size"), 1),
        "requested_qps": _figure(summary.get("requested_qps")),
        "invalid_reasons": "; ".join(map(str, reasons))
        if isinstance(reasons, list | tuple)
        else "",
        "queries": _count(summary.get("queries")),
        "warmup_queries": _count(summary.get("warmup_queries")),
        "samples": _count(summary.get("samples")),
        "errors": _count(summary.get("errors")),
        "duration_s": _figure(summary.get("duration_s")),
        "throughput_ips": _figure(summary.get("throughput_ips")),
        "top1": _figure(accuracy.get("top1")),
        "role": "sweep" if runs else "run",
        "runs": runs,
        "parallel": bool(summary.get("parallel", False)),
        **{k: str(summary.get(k, default)) for k, default in MEASURED_AS.items()},
        "artifact_sha256": str(spec.get("artifact_sha256") or ""),
        "peak_rss_mb": _figure(summary.get("peak_rss_mb")),
        "rss_growth_mb": _figure(summary.get("rss_growth_mb")),
        "energy_j": _figure(summary.get("energy_j")),
        "host_other_cores": _figure(summary.get("host_other_cores")),
    }


def _runs_of(evaluation_id: str, summary: dict[str, Any]) -> list[str]:
    """The runs a sweep's summary lists under other ids (its points); [] for a run."""
    points = summary.get("points")
    ids = [
        p["evaluation_id"]
        for p in (points if isinstance(points, list | tuple) else ())
        if isinstance(p, dict) and isinstance(p.get("evaluation_id"), str) and p["evaluation_id"]
    ]
    return ids if any(i != evaluation_id for i in ids) else []


def _system_name(agent: dict[str, Any], device: str) -> str:
    """A readable system: the accelerator when the run used one, else the CPU."""
    accelerators = agent.get("accelerators")
    if device != "cpu" and isinstance(accelerators, list | tuple):
        for acc in accelerators:
            return str(_mapping(acc).get("model", device))
    cpu = str(agent.get("cpu_model") or "cpu")
    cores = agent.get("cpu_cores")
    return f"{cpu} ({cores} cores)" if cores else cpu


def latest_per_key(frame: pd.DataFrame, keys: Sequence[str]) -> pd.DataFrame:
    """Keep the newest row for each combination of ``keys`` (frames are newest first)."""
    return frame.drop_duplicates(subset=list(keys), keep="first").reset_index(drop=True)
