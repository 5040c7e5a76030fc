"""One comparison of several evaluations of the same model over the same samples.

Each evaluation's data-set pass stored its per-sample raw outputs (see
:mod:`broker.accuracy`); :func:`fetch_outputs` reads them back over the bus and
:func:`compare` measures, for every run against the reference run (the first one),
the output divergence of :mod:`mlscope.divergence` -- max absolute difference,
top-1 agreement, mean KL(reference || run) -- over the samples both runs answered,
next to each run's own accuracy. Runs are labelled by the caller (a framework name,
an agent id, ...), so the same code compares frameworks on one agent or one
framework on every agent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from broker.accuracy import decode_raw
from mlscope import remote
from mlscope.bus import Bus
from mlscope.divergence import OutputKind, divergence
from mlscope.errors import EvaluationError

__all__ = [
    "Comparison",
    "Outputs",
    "Row",
    "compare",
    "compare_evaluations",
    "fetch_outputs",
    "format_comparison",
]


@dataclass(frozen=True)
class Outputs:
    """The per-sample raw outputs of one evaluation's data-set pass."""

    label: str
    evaluation_id: str
    samples: np.ndarray
    """Data-set row of each output (sorted)."""
    labels: np.ndarray
    raw: np.ndarray
    """(samples, ...) raw first outputs."""
    kind: OutputKind
    accuracy: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Row:
    label: str
    evaluation_id: str
    samples: int
    max_abs_diff: float
    top1_agreement: float
    mean_kl: float
    accuracy: dict[str, float]


@dataclass(frozen=True)
class Comparison:
    reference: str
    kind: OutputKind
    rows: tuple[Row, ...]
    """One row per run, the reference first (its divergence is 0 by definition)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "kind": self.kind,
            "rows": [asdict(r) for r in self.rows],
        }


def compare(runs: Sequence[Outputs], *, reference: int = 0) -> Comparison:
    """Divergence of every run from ``runs[reference]`` over their common samples."""
    if len(runs) < 2:
        raise EvaluationError("a comparison needs at least two runs")
    ref = runs[reference]
    kinds = {r.kind for r in runs}
    if len(kinds) > 1:
        raise EvaluationError(f"runs disagree on the output kind: {sorted(kinds)}")
    ordered = [ref, *[r for i, r in enumerate(runs) if i != reference]]
    rows = []
    for run in ordered:
        common, ia, ib = np.intersect1d(ref.samples, run.samples, return_indices=True)
        if not len(common):
            raise EvaluationError(f"{run.label} and {ref.label} share no sample")
        if ref.raw.shape[1:] != run.raw.shape[1:]:
            raise EvaluationError(
                f"{run.label} outputs {run.raw.shape[1:]}, {ref.label} outputs {ref.raw.shape[1:]}"
            )
        d = divergence(ref.raw[ia], run.raw[ib], kind=ref.kind)
        rows.append(
            Row(
                label=run.label,
                evaluation_id=run.evaluation_id,
                samples=len(common),
                max_abs_diff=d.max_abs_diff,
                top1_agreement=d.top1_agreement,
                mean_kl=d.mean_kl,
                accuracy=dict(run.accuracy),
            )
        )
    return Comparison(reference=ref.label, kind=ref.kind, rows=tuple(rows))


async def fetch_outputs(
    bus: Bus, evaluation_id: str, *, label: str, accuracy: dict[str, float] | None = None
) -> Outputs:
    """The stored per-sample outputs of one evaluation (read-only SQL over the bus)."""
    _, rows = await remote.sql(
        bus,
        "SELECT sample, label, kind, shape, raw FROM outputs FINAL "
        "WHERE evaluation_id = {e:String} ORDER BY sample",
        {"e": evaluation_id},
        timeout=60,
    )
    if not rows:
        raise EvaluationError(
            f"evaluation {evaluation_id} stored no outputs (was it run with --accuracy?)",
            evaluation_id=evaluation_id,
        )
    shape = tuple(int(d) for d in str(rows[0][3]).split(",") if d)
    raw = np.stack([decode_raw(str(r[4])).reshape(shape) for r in rows])
    return Outputs(
        label=label,
        evaluation_id=evaluation_id,
        samples=np.array([int(r[0]) for r in rows]),
        labels=np.array([int(r[1]) for r in rows]),
        raw=raw,
        kind=str(rows[0][2]),  # type: ignore[arg-type]
        accuracy=dict(accuracy or {}),
    )


async def compare_evaluations(
    bus: Bus,
    runs: Sequence[tuple[str, str, dict[str, float] | None]],
) -> Comparison:
    """Fetch (label, evaluation id, accuracy) runs' outputs and compare them to the first."""
    outputs = [
        await fetch_outputs(bus, eval_id, label=label, accuracy=acc) for label, eval_id, acc in runs
    ]
    return compare(outputs)


def format_comparison(c: Comparison) -> str:
    metrics = sorted(
        {k for r in c.rows for k in r.accuracy if k.startswith("top") or k == "binary_auc"}
    )
    head = (
        f"  {'run':<14}{'samples':>8}"
        + "".join(f"{m:>10}" for m in metrics)
        + f"{'max|diff|':>12}{'top1 agree':>12}{'KL (nats)':>12}"
    )
    lines = [f"  divergence from {c.reference} ({c.kind})", head]
    for r in c.rows:
        acc = "".join(f"{r.accuracy.get(m, float('nan')):>10.4f}" for m in metrics)
        lines.append(
            f"  {r.label:<14}{r.samples:>8}{acc}{r.max_abs_diff:>12.3g}"
            f"{r.top1_agreement:>12.4f}{r.mean_kl:>12.3g}"
        )
    return "\n".join(lines)
