"""What an MLPerf test's logs become (:mod:`broker.mlperf` runs or imports them): one
``queries`` row per LoadGen sample from its trace log, tied to the agent's timestamps
of the query that carried it (:func:`sample_record`); the summary of those rows with
LoadGen's verdict, its own figures kept apart (:func:`loadgen_summary`); top-1 as
MLPerf's ImageNet checker computes it (:func:`loadgen_accuracy`); and every log file
verbatim, in parts (:func:`store_logs`). See :mod:`broker.mlperf` for the clocks.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from broker import mlperf_logs as logs
from broker.db import Database
from broker.summary import figures, latency_split
from mlscope import schema
from mlscope.contracts import EvaluationSummary, JobRequest, LatencyStats
from mlscope.record import RunRecord

__all__ = [
    "ACCURACY_FILE",
    "LOGS_TABLE",
    "LOG_COLUMNS",
    "LOG_PART_CHARS",
    "loadgen_accuracy",
    "loadgen_summary",
    "sample_record",
    "store_logs",
]

ACCURACY_FILE = "accuracy.txt"
LOG_COLUMNS = schema.MLPERF_LOGS.names
LOG_PART_CHARS = 256_000
"""Log files are stored in parts this long, so each read fits one bus message."""
LOGS_TABLE = schema.MLPERF_LOGS.create()


def sample_record(
    samples: np.ndarray, timing: dict[str, Any] | None, offset_ns: int, labels: np.ndarray | None
) -> RunRecord:
    """One row per LoadGen sample, each of batch size 1 (see the module doc for the
    clocks); its times count from LoadGen's start of the test, as a run's from its start."""
    n = len(samples)
    rec = RunRecord(n=n, batch_size=1)
    if n == 0:
        return rec
    rec.scheduled[:] = samples["scheduled_ns"]
    rec.issued[:] = samples["issued_ns"]
    rec.completed[:] = samples["completed_ns"]
    rec.done = n
    if timing is None:  # imported: LoadGen's view only
        rec.ok[:] = 1
        return rec
    seqs = samples["query_seq"]
    issue_ns = timing["issue_ns"]
    first_issue = dict(zip(seqs[::-1].tolist(), samples["issued_ns"][::-1].tolist(), strict=True))
    ties = [int(issue_ns[q]) - i for q, i in first_issue.items() if q < len(issue_ns)]
    rec.t0_ns = int(np.median(ties)) if ties else 0
    where = {(int(q), int(p)): j for j, (q, p) in enumerate(timing["key"])}
    pos = _positions(seqs)
    agent = timing["agent"] - (offset_ns + rec.t0_ns)
    for k in range(n):
        j = where.get((int(seqs[k]), int(pos[k])))
        if j is None:
            rec.errors[k] = "no response"
        elif not timing["ok"][j]:
            rec.errors[k] = str(timing["error"][j])
        else:
            (
                rec.agent_received[k],
                rec.predict_start[k],
                rec.predict_end[k],
                rec.agent_replied[k],
            ) = agent[j]
            rec.ok[k] = 1
            rec.prediction[k] = int(timing["prediction"][j])
            if labels is not None:
                rec.correct[k] = int(rec.prediction[k] == int(labels[samples["sample_idx"][k]]))
    return rec


def _positions(seqs: np.ndarray) -> np.ndarray:
    """Each sample's position within its query (samples of a query are consecutive)."""
    starts = np.r_[0, np.flatnonzero(np.diff(seqs)) + 1]
    first = np.repeat(starts, np.diff(np.r_[starts, len(seqs)]))
    out: np.ndarray = np.arange(len(seqs)) - first
    return out


def loadgen_accuracy(
    result: logs.LoadGenResult, files: dict[str, str], labels: np.ndarray
) -> dict[str, float] | None:
    """Top-1 as MLPerf's ImageNet checker computes it; its output kept as a log file."""
    if result.mode != "AccuracyOnly":
        return None
    good, total = logs.imagenet_top1(logs.accuracy_entries(files.get(logs.ACCURACY, "")), labels)
    files[ACCURACY_FILE] = logs.format_accuracy(good, total)
    return {"top1": good / total if total else float("nan"), "samples": float(total)}


def loadgen_summary(
    result: logs.LoadGenResult,
    rec: RunRecord,
    job: JobRequest,
    eval_id: str,
    started: float,
    *,
    accuracy: dict[str, float] | None,
    imported: bool = False,
) -> EvaluationSummary:
    """The figures of the rows (mlscope's definitions, :func:`broker.summary.figures`)
    with LoadGen's verdict; LoadGen's own figures stay in ``mlperf`` (its ``doc``)."""
    target = result.effective.get("target_qps")
    return EvaluationSummary(
        evaluation_id=eval_id,
        job_id=job.job_id,
        status="completed",
        valid=result.valid,
        invalid_reasons=() if result.valid else result.reasons,
        model={"name": job.model, "version": job.model_version or ""},
        framework={"name": job.framework, "version": job.framework_version or ""},
        agent_id="imported" if imported else "",
        device=job.device,
        scenario={
            "name": f"mlperf-{result.scenario.lower()}",
            "mlperf_scenario": result.scenario,
            "mode": result.mode,
            "batch_size": rec.batch_size,  # a row, and so a query here, is one sample
            "sut_batch_size": job.mlperf.batch_size if job.mlperf else None,
            "seed": result.effective.get("schedule_rng_seed", 0),
        },
        trace_level="none",
        requested_qps=float(target)
        if target is not None and result.scenario in ("Server", "Offline")
        else None,
        latency_split_ms=None if imported else latency_split(rec) or None,
        accuracy=accuracy,
        mlperf={**result.doc(), "imported": imported},
        started_at=started,
        finished_at=time.time(),
        **(_figures(rec) if rec.n else _loadgen_figures(result)),
    )


def _figures(rec: RunRecord) -> dict[str, Any]:
    """The summary's figures from the rows (:func:`broker.summary.figures`); a rate over
    offsets that all fall at one instant (Offline's one query, scheduled and issued at
    once) is no rate: None."""
    f = figures(rec, has_labels=False)
    at_once = int(np.ptp(rec.scheduled)) == 0 and int(np.ptp(rec.issued)) == 0
    return {
        "queries": f.queries,
        "samples": f.samples,
        "errors": f.errors,
        "not_issued": f.not_issued,
        **{k: f.outcomes[k] for k in ("failed", "refused", "lost")},
        "duration_s": f.duration_s,
        "scheduled_qps": None if at_once else f.scheduled_qps,
        "achieved_qps": None if at_once else f.achieved_qps,
        "completed_qps": f.completed_qps,
        "latency_ms": f.latency_ms,
        "issue_lag_us": f.issue_lag_us,
        "throughput_ips": f.throughput_ips,
    }


def _loadgen_figures(result: logs.LoadGenResult) -> dict[str, Any]:
    """An import without a trace has no rows: its figures are LoadGen's (a query here
    is one sample, as a row would be)."""
    r, pct = result.result, result.percentiles_ns
    samples = int(r.get("query_count", 0)) * result.samples_per_query
    return {
        "queries": samples,
        "samples": samples,
        "errors": 0,
        "not_issued": 0,
        "duration_s": 0.0,
        "scheduled_qps": r.get("scheduled_samples_per_sec"),
        "achieved_qps": result.throughput_ips,
        "latency_ms": LatencyStats(
            trimmed_mean=None,
            p50=_ms(pct.get("50.00")),
            p90=_ms(pct.get("90.00")),
            p99=_ms(pct.get("99.00")),
            max=_ms(r.get("max_query_latency_ns", r.get("max_latency_ns"))),
        ),
        "issue_lag_us": {},
        "throughput_ips": result.throughput_ips,
    }


def _ms(ns: Any) -> float | None:
    return None if ns is None else float(ns) / 1e6


def store_logs(db: Database, evaluation_id: str, files: dict[str, str]) -> None:
    """Every log file verbatim, in parts of ``LOG_PART_CHARS``."""
    db.command(LOGS_TABLE)
    rows: list[tuple[str, str, int, str]] = []
    for name, text in sorted(files.items()):
        for part, start in enumerate(range(0, max(len(text), 1), LOG_PART_CHARS)):
            rows.append((evaluation_id, name, part, text[start : start + LOG_PART_CHARS]))
    db.insert("mlperf_logs", [list(c) for c in zip(*rows, strict=True)], LOG_COLUMNS)
