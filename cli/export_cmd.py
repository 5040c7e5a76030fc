"""``mlscope export EVAL_ID... --format csv|parquet|json -o DIR``: evaluations as files.

``DIR`` is a directory (created if missing, refused before anything is read where a
file is in the way; existing files of the same names are replaced) with one file per
table, each holding the rows of every evaluation named:

* ``evaluations.<ext>``: one row per evaluation, the summary flattened into columns
  (as ``mlscope runs``) plus the stored ``spec`` and ``summary`` as JSON text;
* ``queries.<ext>``: the raw per-query records as stored (times in ns);
* ``spans.<ext>``: the trace spans (empty at trace level ``none``).

``json`` writes JSON Lines (one object per line: ``pandas.read_json(p, lines=True,
precise_float=True)``), every number as stored (a float as the shortest text that
reads back to the same value, an integer whole) and a missing value as ``null``;
``csv`` has a header row; ``parquet`` keeps the column types.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mlscope.errors import ConfigError
from mlscope.settings import Settings

if TYPE_CHECKING:  # pandas and the analysis package load only when a command runs
    import pandas as pd

    from analysis.source import Source

__all__ = ["EXTENSIONS", "TABLES", "creatable", "register", "write_tables"]

EXTENSIONS = {"csv": "csv", "parquet": "parquet", "json": "jsonl"}
"""File extension per ``--format``."""
TABLES = ("evaluations", "queries", "spans")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        help="write evaluations, their queries and spans as CSV, Parquet or JSON files",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("evaluations", nargs="+", metavar="EVAL_ID")
    p.add_argument("--format", choices=list(EXTENSIONS), default="csv")
    p.add_argument(
        "-o", "--output", type=Path, required=True, metavar="DIR", help="directory to write"
    )
    p.set_defaults(func=run)


def tables(source: Source, ids: list[str]) -> dict[str, pd.DataFrame]:
    """The three tables of evaluations ``ids`` (a DatabaseError names a missing one)."""
    from analysis.data import evaluations, spans_of

    ev = evaluations(source, ids)
    raw = source.frame(
        "SELECT evaluation_id, spec, summary FROM evaluations FINAL "
        "WHERE evaluation_id IN {ids:Array(String)} ORDER BY evaluation_id",
        {"ids": ids},
    )
    ev = ev.merge(raw, on="evaluation_id", how="left")
    ev["runs"] = ev["runs"].map(json.dumps)  # a list: text in every format
    queries = source.frame(
        "SELECT * FROM queries FINAL WHERE evaluation_id IN {ids:Array(String)} "
        "ORDER BY evaluation_id, query_index",
        {"ids": ids},
    )
    return {"evaluations": ev, "queries": queries, "spans": spans_of(source, ids)}


def write_tables(frames: dict[str, pd.DataFrame], out: Path, fmt: str) -> list[Path]:
    """Write each frame as ``out/<table>.<ext>``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, frame in frames.items():
        path = out / f"{name}.{EXTENSIONS[fmt]}"
        if fmt == "csv":
            frame.to_csv(path, index=False)
        elif fmt == "parquet":
            frame.to_parquet(path, index=False)
        else:
            write_json_lines(frame, path)
        written.append(path)
    return written


def write_json_lines(frame: pd.DataFrame, path: Path) -> None:
    """``frame`` as JSON Lines, one object per row, every number as stored
    (:func:`analysis.records.json_records`)."""
    from analysis.records import json_records

    with path.open("w", encoding="utf-8") as f:
        for row in json_records(frame):
            f.write(json.dumps(row, allow_nan=False))
            f.write("\n")


def creatable(out: Path) -> None:
    """Refuse, in one line naming it, a ``-o`` that is not and cannot become a
    directory: a file, or a path through one."""
    at = out
    while not at.exists() and at != at.parent:
        at = at.parent
    if at.exists() and not at.is_dir():
        raise ConfigError(f"cannot write into {out}: {at} is not a directory", field="output")


def run(args: argparse.Namespace) -> int:
    from analysis.source import open_source

    settings: Settings = args.settings
    ids = list(dict.fromkeys(args.evaluations))
    creatable(args.output)  # before the tables are read
    frames = tables(open_source(settings), ids)
    for path in write_tables(frames, args.output, args.format):
        print(f"wrote {path} ({len(frames[path.stem])} rows)", file=sys.stderr)
    return 0
