"""The samples an agent holds: for MLPerf LoadGen (its QuerySampleLibrary) and for its
own runs (placement agent, ``preprocess: ahead``).

::

    LoadGen load_samples ──► ctl load_samples {indices} ──► SampleLibrary.load:
                                                             rows of the agent's own data
                                                             set, pre-processed once
    LoadGen issue_query ──► samples query {indices} ──────► SampleLibrary.take ──► Executor
                                                             (Job.preprocessed: no pre step)
    LoadGen unload_samples / release / cancel ───────────► dropped, memory given back

The agent reads the model's data set itself (:func:`mlscope.samples.dataset`), so a
query carries sample indices only. Samples are pre-processed at load when the first
input's pre-processing keeps one row per sample on axis 0 (its batch axis); otherwise
they are held raw and pre-processed per query as usual. Every library of an agent draws
on one :class:`MemoryBudget`: a load that would pass it is refused with a typed error
and leaves the library as it was. Requests are validated here (indices in range,
loaded before use), so a hostile one gets a typed error and the agent goes on.

A local run holds its whole data set (:func:`preprocess_all`: one array, pre-processed
before the clock starts, reserved on the same budget until the run's rows are shipped),
so its queries skip pre-processing as LoadGen's do.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from agent.job import Model
from mlscope.errors import ConfigError, EvaluationError

__all__ = ["CHUNK", "MemoryBudget", "SampleLibrary", "per_sample", "preprocess_all"]

CHUNK = 256
"""Samples pre-processed in one call at load (the memory check runs per chunk)."""


@dataclass
class MemoryBudget:
    """Bytes every sample library of one agent may hold together."""

    limit: int
    used: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def reserve(self, n: int, *, evaluation_id: str) -> None:
        with self._lock:
            if self.used + n > self.limit:
                raise ConfigError(
                    f"the sample library would hold {self.used + n:,} bytes, over this "
                    f"agent's limit of {self.limit:,} (mlscope agent --sample-memory); have "
                    "LoadGen load fewer (user.conf: *.*.performance_sample_count_override)",
                    field="indices",
                    evaluation_id=evaluation_id,
                    limit_bytes=self.limit,
                    used_bytes=self.used,
                    requested_bytes=n,
                )
            self.used += n

    def release(self, n: int) -> None:
        with self._lock:
            self.used = max(0, self.used - n)


class SampleLibrary:
    """One evaluation's held samples: data-set index -> the sample (pre-processed when
    :attr:`preprocessed`)."""

    def __init__(
        self, evaluation_id: str, x: np.ndarray, model: Model, budget: MemoryBudget
    ) -> None:
        self.evaluation_id, self.x, self.model, self.budget = evaluation_id, x, model, budget
        self.held: dict[int, np.ndarray] = {}
        self.bytes = 0
        self._lock = threading.Lock()
        self.preprocessed = per_sample(model, x)
        """Samples are held pre-processed (queries then skip that step)."""

    # ------------------------------------------------------------------ callbacks

    def load(self, indices: Sequence[int]) -> None:
        """Hold these samples (already held ones are kept); all or nothing."""
        wanted = self._checked(indices)
        with self._lock:
            new = [int(i) for i in np.unique(wanted) if int(i) not in self.held]
        added: dict[int, np.ndarray] = {}
        taken = 0
        try:
            for a in range(0, len(new), CHUNK):
                rows = new[a : a + CHUNK]
                got = self._prepare(np.asarray(rows, np.int64))
                size = sum(g.nbytes for g in got)
                self.budget.reserve(size, evaluation_id=self.evaluation_id)
                taken += size
                added.update(zip(rows, got, strict=True))
        except BaseException:
            self.budget.release(taken)
            raise
        with self._lock:
            self.held.update(added)
            self.bytes += taken

    def unload(self, indices: Sequence[int]) -> None:
        """Drop these samples (ones not held are ignored)."""
        wanted = self._checked(indices)
        with self._lock:
            dropped = [self.held.pop(int(i), None) for i in wanted]
            freed = sum(d.nbytes for d in dropped if d is not None)
            self.bytes -= freed
        self.budget.release(freed)

    def clear(self) -> None:
        """Drop everything (release, cancel, shutdown)."""
        with self._lock:
            self.held.clear()
            freed, self.bytes = self.bytes, 0
        self.budget.release(freed)

    def take(self, indices: np.ndarray) -> np.ndarray:
        """A query's batch: the held samples, in order (EvaluationError when one is
        not held: LoadGen uses only what it loaded)."""
        if not isinstance(indices, np.ndarray) or indices.ndim != 1 or not indices.size:
            raise ConfigError("a samples query names a non-empty list of indices", field="samples")
        if not np.issubdtype(indices.dtype, np.integer):
            raise ConfigError(
                f"sample indices must be integers, got {indices.dtype}", field="samples"
            )
        held = self.held
        per = next(iter(held.values()), None)
        if per is not None and indices.size * per.nbytes > self.budget.limit:
            raise ConfigError(
                f"a samples query of {indices.size:,} samples would take "
                f"{indices.size * per.nbytes:,} bytes, over the agent's sample memory of "
                f"{self.budget.limit:,}",
                field="samples",
            )
        try:
            return np.stack([held[int(i)] for i in indices.tolist()])
        except KeyError as exc:
            raise EvaluationError(
                f"sample {exc.args[0]} is not loaded for evaluation {self.evaluation_id}",
                evaluation_id=self.evaluation_id,
                sample=exc.args[0],
            ) from exc

    # ------------------------------------------------------------------ inside

    def _checked(self, indices: Sequence[int]) -> np.ndarray:
        got = np.asarray(indices, dtype=np.int64)
        n = len(self.x)
        bad = got[(got < 0) | (got >= n)]
        if bad.size:
            raise ConfigError(
                f"sample index {int(bad[0])} is outside the data set (0..{n - 1}); "
                f"{bad.size} of {got.size} indices are",
                field="indices",
                evaluation_id=self.evaluation_id,
                size=n,
            )
        return got

    def _prepare(self, rows: np.ndarray) -> list[np.ndarray]:
        """These rows as held: pre-processed when the pipeline allows, else raw copies."""
        raw = self.x[rows]
        if not self.preprocessed:
            return [np.array(r) for r in raw]
        return list(_preprocessed(self.model, raw, self.evaluation_id))


def per_sample(model: Model, x: np.ndarray) -> bool:
    """Whether samples of ``x`` can be held pre-processed: the first input's batch axis
    is 0 and its pre-processing of one row gives one row."""
    if model.batch_axes[0] != 0 or not len(x):
        return False
    try:
        out = model.pre[0](x[:1])
    except Exception:  # the pipeline cannot run here alone: per query, then
        return False
    return isinstance(out, np.ndarray) and out.ndim >= 1 and out.shape[0] == 1


def _preprocessed(model: Model, raw: np.ndarray, evaluation_id: str) -> np.ndarray:
    """``raw`` rows through the first input's pre-processing, one row out per row in."""
    try:
        out = model.pre[0](raw)
    except Exception as exc:
        raise EvaluationError(
            f"{model.name}: pre-processing the held samples failed: {exc}",
            evaluation_id=evaluation_id,
        ) from exc
    if not isinstance(out, np.ndarray) or out.shape[:1] != (len(raw),):
        raise EvaluationError(
            f"{model.name}: pre-processing {len(raw)} samples gave {getattr(out, 'shape', None)}",
            evaluation_id=evaluation_id,
        )
    return out


def preprocess_all(
    evaluation_id: str, x: np.ndarray, model: Model, budget: MemoryBudget
) -> np.ndarray | None:
    """Every row of ``x`` pre-processed, in one array, for a run that holds its samples
    (placement agent, ``preprocess: ahead``); its bytes are reserved on ``budget`` (the
    caller gives them back when the run ends). None when the pipeline does not
    pre-process sample by sample; ConfigError when the rows would pass the budget."""
    if not per_sample(model, x):
        return None
    first = _preprocessed(model, x[:CHUNK], evaluation_id)
    out = np.empty((len(x), *first.shape[1:]), first.dtype)
    budget.reserve(out.nbytes, evaluation_id=evaluation_id)
    try:
        out[: len(first)] = first
        for a in range(len(first), len(x), CHUNK):
            out[a : a + CHUNK] = _preprocessed(model, x[a : a + CHUNK], evaluation_id)
    except BaseException:
        budget.release(out.nbytes)
        raise
    return out
