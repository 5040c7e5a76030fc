"""A loaded model: the predictor with its compiled pre- and post-processing.

Queries run through :class:`agent.pipeline.Executor` (the streaming pipeline).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from agent.predictors import open_predictor
from mlscope.catalog import Entry
from mlscope.errors import InputMismatchError, MLScopeError
from mlscope.operators import Pipeline, compile_steps, labeler
from mlscope.predictor import Predictor, PredictorOptions

__all__ = ["LoadedModel", "compile_model"]

now = time.perf_counter_ns
T = TypeVar("T")


def compile_model(entry: Entry, *, allow_custom: bool = False) -> tuple[list[Pipeline], Pipeline]:
    """The pre-processing of each input and the post-processing of the first output.

    A custom Python step compiles only when the manifest came from a trusted local
    directory (the entry and the manifest both say so: never one from the bus) and
    ``allow_custom`` (the agent's ``Settings.allow_custom_code``); otherwise a
    ManifestError states the rule.
    """
    m = entry.manifest
    opts: dict[str, Any] = {
        "trusted": entry.trusted and m.trusted,
        "allow_custom": allow_custom,
        "env": {
            "model": m.name,
            "version": m.version,
            "framework": m.framework.name,
            "attributes": dict(m.attributes),
        },
    }
    pre = [
        compile_steps(i.steps, where=f"inputs.{n}.steps", **opts) for n, i in enumerate(m.inputs)
    ]
    return pre, compile_steps(m.outputs[0].steps, where="outputs.0.steps", **opts)


def _on_own_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a new thread that ends when it returns.

    A model is opened there, not on the caller's thread, because a runtime's OpenMP
    workers belong to the thread that first ran a parallel region (PyTorch's loading
    runs some), and libgomp keeps that team while its thread lives. Two live teams
    outnumber two cores, and libgomp then cuts every team's spin-wait to almost
    nothing: efficientnet_lite0 on PyTorch took 55-66 ms a call on the predict thread
    against 25 ms when the thread that opened it had ended (2-core VM). The predict
    thread's own team is then the only one (:class:`agent.pipeline.Executor` runs the
    first inference there too)."""
    out: list[T] = []
    failed: list[BaseException] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # raised again on the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=target, name="open-model", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return out[0]


class LoadedModel:
    """A predictor with its compiled pre- and post-processing."""

    def __init__(
        self,
        entry: Entry,
        predictor: Predictor,
        load_ns: int,
        *,
        allow_custom: bool = False,
        labels: Sequence[str] | None = None,
    ) -> None:
        m = entry.manifest
        self.entry, self.predictor, self.load_ns = entry, predictor, load_ns
        self.name = m.name
        self.pre, self.post = compile_model(entry, allow_custom=allow_custom)
        self.labeler = labeler(m.outputs[0].steps, labels)
        """Names the top-k / argmax result (from the output's labels file), or None."""
        self.sample_shape = m.inputs[0].shape
        self.dtype = np.dtype(m.inputs[0].element_type)
        self.batch_axes = tuple(i.batch_axis for i in m.inputs)
        """Per input, the axis that is the batch (None: shared by the whole batch)."""

    @classmethod
    def open(
        cls,
        entry: Entry,
        graph: Path,
        options: PredictorOptions,
        *,
        allow_custom: bool = False,
        labels: Sequence[str] | None = None,
    ) -> LoadedModel:
        """Open the predictor; ``labels`` (the first output's labels file, e.g. from
        :meth:`Entry.labels`) names top-k results for queries that ask."""
        compile_model(entry, allow_custom=allow_custom)  # refused steps fail before loading
        t0 = now()
        pred = _on_own_thread(
            lambda: open_predictor(entry.manifest.framework.name, graph, entry.manifest, options)
        )
        try:
            return cls(entry, pred, now() - t0, allow_custom=allow_custom, labels=labels)
        except MLScopeError:
            pred.close()
            raise

    def warmup(self) -> int:
        """One inference on one sample; returns its duration (the cold first inference).

        Every input is built in the model's input form (shape, batch axis and element
        type of the manifest), zeros or the input's ``fill`` value, so no pre-processing
        runs: image models take encoded images raw.
        """
        xs = [
            self._tensor(n, 1, spec.fill or 0) for n, spec in enumerate(self.entry.manifest.inputs)
        ]
        t0 = now()
        self.predictor.predict(xs)
        return now() - t0

    def fill(self, n: int, batch: int) -> np.ndarray:
        """Input ``n`` for a query of ``batch`` samples that did not carry it: the
        manifest's ``fill`` value (InputMismatchError when the input has none)."""
        spec = self.entry.manifest.inputs[n]
        if spec.fill is None:
            name = spec.layer_name or f"input {n}"
            raise InputMismatchError(
                f"{self.name}: the query lacks {name}, which has no fill value",
                model=self.name,
                framework=self.predictor.framework,
                input=name,
                expected=len(self.pre),
                actual=n,
            )
        return self._tensor(n, batch, spec.fill)

    def _tensor(self, n: int, batch: int, value: float) -> np.ndarray:
        spec = self.entry.manifest.inputs[n]
        shape = list(spec.shape)
        if spec.batch_axis is not None:
            shape.insert(spec.batch_axis, batch)
        return np.full(shape, value, np.dtype(spec.element_type))

    def close(self) -> None:
        self.predictor.close()
