"""``mlscope trace`` and ``mlscope export`` on rows given in memory: what the files
hold is what the rows hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from cli.export_cmd import write_tables
from cli.trace_cmd import chrome_trace

EV: dict[str, Any] = {
    "evaluation_id": "ev-1",
    "model": "m",
    "framework": "onnxruntime",
    "t0_ns": 1_000_000,
    "clock_offset_ns": 500,
    "trace_level": "framework",
}


def _span(sid: int, parent: int, q: int, kind: str, name: str, a: int, b: int) -> dict[str, Any]:
    return {
        "agent_id": "ag",
        "host": "h",
        "span_id": sid,
        "parent_id": parent,
        "query_index": q,
        "level": 0 if kind == "query" else 1 if kind == "step" else 2,
        "kind": kind,
        "name": name,
        "start_ns": EV["t0_ns"] + EV["clock_offset_ns"] + a,
        "end_ns": EV["t0_ns"] + EV["clock_offset_ns"] + b,
        "attrs": "",
    }


def _overlapping_queries() -> list[dict[str, Any]]:
    """Query 1's preprocess runs while query 0 predicts (two agent threads)."""
    return [
        _span(1, 0, 0, "query", "query", 0, 10_000),
        _span(2, 1, 0, "step", "preprocess", 0, 2_000),
        _span(3, 1, 0, "step", "predict", 2_000, 8_000),
        _span(4, 3, 0, "layer", "conv", 2_500, 7_000),
        _span(5, 1, 0, "step", "postprocess", 8_000, 10_000),
        _span(6, 0, 1, "query", "query", 6_000, 20_000),
        _span(7, 6, 1, "step", "preprocess", 6_000, 9_000),
        _span(8, 6, 1, "step", "predict", 10_000, 18_000),
        _span(9, 8, 1, "layer", "conv", 11_000, 17_000),
        _span(10, 6, 1, "step", "postprocess", 18_000, 20_000),
        _span(11, 0, 2, "query", "query", 30_000, 40_000),
        _span(12, 11, 2, "step", "predict", 30_000, 40_000),
    ]


def test_complete_events_on_one_thread_nest_within_one_query() -> None:
    doc = chrome_trace(EV, [], _overlapping_queries(), [])
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 9
    by_thread: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in complete:
        by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for events in by_thread.values():
        assert len({e["args"]["query_index"] for e in events}) == 1 or all(
            a["ts"] + a["dur"] <= b["ts"] or b["ts"] + b["dur"] <= a["ts"]
            for a in events
            for b in events
            if a["args"]["query_index"] != b["args"]["query_index"]
        )
    lane = {e["args"]["query_index"]: (e["pid"], e["tid"]) for e in complete}
    assert lane[0] != lane[1]  # in flight together: two threads
    assert lane[2] == lane[0]  # back to back with query 0: its thread again
    named = {
        (e["pid"], e["tid"])
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert set(lane.values()) <= named
    # times: ns from t0 on the load generator's clock, in µs
    predict = next(e for e in complete if e["args"]["span_id"] == 8)
    assert predict["ts"] == 10.0 and predict["dur"] == 8.0


def test_json_export_keeps_every_float_and_integer(tmp_path: Path) -> None:
    frame = pd.DataFrame(
        {
            "throughput_ips": [46.781144406638106, None],
            "top1": [0.9682539682539683, float("nan")],
            "issued_ns": [9_007_199_254_740_993, 1],
            "span_id": pd.Series([2**64 - 1, 3], dtype="uint64"),
            "created_at": pd.to_datetime(["2026-11-27 17:13:43.983", "2026-11-27 17:13:44.000"]),
        }
    )
    write_tables({"evaluations": frame}, tmp_path, "json")
    rows = [json.loads(line) for line in (tmp_path / "evaluations.jsonl").read_text().splitlines()]
    assert rows[0]["throughput_ips"] == 46.781144406638106
    assert rows[0]["top1"] == 0.9682539682539683
    assert rows[1]["throughput_ips"] is None and rows[1]["top1"] is None
    assert rows[0]["issued_ns"] == 9_007_199_254_740_993
    assert rows[0]["span_id"] == 2**64 - 1
    assert rows[0]["created_at"] == "2026-11-27T17:13:43.983+00:00"  # stored times are UTC
    back = pd.read_json(tmp_path / "evaluations.jsonl", lines=True, precise_float=True)
    assert back["throughput_ips"][0] == 46.781144406638106
