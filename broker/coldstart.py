"""The cold-start scenario (paper section 5.2): load + first inference vs warm inference.

Each repetition asks the agent to load the model again (``prepare`` with ``reload``:
the agent unloads it first when no other evaluation uses it), so the load really
happens every time; the agent reports the load time and the first inference (on
zeros, right after the load) measured on its own clock. Then ``warm_queries``
closed-loop queries measure warm inference on the same loaded model. The summary
keeps every repetition's figures and their medians; warm latency is the agent's
predict time (so load-generator transport does not blur the comparison) with the
end-to-end latency beside it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from broker.evalprep import PREPARE_TIMEOUT_S
from broker.summary import figures
from mlscope import codec, names
from mlscope.bus import Bus, request_model
from mlscope.contracts import PrepareReply, ScenarioSpec
from mlscope.record import ARRAYS, TIME_ARRAYS, RunRecord
from mlscope.stats import percentile

__all__ = ["concat", "reasons", "run"]

Drive = Callable[[ScenarioSpec], Awaitable[RunRecord]]


async def run(
    bus: Bus, agent_id: str, prepare: dict[str, Any], spec: ScenarioSpec, drive: Drive
) -> tuple[RunRecord, dict[str, Any]]:
    """All repetitions; returns the warm queries as one record and the cold-start figures."""
    warm_spec = ScenarioSpec(
        name="batched",
        batch_size=spec.batch_size,
        seed=spec.seed,
        duration_s=max(spec.duration_s, 60.0),
        max_queries=spec.warm_queries,
    )
    reps: list[dict[str, Any]] = []
    records: list[RunRecord] = []
    for r in range(spec.repetitions):
        prep = await request_model(
            bus,
            names.agent_ctl(agent_id),
            codec.encode({**prepare, "reload": True}),
            PrepareReply,
            timeout=PREPARE_TIMEOUT_S,
        )
        rec = await drive(warm_spec)
        records.append(rec)
        ok = rec.ok.astype(bool)
        predict_ms = (rec.predict_end - rec.predict_start)[ok] / 1e6
        e2e_ms = (rec.completed - rec.issued)[ok] / 1e6
        reps.append(
            {
                "repetition": r,
                "cold": prep.cold,
                "load_ms": prep.load_ns / 1e6,
                "first_inference_ms": prep.first_inference_ns / 1e6,
                "warm_predict_ms_p50": percentile(predict_ms, 50),
                "warm_latency_ms_p50": percentile(e2e_ms, 50),
            }
        )
    return concat(records), {**_figures(reps), "warm_throughput_ips": warm_throughput(records)}


def warm_throughput(records: list[RunRecord]) -> float | None:
    """Samples answered per second of the repetitions' warm queries: each
    repetition's throughput span (:func:`broker.summary.figures`' definition) summed,
    not the span of the record they are joined into, which holds the reloads between
    them (load time is the figure beside it)."""
    samples, span_s = 0, 0.0
    for r in records:
        f = figures(r, has_labels=False)
        if f.throughput_ips:
            samples += f.samples
            span_s += f.samples / f.throughput_ips
    return samples / span_s if span_s > 0 else None


def reasons(cold: dict[str, Any]) -> tuple[str, ...]:
    """Why a cold-start run is INVALID: a repetition that did not really load the model."""
    if cold["cold_loads"] < cold["repetitions"]:
        return (
            f"only {cold['cold_loads']} of {cold['repetitions']} repetitions loaded the "
            "model (another evaluation kept it loaded)",
        )
    return ()


def _figures(reps: list[dict[str, Any]]) -> dict[str, Any]:
    cold = [r for r in reps if r["cold"]]

    def med(key: str, rows: list[dict[str, Any]]) -> float | None:
        return percentile([r[key] for r in rows if r[key] is not None], 50)

    first, warm = med("first_inference_ms", cold), med("warm_predict_ms_p50", reps)
    return {
        "repetitions": len(reps),
        "cold_loads": len(cold),
        "load_ms": med("load_ms", cold),
        "first_inference_ms": first,
        "warm_predict_ms": warm,
        "warm_latency_ms": med("warm_latency_ms_p50", reps),
        "first_over_warm": first / warm if first is not None and warm else None,
        # the keys of a one-repetition summary, which readers of stored ones use
        "cold": bool(cold),
        "runs": reps,
    }


def concat(records: list[RunRecord]) -> RunRecord:
    """One record of several runs, times relative to the first run's t0."""
    first = records[0]
    out = RunRecord(n=sum(r.n for r in records), batch_size=first.batch_size)
    out.t0_ns = first.t0_ns
    for name in ARRAYS:
        parts = []
        for r in records:
            col = getattr(r, name)
            if name in TIME_ARRAYS:  # 0 means "never happened": keep it 0
                col = np.where(col != 0, col + (r.t0_ns - first.t0_ns), 0)
            parts.append(col)
        setattr(out, name, np.concatenate(parts).astype(getattr(out, name).dtype))
    base = 0
    for r in records:
        out.errors.update({base + i: e for i, e in r.errors.items()})
        out.not_issued += r.not_issued
        out.cpu_s += r.cpu_s
        base += r.n
    out.done = sum(r.done for r in records)
    out.preprocessed = all(r.preprocessed for r in records)
    return out
