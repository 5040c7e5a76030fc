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

Tables are written as they are read, a bounded number of rows at a time (each read
one statement starting after the previous one's last key): an export of any size
holds one such frame in memory, and so does the server that answers it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from cli.console import help_text
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
        description=help_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("evaluations", nargs="+", metavar="EVAL_ID")
    p.add_argument("--format", choices=list(EXTENSIONS), default="csv")
    p.add_argument(
        "-o", "--output", type=Path, required=True, metavar="DIR", help="directory to write"
    )
    p.set_defaults(func=run)


def tables(source: Source, ids: list[str]) -> dict[str, Iterable[pd.DataFrame]]:
    """The three tables of evaluations ``ids``, each as frames to write one after the
    other (a DatabaseError names a missing evaluation): ``queries`` and ``spans`` a
    bounded number of rows at a time (:func:`analysis.source.pages`), so a table of
    any length is never held whole, here or by the server."""
    from analysis.data import evaluations
    from analysis.rows import queries_of, spans_of

    ev = evaluations(source, ids)
    raw = source.frame(
        "SELECT evaluation_id, spec, summary FROM evaluations FINAL "
        "WHERE evaluation_id IN {ids:Array(String)} ORDER BY evaluation_id",
        {"ids": ids},
    )
    ev = ev.merge(raw, on="evaluation_id", how="left")
    ev["runs"] = ev["runs"].map(json.dumps)  # a list: text in every format
    return {"evaluations": [ev], "queries": queries_of(source, ids), "spans": spans_of(source, ids)}


def write_tables(
    frames: Mapping[str, pd.DataFrame | Iterable[pd.DataFrame]], out: Path, fmt: str
) -> dict[Path, int]:
    """Write each table (one frame, or frames of its rows in order, written as they
    come) as ``out/<table>.<ext>``; the paths written and their rows."""
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, table in frames.items():
        path = out / f"{name}.{EXTENSIONS[fmt]}"
        parts = [table] if isinstance(table, pd.DataFrame) else table
        written[path] = _write(parts, path, fmt)
    return written


def _write(frames: Iterable[pd.DataFrame], path: Path, fmt: str) -> int:
    """``frames`` into one file at ``path``, one after the other; the rows written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 0
    with contextlib.ExitStack() as stack:
        parquet: pq.ParquetWriter | None = None
        schema: pa.Schema | None = None
        for i, frame in enumerate(frames):
            if fmt == "csv":
                frame.to_csv(path, index=False, mode="w" if i == 0 else "a", header=i == 0)
            elif fmt == "parquet":
                # the first frame's types for every one (a column all null in one)
                table = pa.Table.from_pandas(frame, schema=schema, preserve_index=False)
                if parquet is None:
                    schema = table.schema
                    parquet = stack.enter_context(pq.ParquetWriter(path, schema))
                parquet.write_table(table)
            else:
                write_json_lines(frame, path, append=i > 0)
            rows += len(frame)
    return rows


def write_json_lines(frame: pd.DataFrame, path: Path, *, append: bool = False) -> None:
    """``frame`` as JSON Lines (after what ``path`` holds, with ``append``), one object
    per row, every number as stored (:func:`analysis.records.json_records`)."""
    from analysis.records import json_records

    with path.open("a" if append else "w", encoding="utf-8") as f:
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
    written = write_tables(tables(open_source(settings), ids), args.output, args.format)
    for path, rows in written.items():
        print(f"wrote {path} ({rows} rows)", file=sys.stderr)
    return 0
