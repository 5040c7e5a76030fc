"""The data-set pass of an evaluation: every labelled sample once, outputs kept per sample.

Unlike a load run (which keeps only each query's top-1 answer), the data-set pass
asks the agent for the model's raw first output as well (``Query.raw``) and keeps,
for every sample: its label, the pipeline's answer (post-processed output) and the
raw output. From those come the metric of the manifest -- top-1 and top-5 for a
classifier, ``binary_auc`` for a binary scorer -- and, across frameworks, the output
divergence (:mod:`broker.compare`). The per-sample outputs are stored in the
``outputs`` table (raw outputs as base64 float32 so that the read-only SQL bridge
returns them intact).

Definitions:

* top-k = fraction of samples whose label is among the k best classes. The ranking
  is the pipeline's answer when post-processing returns class indices (``topk``),
  else the raw output sorted descending.
* binary_auc = P(score of a positive > score of a negative) + 0.5 P(tie)
  (Mann-Whitney U / (n_pos n_neg)), score = the raw output's last value.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from broker.db import Database
from mlscope import codec, schema
from mlscope.bus import Bus
from mlscope.contracts import ErrorReply, Query, QueryReply, TraceLevel
from mlscope.divergence import OutputKind
from mlscope.errors import EvaluationError, MLScopeError
from mlscope.manifest import ModelManifest

__all__ = [
    "OUTPUT_COLUMNS",
    "DatasetRun",
    "binary_auc",
    "dataset_pass",
    "decode_raw",
    "metrics",
    "output_kind",
    "store_outputs",
]

REPLY_TIMEOUT_S = 60.0
MAX_QUERY_BYTES = 800_000
OUTPUT_COLUMNS = schema.OUTPUTS.names


@dataclass
class DatasetRun:
    """Per-sample results of one pass (sample i = data-set row ``indices[i]``)."""

    indices: np.ndarray
    labels: np.ndarray
    answers: np.ndarray | None
    """Post-processed outputs, one row per sample (None where a query failed)."""
    raw: np.ndarray
    """Raw first outputs, one row per sample (float32)."""
    kind: OutputKind
    errors: dict[int, str]


def output_kind(manifest: ModelManifest) -> OutputKind:
    """Are the raw outputs logits (post-processing applies softmax) or probabilities?"""
    steps = {next(iter(s)) for s in manifest.outputs[0].steps}
    if "softmax" in steps or "sigmoid" in steps:
        return "logits"
    return "probabilities" if manifest.outputs[0].type == "probability" else "logits"


async def dataset_pass(
    bus: Bus,
    *,
    subject: str,
    evaluation_id: str,
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int,
    kind: OutputKind,
    limit: int | None = None,
    window: int = 4,
) -> DatasetRun:
    """Send samples 0..n-1 in order, ``window`` queries outstanding; keep every output."""
    n = len(x) if limit is None else min(limit, len(x))
    per_sample = max(1, x[0].nbytes)
    batch_size = max(1, min(batch_size, MAX_QUERY_BYTES // per_sample))  # NATS max payload
    starts = list(range(0, n, batch_size))
    replies: dict[int, QueryReply | str] = {}
    inbox = bus.nc.new_inbox()
    done = anyio.Event()
    slots = anyio.Semaphore(window)

    anonymous: list[str] = []
    """Errors that name no query of this pass: each still answered one."""

    async def on_reply(msg: Any) -> None:
        try:
            index, answer = _reply_of(msg.data)
        except MLScopeError:
            return  # not an answer at all
        if 0 <= index < len(starts) and index not in replies:
            replies[index] = answer
        elif isinstance(answer, str):
            anonymous.append(answer)
        else:
            return  # a reply to no query of this pass
        slots.release()
        if len(replies) + len(anonymous) >= len(starts):
            done.set()

    sub = await bus.nc.subscribe(inbox, cb=on_reply)
    try:
        for q, s in enumerate(starts):
            with anyio.move_on_after(REPLY_TIMEOUT_S) as waited:
                await slots.acquire()
            if waited.cancelled_caught:  # the agent stopped answering: the rest fail
                break
            payload = Query(  # untraced: the load run's spans are the evaluation's
                evaluation_id=evaluation_id,
                index=q,
                inputs=x[s : min(s + batch_size, n)],
                raw=True,
                trace_level=int(TraceLevel.NONE),
            )
            await bus.nc.publish(subject, codec.encode_model(payload), reply=inbox)
        with anyio.move_on_after(REPLY_TIMEOUT_S):
            await done.wait()
    finally:
        await sub.unsubscribe()
    return _collect(replies, starts, n, y, kind, batch_size)


def _reply_of(data: bytes) -> tuple[int, QueryReply | str]:
    """(query index, its reply or its error message) of one answer; a WireError when
    it is not one."""
    doc = codec.decode(data)
    if isinstance(doc, dict) and doc.get("kind") == "error":
        err = codec.validate(ErrorReply, doc).error
        fields = err.get("fields")
        index = fields.get("index", -1) if isinstance(fields, dict) else -1
        return (index if isinstance(index, int) else -1), str(err.get("message", "error"))
    reply = codec.validate(QueryReply, doc)
    return reply.index, (reply if reply.ok else str((reply.error or {}).get("message", "error")))


def _collect(
    replies: dict[int, QueryReply | str],
    starts: list[int],
    n: int,
    y: np.ndarray,
    kind: OutputKind,
    batch: int,
) -> DatasetRun:
    raws: list[np.ndarray] = []
    answers: list[np.ndarray] = []
    keep: list[np.ndarray] = []
    errors: dict[int, str] = {}
    for q, s in enumerate(starts):
        r = replies.get(q, "no reply")
        if isinstance(r, str) or r.raw_outputs is None or r.outputs is None:
            errors[q] = r if isinstance(r, str) else "reply without raw outputs"
            continue
        idx = np.arange(s, min(s + batch, n))
        first = (raws[0].shape[1], answers[0].shape[1]) if raws else None
        rows = _rows(r.raw_outputs, r.outputs, len(idx), first)
        if isinstance(rows, str):  # this query's samples fail, not the pass
            errors[q] = rows
            continue
        keep.append(idx)
        raws.append(rows[0])
        answers.append(rows[1])
    if not keep:
        raise EvaluationError(
            f"the data-set pass got no output ({len(errors)} queries "
            f"failed: {next(iter(errors.values()), '')})"
        )
    indices = np.concatenate(keep)
    return DatasetRun(
        indices=indices,
        labels=np.asarray(y)[indices],
        answers=np.concatenate(answers),
        raw=np.concatenate(raws),
        kind=kind,
        errors=errors,
    )


def _rows(
    raw: np.ndarray, outputs: np.ndarray, samples: int, widths: tuple[int, int] | None
) -> tuple[np.ndarray, np.ndarray] | str:
    """One reply's raw outputs (float32) and answers, a row per sample; or why they are
    not that: numbers, as many rows as samples, as wide as the first reply's
    (``widths``: the rows of every reply are joined into one table)."""
    if raw.dtype.kind not in "biuf" or outputs.dtype.kind not in "biuf":
        return f"reply's outputs are not numbers ({raw.dtype}, {outputs.dtype})"
    if raw.size % samples or outputs.size % samples or not raw.size or not outputs.size:
        return f"reply's outputs are not one row per sample of its {samples}"
    rows = raw.reshape(samples, -1).astype(np.float32), outputs.reshape(samples, -1)
    got = (rows[0].shape[1], rows[1].shape[1])
    if widths is not None and got != widths:
        return f"reply's rows are {got} wide (raw, post-processed), the first reply's {widths}"
    return rows


def metrics(run: DatasetRun, metric: str) -> dict[str, float]:
    """The manifest's metric (and top-5 with top-1) over the samples answered."""
    out: dict[str, float] = {
        "samples": float(len(run.indices)),
        "failed_queries": float(len(run.errors)),
    }
    if metric == "binary_auc":
        out["binary_auc"] = binary_auc(run.raw[:, -1], run.labels)
        return out
    if metric == "none":
        return out
    ranking = _ranking(run)
    for k in (1, 5):
        if ranking.shape[1] >= k:
            hit = (ranking[:, :k] == run.labels[:, None]).any(axis=1)
            out[f"top{k}"] = float(hit.mean())
    return out


def _ranking(run: DatasetRun) -> np.ndarray:
    a = run.answers
    if a is not None and np.issubdtype(a.dtype, np.integer) and a.shape[1] < run.raw.shape[1]:
        return a  # post-processing returned class indices, best first
    return np.argsort(-run.raw, axis=1, kind="stable")[:, :5]


def binary_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney AUC with ties counted half (see the module doc)."""
    s = np.asarray(scores, np.float64)
    pos, neg = s[np.asarray(labels) > 0], s[np.asarray(labels) <= 0]
    if not len(pos) or not len(neg):
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return float((greater + 0.5 * ties) / (len(pos) * len(neg)))


def store_outputs(db: Database, evaluation_id: str, run: DatasetRun) -> None:
    """Keep the per-sample outputs of a data-set pass (for comparisons across runs)."""
    rank = _ranking(run)
    shape = ",".join(str(d) for d in run.raw.shape[1:])
    raws = [
        base64.b64encode(np.ascontiguousarray(r, np.float32).tobytes()).decode() for r in run.raw
    ]
    n = len(run.indices)
    cols: list[list[Any]] = [
        [evaluation_id] * n,
        [int(i) for i in run.indices],
        [int(v) for v in run.labels],
        [int(v) for v in rank[:, 0]],
        [run.kind] * n,
        [shape] * n,
        raws,
    ]
    db.insert("outputs", cols, OUTPUT_COLUMNS)


def decode_raw(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), np.float32)
