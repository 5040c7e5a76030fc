"""The record of a local run (:mod:`agent.localrun`): its rows as the run's threads
write them and as the shipper takes them.

A :class:`LocalRecord` holds the run's :class:`~mlscope.record.RunRecord` (times in ns
from ``t0`` on this agent's :data:`now`) and each sample's top-1, grows it while a
closed loop outlasts its room (forgetting the rows already shipped), writes a stream's
answered blocks into it many at once, and hands out the rows not shipped yet
(:meth:`LocalRecord.take`, on the event loop's shipper). Every change is made under
one lock, which the run's threads share with the shipper.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from agent.stream import Answered
from mlscope import samples
from mlscope.contracts import MAX_SCHEDULED_QUERIES, ScenarioSpec
from mlscope.errors import ConfigError
from mlscope.record import ARRAYS, RunRecord
from mlscope.schedule import Schedule

__all__ = ["FILL_BLOCKS", "FILL_BYTES", "LocalRecord", "now"]

now = time.perf_counter_ns
"""The agent's clock of a local run (ns)."""
FILL_BLOCKS = 256
"""A stream's answered blocks are written into the record at the latest once this many
wait (a run that nobody ships from during it keeps at most these) ..."""
FILL_BYTES = 64 << 20
"""... or once their outputs hold this many bytes (a model with large outputs)."""


class LocalRecord:
    """The rows of one local run, as :class:`agent.localrun.LocalRun` writes them and
    the shipper takes them; the run sets :attr:`spec`, :attr:`closed` and
    :attr:`schedule` before it makes room for its first ``n`` queries (``__init__``)."""

    spec: ScenarioSpec
    closed: bool
    schedule: Schedule | None

    def __init__(self, n: int) -> None:
        spec = self.spec
        self._answers: list[Answered] = []
        """A stream's answered blocks not yet written into the record (:meth:`_fill`)."""
        self._answer_bytes = 0
        if n * spec.batch_size > MAX_SCHEDULED_QUERIES:  # each sample's answer is kept
            raise ConfigError(
                f"a run of {n:,} queries of batch {spec.batch_size:,} holds "
                f"{n * spec.batch_size:,} samples' answers, over the "
                f"{MAX_SCHEDULED_QUERIES:,} one run may have",
                field="batch_size",
            )
        self.rec = RunRecord(n=n, batch_size=spec.batch_size)
        if self.schedule is not None:  # known before the run starts (a stop may come first)
            self.rec.scheduled[:] = self.schedule.offsets_ns
        self.top1 = np.full((n, spec.batch_size), -1, np.int32)
        self._lock = threading.Lock()  # record growth against snapshots
        self._issued = 0
        self._shipped = 0
        self._base = 0
        """The query whose times are the record's row 0: a closed loop that outruns its
        record forgets the rows it has shipped (:meth:`_grow`) instead of growing for
        ever (a tiny model's batched stream answers ~10^5 queries a second)."""

    def answered(self, block: Answered) -> None:
        """A stream's answered queries (on the predict thread, or the thread answering
        for it while it predicts): kept as they are. They are written into the record
        many blocks at once (:meth:`_fill`) when rows are shipped, when the stream ends,
        and at the latest every :data:`FILL_BLOCKS` blocks or :data:`FILL_BYTES` of
        outputs: off the predict thread, whose every
        microsecond between two predicts is the runtime's."""
        with self._lock:
            self._answers.append(block)
            if block.outputs is not None:
                self._answer_bytes += block.outputs.nbytes
            if len(self._answers) >= FILL_BLOCKS or self._answer_bytes >= FILL_BYTES:
                self._fill()

    def _fill(self) -> None:
        """The stream's kept blocks into the record, in one pass (under the lock): their
        times and top-1; each query completed when its block's post-processing ended.
        ``completed`` is written last (a row ships once it is set)."""
        blocks, self._answers, self._answer_bytes = self._answers, [], 0
        if not blocks:
            return
        rec, t0 = self.rec, self.rec.t0_ns
        times = np.concatenate([b.times for b in blocks]) if len(blocks) > 1 else blocks[0].times
        sizes = [len(b.times) for b in blocks]
        idx = times[:, 0] - self._base
        taken = np.maximum(times[:, 1] - t0, 1)
        rec.scheduled[idx] = rec.paced[idx] = rec.issued[idx] = taken
        rec.agent_received[idx] = taken
        ok = np.ones(len(idx), bool)
        first = 0
        for b, size in zip(blocks, sizes, strict=True):
            for k, err in b.errors.items():
                ok[first + k] = False
                rec.errors[int(b.times[k, 0])] = err.message
            first += size
        good = idx[ok]
        rec.predict_start[good] = times[ok, 2] - t0
        rec.predict_end[good] = times[ok, 3] - t0
        rec.ok[good] = 1
        self._top1(blocks, good)
        ends = np.repeat(np.array([b.post_end for b in blocks], np.int64) - t0, sizes)
        rec.agent_replied[idx] = ends
        rec.completed[idx] = np.maximum(ends, 1)
        rec.done += len(idx)

    def _top1(self, blocks: list[Answered], good: np.ndarray) -> None:
        """Each answered sample's top-1 (the first value of its output), the blocks' rows
        ``good`` of the record in order: in one step when every block's outputs have the
        same shape past axis 0 and as many rows per query, else block by block; a block
        whose outputs have no value per query leaves its rows unscored."""
        outs = [(b.outputs, len(b.times) - len(b.errors)) for b in blocks if b.outputs is not None]
        if not outs:
            return
        shapes = {(o.shape[1:], o.shape[0] / n if n else -1.0) for o, n in outs}
        if len(shapes) == 1:
            joined = outs[0][0] if len(outs) == 1 else np.concatenate([o for o, _ in outs])
            top = samples.top1(joined)
            if top is not None and len(good) and top.size % len(good) == 0:
                self._write_top1(good, top)
                return
        first = 0
        for b in blocks:
            n = len(b.times) - len(b.errors)
            top = samples.top1(b.outputs)
            if top is not None and n and top.size % n == 0:
                self._write_top1(good[first : first + n], top)
            first += n

    def _write_top1(self, rows: np.ndarray, top: np.ndarray) -> None:
        per = top.reshape(len(rows), -1)
        w = min(per.shape[1], self.top1.shape[1])
        self.top1[rows, :w] = per[:, :w]

    def _grow(self) -> None:
        """The run outlasts the record's room (under the lock, on the thread that writes
        the record): when at least half of it is shipped, forget those rows; else double
        it. Never stop early."""
        rec, shipped = self.rec, self._shipped - self._base
        if shipped >= rec.n // 2 > 0:
            rec.drop(shipped)
            kept = np.full_like(self.top1, -1)
            kept[: rec.n - shipped] = self.top1[shipped:]
            self.top1 = kept
            self._base += shipped
            rec.errors = {i: e for i, e in rec.errors.items() if i >= self._base}
            return
        rec.grow()
        grown = np.full((rec.n, self.spec.batch_size), -1, np.int32)
        grown[: len(self.top1)] = self.top1
        self.top1 = grown

    def _trim(self) -> None:
        """The run ended: the record holds exactly the queries issued (under the lock)."""
        self._fill()
        self.rec.trim(self._issued - self._base)
        self.top1 = self.top1[: self._issued - self._base]

    @property
    def queries(self) -> int:
        """Queries the record has held, shipped ones included (after the run: issued)."""
        return self._base + self.rec.n

    def take(self, *, final: bool = False) -> tuple[int, dict[str, np.ndarray], dict[int, str]]:
        """Rows not shipped yet, as copied columns: every row up to the first one still
        in flight; ``final``: every row of the run, in flight ones included (a run
        stopped early, as when its job is cancelled, reports every query it issued:
        a query in flight ships without its completion, and those never due are not
        rows of the run)."""
        with self._lock:
            self._fill()
            rec, a, base = self.rec, self._shipped, self._base
            hi = base + (self._final_rows() if final else min(self._issued - base, rec.n))
            waiting = rec.completed[a - base : hi - base] == 0
            if not self.closed:  # a row the pacer passed without issuing it (the
                # outstanding bound held it back) will never be answered: it ships as it
                # is, else an overloaded run would hold every later row to its end, and
                # ship them all at once
                waiting &= rec.paced[a - base : hi - base] != 0
            pending = np.flatnonzero(waiting)
            b = hi if final or not pending.size else a + int(pending[0])
            cols = {name: getattr(rec, name)[a - base : b - base].copy() for name in ARRAYS}
            cols["top1"] = self.top1[a - base : b - base].copy()
            # A shipped row's error leaves the record: no row gets one once it is
            # answered, and every take would otherwise look through all of the run's
            # (an overloaded run refuses millions of queries, each with its error).
            # Deleted one by one: an open loop's threads add errors without the lock.
            errors = {i: e for i, e in list(rec.errors.items()) if a <= i < b}
            for i in errors:
                del rec.errors[i]
            self._shipped = b
        return a, cols, errors

    def _final_rows(self) -> int:
        """How many of the record's rows the run has (under the lock): those issued or
        answered (a closed loop's record may have room past them) and, of an open
        loop, those due, every one once the schedule is over (one due and not issued:
        refused by the outstanding bound, or the run stopped before it)."""
        rec = self.rec
        # A snapshot first: an open loop's threads complete queries without the lock,
        # and numpy's nonzero raises when the count changes while it reads.
        answered = np.flatnonzero(rec.completed != 0)
        rows = max(self._issued - self._base, int(answered[-1]) + 1 if answered.size else 0)
        if not self.closed:
            rows = max(rows, int(np.searchsorted(rec.scheduled, now() - rec.t0_ns, "right")))
        return min(rows, rec.n)

    @property
    def issued(self) -> int:
        return self._issued
