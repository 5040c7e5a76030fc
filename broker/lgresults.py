"""A slice's result: the raw arrays a load generator writes when its dealt slice ends.

A load-generator process (:mod:`broker.distributed`) writes its slice's arrays and
errors into a file, a load-generator service (:mod:`broker.lgservice`) into the work
bucket (:func:`save_result`); the server reads each back, every array checked from
its header before any is decompressed (:func:`load_result`), and merges the slices
by global index into one :class:`RunRecord` (:func:`merge_results`), cut where the
first of them stopped when the run was cancelled (:func:`until_first_stop`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from mlscope import codec, outcomes, schedule
from mlscope.bounded import npz_headers
from mlscope.errors import EvaluationError
from mlscope.record import ARRAYS, RunRecord
from mlscope.schedule import Schedule

__all__ = ["load_result", "merge_results", "save_result", "until_first_stop"]


def save_result(rec: RunRecord, file: str | BinaryIO) -> None:
    """A slice's raw arrays and errors as ``.npz`` (read back by :func:`load_result`)."""
    errs = sorted(rec.errors.items())
    np.savez(
        file,
        **{name: getattr(rec, name) for name in ARRAYS},
        batch_size=rec.batch_size,
        t0_ns=rec.t0_ns,
        not_issued=rec.not_issued,
        cpu_s=rec.cpu_s,
        error_index=np.asarray([i for i, _ in errs], np.int64),
        error_message=np.asarray([m[: codec.MAX_ERROR_CHARS] for _, m in errs], dtype=str),
    )


def _result_layout(queries: int) -> dict[str, tuple[str, int | None]]:
    """Each array of a slice of ``queries`` queries: (dtype kinds it may have, length;
    None for a scalar, -1 for at most ``queries``)."""
    layout: dict[str, tuple[str, int | None]] = dict.fromkeys(ARRAYS, ("iufb", queries))
    layout.update(batch_size=("iu", None), t0_ns=("iu", None), not_issued=("iu", None))
    layout.update(cpu_s=("f", None), error_index=("iu", -1), error_message=("U", -1))
    return layout


def _check_result(z: Any, queries: int) -> None:
    """Every array of a result read from its header, before any is decompressed: a
    result is what a load-generator service wrote into the work bucket, and a small
    compressed object can claim gigabytes."""
    layout = _result_layout(queries)
    headers = npz_headers(z)
    if set(headers) != set(layout):
        raise EvaluationError(f"a slice's result has arrays {sorted(headers)[:20]}")
    for name, (kinds, length) in layout.items():
        shape, dtype = headers[name]
        ok = dtype.kind in kinds and (
            shape == () if length is None else len(shape) == 1 and shape[0] <= queries
        )
        ok = ok and (length != queries or shape == (queries,))
        ok = ok and (dtype.kind != "U" or dtype.itemsize <= 4 * codec.MAX_ERROR_CHARS)
        if not ok:
            raise EvaluationError(
                f"a slice's result array {name} is {dtype} {shape}, not one a slice of "
                f"{queries} queries has"
            )


def load_result(path: Path | BinaryIO, queries: int) -> tuple[RunRecord, dict[int, str]]:
    """A slice's record and its errors by local position (:func:`save_result`), for a
    slice of ``queries`` queries: arrays of any other shape are refused unread."""
    with np.load(path) as z:
        _check_result(z, queries)
        rec = RunRecord(n=int(z["scheduled"].size), batch_size=int(z["batch_size"]))
        for name in ARRAYS:
            setattr(rec, name, z[name])
        rec.t0_ns, rec.not_issued = int(z["t0_ns"]), int(z["not_issued"])
        rec.cpu_s = float(z["cpu_s"])
        errors = {int(i): str(m) for i, m in zip(z["error_index"], z["error_message"], strict=True)}
    rec.errors = errors
    return rec, errors


def merge_results(
    parts: list[Schedule], results: list[tuple[RunRecord, dict[int, str]]]
) -> RunRecord:
    """One record in global order from the slices' records. A slice whose scheduled
    times are not its schedule's is refused (an EvaluationError naming it): every
    latency counts from the schedule the server dealt, not from what a load generator
    says it was."""
    recs = [r for r, _ in results]
    for j, (part, rec) in enumerate(zip(parts, recs, strict=True)):
        if not np.array_equal(rec.scheduled, part.offsets_ns):
            raise EvaluationError(
                f"slice {j}'s result has scheduled times other than its slice's", slice=j
            )
    n = sum(r.n for r in recs)
    out = RunRecord(n=n, batch_size=recs[0].batch_size, t0_ns=recs[0].t0_ns)
    for name in ARRAYS:
        setattr(out, name, schedule.merge_values(parts, [getattr(r, name) for r in recs]))
    out.not_issued = sum(r.not_issued for r in recs)
    out.cpu_s = sum(r.cpu_s for r in recs)
    out.done = sum(int(np.count_nonzero(r.completed)) for r in recs)
    for part, (_, errs) in zip(parts, results, strict=True):
        out.errors.update({int(part.index[i]): m for i, m in errs.items()})
    return out


def until_first_stop(rec: RunRecord, parts: list[Schedule]) -> RunRecord:
    """A stopped run's merged record, up to where the first of its load generators
    (processes, or services: :mod:`broker.multihost`) stopped.

    The processes hear ``stop`` a few milliseconds apart. Past the first one's stop, its
    queries were never due while another process still sent its own: kept, they would
    be stored as not issued, which says the outstanding bound held them. Cut there, the
    record is what one load generator stopped at that moment leaves (the later queries
    of the others were sent only because the stop reached them later)."""
    sent = outcomes.was_sent(rec.issued, rec.completed)
    cut = rec.n
    for part in parts:
        mine = np.flatnonzero(sent[part.index])
        after = int(mine[-1]) + 1 if mine.size else 0  # its first query never sent
        if after < len(part):
            cut = min(cut, int(part.index[after]))
    rec.trim(cut)
    rec.errors = {i: m for i, m in rec.errors.items() if i < cut}
    rec.done = int(np.count_nonzero(rec.completed))
    return rec
