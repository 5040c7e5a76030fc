"""Reading MLPerf LoadGen's log files: summary, detail, trace and accuracy.

Only LoadGen's own numbers are taken from these files (they are never recomputed):

* ``mlperf_log_detail.txt`` -- one ``:::MLLOG {json}`` record per line; the
  ``result_*`` keys hold the verdict, counts, rates and the nearest-rank latency
  percentiles LoadGen computed (``result_99.00_percentile_latency_ns``; MultiStream
  names them ``..._percentile_per_query_latency_ns``), ``effective_*`` the settings.
* ``mlperf_log_summary.txt`` -- the human summary; its ``... satisfied : NO`` lines are
  the reasons behind an INVALID verdict.
* ``mlperf_log_trace.json`` (written when ``LogSettings.enable_trace``) -- one async
  ``Sample`` begin event per sample: ``ts`` (µs, LoadGen's clock) is the sample's
  scheduled time, ``issue_start_ns`` / ``complete_ns`` are issue and completion
  relative to it. LoadGen writes some other events in that file as invalid JSON
  (unescaped quotes), so the sample events are read line by line.
* ``mlperf_log_accuracy.json`` -- ``[{seq_id, qsl_idx, data (hex)}]``, the responses
  of an accuracy run; :func:`imagenet_top1` scores them as MLPerf's ImageNet checker
  (``accuracy-imagenet.py``) does.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlscope.errors import ConfigError

__all__ = [
    "ACCURACY",
    "DETAIL",
    "LOG_FILES",
    "REQUIRED",
    "SUMMARY",
    "TRACE",
    "LoadGenResult",
    "accuracy_entries",
    "format_accuracy",
    "imagenet_top1",
    "missing",
    "parse_detail",
    "parse_result",
    "trace_samples",
]

SUMMARY = "mlperf_log_summary.txt"
DETAIL = "mlperf_log_detail.txt"
ACCURACY = "mlperf_log_accuracy.json"
TRACE = "mlperf_log_trace.json"
LOG_FILES = (SUMMARY, DETAIL, ACCURACY, TRACE)
REQUIRED = (SUMMARY, DETAIL)
"""The logs a result is read from (:func:`parse_result`): a run or import without
them has no result."""
_MLLOG = ":::MLLOG "
_PCT = re.compile(r"^result_(\d+\.\d+)_percentile(_per_query)?_latency_ns$")
_SATISFIED = re.compile(r"^\s*(.+?)\s*satisfied\s*:\s*NO\s*$", re.IGNORECASE | re.MULTILINE)
_FIELD = re.compile(r"^(SUT name|Scenario|Mode|Result is)\s*:\s*(.*?)\s*$", re.MULTILINE)
_MAX_NS = 2**63 - 1
_NUMERIC_RESULTS = (
    "query_count",
    "scheduled_samples_per_sec",
    "completed_samples_per_sec",
    "samples_per_second",
    "qps_with_loadgen_overhead",
    "max_query_latency_ns",
    "max_latency_ns",
    "min_latency_ns",
    "mean_latency_ns",
)
"""``result_*`` keys the summary reads as numbers: present, they must be numbers."""
_RATES = ("completed_samples_per_sec", "samples_per_second", "qps_with_loadgen_overhead")
TRACE_DTYPE = np.dtype(
    [
        ("sample_seq", np.int64),
        ("query_seq", np.int64),
        ("sample_idx", np.int64),
        ("scheduled_ns", np.int64),
        ("issued_ns", np.int64),
        ("completed_ns", np.int64),
    ]
)


@dataclass(frozen=True)
class LoadGenResult:
    """LoadGen's verdict and numbers for one run, as its logs state them."""

    scenario: str
    mode: str
    sut_name: str
    validity: str | None
    """``VALID`` / ``INVALID``; None for an accuracy run (LoadGen judges no validity)."""
    reasons: tuple[str, ...]
    percentiles_ns: dict[str, int]
    """``"50.00"`` -> ns, LoadGen's nearest-rank percentiles (per query in MultiStream)."""
    result: dict[str, Any]
    """Every ``result_*`` key of the detail log, without the prefix."""
    effective: dict[str, Any]
    """Every ``effective_*`` setting of the detail log, without the prefix."""
    errors: int
    """LoadGen's runtime errors (``num_errors``), stored as ``num_errors``."""
    loadgen_version: str

    @property
    def valid(self) -> bool:
        return self.errors == 0 and self.validity in (None, "VALID")

    @property
    def throughput_ips(self) -> float | None:
        """LoadGen's own rate, samples/s: Offline's ``samples_per_second``, the others'
        completed samples per second (``qps_with_loadgen_overhead`` where neither)."""
        return next((float(self.result[k]) for k in _RATES if k in self.result), None)

    @property
    def samples_per_query(self) -> int:
        """LoadGen's samples per query (Offline: all of them; MultiStream: 8 by default)."""
        value = self.effective.get("samples_per_query")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return 1
        return value

    def doc(self) -> dict[str, Any]:
        """The JSON kept in an evaluation's summary (``EvaluationSummary.mlperf``):
        LoadGen's own figures, as its logs state them, under LoadGen's names
        (``num_errors``: its runtime errors, such as running out of generated queries)."""
        return {
            "scenario": self.scenario,
            "mode": self.mode,
            "sut_name": self.sut_name,
            "validity": self.validity,
            "reasons": list(self.reasons),
            "percentiles_ns": self.percentiles_ns,
            "throughput_ips": self.throughput_ips,
            "samples_per_query": self.samples_per_query,
            "result": self.result,
            "effective": self.effective,
            "num_errors": self.errors,
            "loadgen_version": self.loadgen_version,
        }


def missing(names: Iterable[str]) -> list[str]:
    """Those of :data:`REQUIRED` that ``names`` (a run's or an import's files) lack."""
    have = set(names)
    return [name for name in REQUIRED if name not in have]


def parse_detail(text: str) -> dict[str, Any]:
    """key -> value of every MLLOG record (the last one wins); malformed lines are named."""
    out: dict[str, Any] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.startswith(_MLLOG):
            continue
        try:
            rec = json.loads(line[len(_MLLOG) :])
            out[str(rec["key"])] = rec.get("value")
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise ConfigError(
                f"{DETAIL} line {n} is not a LoadGen MLLOG record: {exc}", field=DETAIL
            ) from exc
    if not out:
        raise ConfigError(f"{DETAIL} holds no MLLOG record: not a LoadGen detail log", field=DETAIL)
    return out


def parse_result(summary: str, detail: str) -> LoadGenResult:
    """LoadGen's result from the texts of its summary and detail logs."""
    kv = parse_detail(detail)
    head = dict(_FIELD.findall(summary))
    scenario = str(kv.get("effective_scenario") or head.get("Scenario") or "")
    mode = str(kv.get("effective_test_mode") or head.get("Mode") or "")
    if not scenario or not mode:
        raise ConfigError("the logs name no scenario or test mode", field=SUMMARY)
    result = {
        k[len("result_") :]: _checked(v, k, k[len("result_") :] in _NUMERIC_RESULTS)
        for k, v in kv.items()
        if k.startswith("result_")
    }
    pct: dict[str, int] = {}
    for key, value in kv.items():
        m = _PCT.match(key)
        if m and (m.group(1) not in pct or m.group(2)):  # per query wins (MultiStream)
            pct[m.group(1)] = _count(value, key, DETAIL)
    validity = kv.get("result_validity") or head.get("Result is")
    reasons = [f"LoadGen: {r.strip()} not satisfied" for r in _SATISFIED.findall(summary)]
    why = str(kv.get("result_invalid_reason") or "").strip()
    if validity == "INVALID" and why:
        reasons.append(f"LoadGen: {why}")
    errors = _count(kv.get("num_errors") or 0, "num_errors", DETAIL)
    effective = {
        k[len("effective_") :]: _checked(v, k, k == "effective_target_qps")
        for k, v in kv.items()
        if k.startswith("effective_")
    }
    if errors:
        reasons.append(f"LoadGen: {errors} errors")
    return LoadGenResult(
        scenario=scenario,
        mode=mode,
        sut_name=str(kv.get("sut_name") or head.get("SUT name") or ""),
        validity=str(validity) if validity else None,
        reasons=tuple(reasons),
        percentiles_ns=pct,
        result=result,
        effective=effective,
        errors=errors,
        loadgen_version=str(kv.get("loadgen_version") or ""),
    )


def trace_samples(text: str) -> np.ndarray:
    """One row per sample from a trace log, ordered by ``sample_seq`` (ns, LoadGen clock)."""
    rows: list[tuple[int, int, int, int, int, int]] = []
    for line in text.splitlines():
        if not line.startswith('{"name":"Sample"') or '"ph":"b"' not in line:
            continue
        try:
            ev = json.loads(line.rstrip().rstrip(","))
            a = ev["args"]
            scheduled = _count(_number(ev["ts"], "ts", TRACE) * 1000, "ts", TRACE)
            issued = _count(a["issue_start_ns"], "issue_start_ns", TRACE)
            completed = _count(a["complete_ns"], "complete_ns", TRACE)
            rows.append(
                (
                    _count(a["sample_seq"], "sample_seq", TRACE),
                    _count(a["query_seq"], "query_seq", TRACE),
                    _count(a["sample_idx"], "sample_idx", TRACE),
                    scheduled,
                    _count(scheduled + issued, "ts + issue_start_ns", TRACE),
                    _count(scheduled + completed, "ts + complete_ns", TRACE),
                )
            )
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise ConfigError(
                f"{TRACE}: a Sample event is malformed: {exc}"[:300], field=TRACE
            ) from exc
    out = np.array(rows, dtype=TRACE_DTYPE)
    return np.sort(out, order="sample_seq")


def accuracy_entries(text: str) -> list[tuple[int, bytes]]:
    """(qsl_idx, response bytes) of every entry of an accuracy log."""
    try:
        doc = json.loads(text) if text.strip() else []
        return [
            (_count(e["qsl_idx"], "qsl_idx", ACCURACY), bytes.fromhex(str(e["data"]))) for e in doc
        ]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ConfigError(
            f"{ACCURACY} is not a LoadGen accuracy log: {exc}", field=ACCURACY
        ) from exc


def imagenet_top1(
    entries: list[tuple[int, bytes]], labels: np.ndarray, *, dtype: str = "int64"
) -> tuple[int, int]:
    """(good, total) as MLPerf's ImageNet checker counts them: each ``qsl_idx`` once (the
    first response), its predicted class = the first element of the response data."""
    seen: set[int] = set()
    good = 0
    for idx, data in entries:
        if idx in seen:
            continue  # LoadGen may send a sample more than once
        seen.add(idx)
        if idx >= len(labels):
            raise ConfigError(
                f"{ACCURACY}: qsl_idx {idx} is past the data set's {len(labels)} samples",
                field=ACCURACY,
            )
        if len(data) % np.dtype(dtype).itemsize:
            raise ConfigError(
                f"{ACCURACY}: the response of qsl_idx {idx} is {len(data)} bytes, not whole "
                f"{dtype} values",
                field=ACCURACY,
            )
        values = np.frombuffer(data, dtype=np.dtype(dtype))
        if values.size and int(values[0]) == int(labels[idx]):
            good += 1
    return good, len(seen)


def _number(value: Any, what: str, file: str) -> float:
    """A finite number >= 0 that LoadGen wrote; ConfigError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{file}: {what} is {str(value)[:40]!r}, not a number", field=file)
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ConfigError(f"{file}: {what} is {number}, not a finite number >= 0", field=file)
    return number


def _count(value: Any, what: str, file: str) -> int:
    """A whole number 0 .. 2**63 - 1 (a count, an index or ns) that LoadGen wrote."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, float) and math.isfinite(value):
        number = round(value)
    else:
        raise ConfigError(f"{file}: {what} is {str(value)[:40]!r}, not a whole number", field=file)
    if not 0 <= number <= _MAX_NS:
        raise ConfigError(f"{file}: {what} is {number}, out of 0 .. 2**63 - 1"[:200], field=file)
    return number


def _checked(value: Any, key: str, numeric: bool) -> Any:
    """A detail log's value as stored: where the summary reads a number (``numeric``)
    it must be one, finite, 0 .. 2**63 - 1; any other float must be finite; the rest
    is kept as LoadGen wrote it."""
    if numeric:
        number = _number(value, key, DETAIL)
        if number > _MAX_NS:
            raise ConfigError(f"{DETAIL}: {key} is {number:g}, past 2**63 - 1", field=DETAIL)
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{DETAIL}: {key} is {value}, not a finite number", field=DETAIL)
    return value


def format_accuracy(good: int, total: int) -> str:
    """The checker's output line."""
    pct = 100.0 * good / total if total else 0.0
    return f"accuracy={pct:.3f}%, good={good}, total={total}\n"
