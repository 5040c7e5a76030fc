"""``mlscope trace EVAL_ID -o trace.json``: one evaluation as a Chrome trace / Perfetto JSON.

Everything is read through the server's SQL responder (``mlscope.db.sql``): with
chDB only the server process may open the database. Rows come in pages of at most
:data:`PAGE` rows, each read as Arrow pages that fit the bus's max payload
(:func:`mlscope.remote.arrow`), so a framework-level run with millions of spans, or
spans with large attributes, never needs a reply larger than one message. The
document itself is built in memory, so an evaluation with more than ``--max-spans``
spans (:data:`MAX_SPANS`) is refused, with its count, before any span is read
(``mlscope export`` writes any number of them as files, page by page).

Rows are written by agents, which are not trusted: a span's attributes are read with
:func:`analysis.layers.span_attrs` (what cannot be read is left out), a sample that is
not a finite number is left out, and the document is written as strict JSON (no
``NaN`` or ``Infinity``, which Chrome and Perfetto refuse).

One timeline, the load generator's: zero is the evaluation's ``t0_ns``, and agent
times (spans, system samples) are shifted by the evaluation's stored clock offset
(``agent clock - load-generator clock``, estimated over the bus before the run).

Layout (``ph`` is the Chrome trace event phase):

- process "load generator": one async slice per query, issued -> completed;
- one process per agent: thread "queries" holds async query slices (received ->
  done, which overlap when queries queue), thread "worker" the nested complete
  events preprocess / predict / postprocess and, inside predict, the framework's
  layer spans; thread "device" the kernel spans; system samples are counters.
  Complete events on one thread must nest, so the spans of queries in flight at the
  same time (one query's preprocess while another predicts) take a lane each: the
  query takes the lowest lane free at its first step, and lane N > 0 has its own
  threads "worker N" and "device N" (:func:`_lanes`).

Every event's ``args`` keep span_id, parent_id, query_index, level and the span's
attributes, so a consumer can rebuild the exact tree.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path
from typing import Any

import anyio

from analysis.layers import span_attrs
from cli.flag_types import positive_int
from mlscope import bus as busmod
from mlscope import remote
from mlscope.bus import Bus
from mlscope.errors import ConfigError, EvaluationNotFound
from mlscope.settings import Settings
from mlscope.tracerows import trace_rows

__all__ = ["chrome_trace", "export", "fetch", "register"]

PAGE = 1_000
"""Rows per keyset page (each comes in as many Arrow pages as fit the max payload)."""
MAX_SPANS = 1_000_000
"""Spans a trace export takes at most (``--max-spans``): the Chrome trace is one JSON
document, built in memory with its rows (a few KB a span), so an evaluation with more
is refused, naming its count, before any span is read. ``mlscope export`` writes any
number of spans as files, page by page."""
LOADGEN_PID = 1
TID_QUERIES, TID_WORKER, TID_DEVICE = 1, 2, 3


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("trace", help="export an evaluation's timeline as Chrome trace JSON")
    p.add_argument("evaluation_id")
    p.add_argument(
        "-o", "--output", type=Path, default=None, help="output file (default: EVAL_ID.trace.json)"
    )
    p.add_argument(
        "--max-spans",
        type=positive_int,
        default=MAX_SPANS,
        metavar="N",
        help=f"refuse an evaluation with more spans (default {MAX_SPANS:,}; "
        "the trace is built in memory, a few KB a span)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = args.output or Path(f"{args.evaluation_id}.trace.json")
    writable(out)  # before the fetch: a typo in -o costs no download
    doc, runs = anyio.run(
        functools.partial(export, args.settings, args.evaluation_id, max_spans=args.max_spans),
        backend="asyncio",
    )
    out.write_text(json.dumps(doc, allow_nan=False))
    print(
        f"{out}: {len(doc['traceEvents'])} events "
        f"(open in https://ui.perfetto.dev or chrome://tracing)",
        file=sys.stderr,
    )
    if runs:  # a sweep's or search's own evaluation: its runs hold the queries and spans
        print(
            f"{args.evaluation_id} is a sweep or search: its runs are traced apart "
            f"(mlscope trace {runs[0]}); its runs: {', '.join(runs)}",
            file=sys.stderr,
        )
    return 0


def writable(out: Path) -> None:
    """Refuse, in one line naming it, an output file whose directory does not exist."""
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ConfigError(f"cannot write {out}: no directory {parent}", field="output")
    if out.is_dir():
        raise ConfigError(f"cannot write {out}: it is a directory", field="output")


async def export(
    settings: Settings, evaluation_id: str, *, max_spans: int = MAX_SPANS
) -> tuple[dict[str, Any], list[str]]:
    """The Chrome trace document of ``evaluation_id`` and, of a sweep or search (whose
    own evaluation holds no query), the ids of the runs that hold them."""
    async with busmod.connect(settings, name="mlscope trace") as bus:
        rows = await fetch(bus, evaluation_id, max_spans=max_spans)
    return chrome_trace(*rows), list(rows[0]["runs"])


async def _rows(
    bus: Bus, select: str, eval_id: str, key: tuple[tuple[str, str], ...]
) -> list[dict[str, Any]]:
    """All rows of ``select`` (one evaluation), in keyset pages of :data:`PAGE` rows on
    the table's sorting key after ``evaluation_id`` (unique under FINAL), each starting
    right after the previous page's last row (:func:`mlscope.remote.keyset_pages`)."""
    out: list[dict[str, Any]] = []
    async for page in remote.keyset_pages(bus, select, {"e": eval_id}, key, rows=PAGE):
        out.extend(page.to_pylist())
    return out


_RUNS = (
    "arrayMap(p -> JSONExtractString(p, 'evaluation_id'), "
    "JSONExtractArrayRaw(summary, 'points')) AS runs"
)
"""The evaluation ids of a stored summary's ``points``: a sweep's or search's runs."""


async def fetch(
    bus: Bus, eval_id: str, *, max_spans: int = MAX_SPANS
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(evaluation, queries, spans, samples) rows of one evaluation (its spans and
    samples those of the agent it ran on: :func:`mlscope.tracerows.trace_rows`; the
    evaluation's ``runs``: of a sweep or search, the runs that hold them); a
    ConfigError, before any span is read, when it has more than ``max_spans`` spans."""
    where = "FINAL WHERE evaluation_id = {e:String}"
    ev = await _rows(
        bus,
        "SELECT evaluation_id, model, framework, agent_id, host, t0_ns, "
        f"clock_offset_ns, trace_level, {_RUNS} FROM evaluations {where}",
        eval_id,
        (("evaluation_id", "String"),),
    )
    if not ev:
        raise EvaluationNotFound(f"no evaluation {eval_id!r}", evaluation_id=eval_id)
    ev[0]["runs"] = [r for r in ev[0]["runs"] or () if r and r != eval_id]
    _, [[count]] = await remote.sql(
        bus, f"SELECT count() FROM {trace_rows('spans')}", {"e": eval_id}, timeout=60
    )
    if int(count) > max_spans:
        raise ConfigError(
            f"evaluation {eval_id} has {int(count):,} spans, more than the {max_spans:,} a "
            "trace export builds in memory (--max-spans): raise it where the memory is "
            "there (a few KB a span), or write the spans as files with `mlscope export`",
            field="max_spans",
            spans=int(count),
        )
    queries = await _rows(
        bus,
        f"SELECT query_index, scheduled_ns, issued_ns, completed_ns, ok FROM queries {where}",
        eval_id,
        (("query_index", "UInt32"),),
    )
    spans = await _rows(
        bus,
        "SELECT agent_id, host, span_id, parent_id, query_index, level, "
        f"kind, name, start_ns, end_ns, attrs FROM {trace_rows('spans')}",
        eval_id,
        (("agent_id", "String"), ("span_id", "UInt64")),
    )
    samples = await _rows(
        bus,
        f"SELECT agent_id, ts_ns, metric, device, value FROM {trace_rows('system_samples')}",
        eval_id,
        (("agent_id", "String"), ("metric", "String"), ("device", "String"), ("ts_ns", "Int64")),
    )
    return ev[0], queries, spans, samples


def chrome_trace(
    ev: dict[str, Any],
    queries: list[dict[str, Any]],
    spans: list[dict[str, Any]],
    samples: list[dict[str, Any]],
) -> dict[str, Any]:
    """The Chrome trace document (``traceEvents``, times in µs from t0)."""
    base = int(ev["t0_ns"]) + int(ev["clock_offset_ns"])  # agent clock -> timeline zero
    events: list[dict[str, Any]] = [_meta(LOADGEN_PID, None, "load generator")]
    for q in queries:
        if q["completed_ns"]:
            events.extend(_query_events(q))
    agents = _Agents(events)
    lanes = _lanes(spans)
    for s in spans:
        pid = agents.pid(str(s["agent_id"]), str(s["host"]))
        lane = lanes[(str(s["agent_id"]), int(s["query_index"]))]
        events.extend(_span_events(s, pid, base, agents.threads(pid, lane)))
    for r in samples:
        value = r["value"]
        if not isinstance(value, int | float) or not math.isfinite(value):
            continue  # NaN, ±inf (or what a reply made of them): no value to draw
        pid = agents.pid(str(r["agent_id"]), "")
        events.append(
            {
                "ph": "C",
                "name": str(r["metric"]),
                "pid": pid,
                "ts": (int(r["ts_ns"]) - base) / 1000,
                "args": {str(r["device"]): float(value)},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": _metadata(ev)}


def _query_events(q: dict[str, Any]) -> list[dict[str, Any]]:
    """A completed query as the load generator saw it: an async slice, issued ->
    completed (load-generator clock)."""
    common = {
        "cat": "loadgen",
        "name": f"query {q['query_index']}",
        "pid": LOADGEN_PID,
        "tid": TID_QUERIES,
        "id": int(q["query_index"]),
    }
    return [
        {
            **common,
            "ph": "b",
            "ts": int(q["issued_ns"]) / 1000,
            "args": {"scheduled_us": int(q["scheduled_ns"]) / 1000, "ok": bool(q["ok"])},
        },
        {**common, "ph": "e", "ts": int(q["completed_ns"]) / 1000},
    ]


def _lanes(spans: list[dict[str, Any]]) -> dict[tuple[str, int], int]:
    """The lane of each (agent, query index): per agent, each query (the extent of its
    complete events, first start to last end; its query span is an async slice and
    takes no lane) takes the lowest lane whose previous query has ended, so the spans
    of queries worked on at the same time never share a thread."""
    extent: dict[tuple[str, int], tuple[int, int]] = {}
    out: dict[tuple[str, int], int] = {}
    for s in spans:
        key = (str(s["agent_id"]), int(s["query_index"]))
        if s["kind"] == "query":
            out.setdefault(key, 0)  # a query with no other span: lane 0 (unused)
            continue
        start, end = int(s["start_ns"]), int(s["end_ns"])
        lo, hi = extent.get(key, (start, end))
        extent[key] = (min(lo, start), max(hi, end, start))
    ends: dict[str, list[int]] = {}  # per agent, ends[lane]: when its last query ended
    for key, (start, end) in sorted(extent.items(), key=lambda kv: (kv[0][0], kv[1], kv[0][1])):
        lane_ends = ends.setdefault(key[0], [])
        free = next((i for i, e in enumerate(lane_ends) if e <= start), len(lane_ends))
        if free == len(lane_ends):
            lane_ends.append(end)
        else:
            lane_ends[free] = end
        out[key] = free
    return out


class _Agents:
    """The process of each agent, numbered in the order agents first appear; the
    process's and its threads' names are added to ``events`` then."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events
        self.pids: dict[str, int] = {}
        self.named: set[tuple[int, int]] = set()

    def pid(self, agent: str, host: str) -> int:
        if agent not in self.pids:
            self.pids[agent] = pid = LOADGEN_PID + 1 + len(self.pids)
            self.events.append(_meta(pid, None, f"agent {agent} ({host})"))
            for tid, name in (
                (TID_QUERIES, "queries"),
                (TID_WORKER, "worker"),
                (TID_DEVICE, "device"),
            ):
                self.events.append(_meta(pid, tid, name))
        return self.pids[agent]

    def threads(self, pid: int, lane: int) -> tuple[int, int]:
        """(worker, device) thread ids of ``lane`` on process ``pid``, named on first use
        (lane 0: the threads "worker" and "device")."""
        if lane == 0:
            return TID_WORKER, TID_DEVICE
        worker, device = TID_DEVICE + 2 * lane - 1, TID_DEVICE + 2 * lane
        if (pid, lane) not in self.named:
            self.named.add((pid, lane))
            self.events.append(_meta(pid, worker, f"worker {lane}"))
            self.events.append(_meta(pid, device, f"device {lane}"))
        return worker, device


def _span_events(
    s: dict[str, Any],
    pid: int,
    base: int,
    threads: tuple[int, int] = (TID_WORKER, TID_DEVICE),
) -> list[dict[str, Any]]:
    """A span on its agent's process: a query span as an async slice (thread
    "queries"), any other as a complete event on its query's lane (``threads``: its
    worker and device threads; a kernel on the device one)."""
    start = (int(s["start_ns"]) - base) / 1000
    args: dict[str, Any] = {
        "span_id": int(s["span_id"]),
        "parent_id": int(s["parent_id"]),
        "query_index": int(s["query_index"]),
        "level": int(s["level"]),
    }
    attrs = span_attrs(s["attrs"])
    if attrs:
        args["attrs"] = attrs
    if s["kind"] == "query":
        common = {
            "cat": "query",
            "name": str(s["name"]),
            "pid": pid,
            "tid": TID_QUERIES,
            "id": f"{s['agent_id']}:{s['span_id']}",
        }
        end = (int(s["end_ns"]) - base) / 1000
        return [{**common, "ph": "b", "ts": start, "args": args}, {**common, "ph": "e", "ts": end}]
    return [
        {
            "ph": "X",
            "cat": str(s["kind"]),
            "name": str(s["name"]),
            "pid": pid,
            "tid": threads[1] if s["kind"] == "kernel" else threads[0],
            "ts": start,
            "dur": (int(s["end_ns"]) - int(s["start_ns"])) / 1000,
            "args": args,
        }
    ]


def _metadata(ev: dict[str, Any]) -> dict[str, Any]:
    """The evaluation the trace shows, and its clocks."""
    return {
        "evaluation_id": ev["evaluation_id"],
        "model": ev["model"],
        "framework": ev["framework"],
        "trace_level": ev["trace_level"],
        "clock_offset_ns": int(ev["clock_offset_ns"]),
        "t0_ns": int(ev["t0_ns"]),
    }


def _meta(pid: int, tid: int | None, name: str) -> dict[str, Any]:
    if tid is None:
        return {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}}
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
