"""Pre- and post-processing operators (paper section 4.1.1), run in manifest order.

A step in a manifest is ``{operator: {options}}``. Each operator is a function
``(batch, **options) -> batch`` over a numpy batch whose first axis is the batch.
:func:`compile_steps` turns a step list into one callable once, at model load, so
the per-query path does no lookups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mlscope.errors import ManifestError

__all__ = ["OPERATORS", "Pipeline", "compile_steps"]

Op = Callable[..., np.ndarray]
Pipeline = Callable[[np.ndarray], np.ndarray]


def _cast(x: np.ndarray, *, dtype: str) -> np.ndarray:
    return x.astype(dtype, copy=False)


def _normalize(x: np.ndarray, *, mean: Any = 0.0, std: Any = 1.0,
               rescale: float = 1.0) -> np.ndarray:
    """(x * rescale - mean) / std, broadcasting mean/std over the last axis or channels."""
    out = x.astype(np.float32, copy=False) * np.float32(rescale)
    return (out - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


def _reshape(x: np.ndarray, *, shape: Sequence[int]) -> np.ndarray:
    return x.reshape((x.shape[0], *shape))


def _layout(x: np.ndarray, *, source: str, target: str) -> np.ndarray:
    """Transpose the per-sample axes, e.g. HWC -> CHW."""
    if sorted(source) != sorted(target):
        raise ValueError(f"cannot convert layout {source} to {target}")
    perm = [0] + [source.index(c) + 1 for c in target]
    return np.ascontiguousarray(x.transpose(perm))


def _softmax(x: np.ndarray, *, axis: int = -1) -> np.ndarray:
    z = x - x.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)  # type: ignore[no-any-return]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))  # type: ignore[no-any-return]


def _topk(x: np.ndarray, *, k: int = 5) -> np.ndarray:
    """Indices of the k largest values per sample, best first (int32)."""
    flat = x.reshape(x.shape[0], -1)
    k = min(k, flat.shape[1])
    part = np.argpartition(-flat, k - 1, axis=1)[:, :k]
    order = np.take_along_axis(flat, part, axis=1).argsort(axis=1)[:, ::-1]
    return np.take_along_axis(part, order, axis=1).astype(np.int32)


def _argmax(x: np.ndarray) -> np.ndarray:
    return x.reshape(x.shape[0], -1).argmax(axis=1).astype(np.int32)[:, None]


def _identity(x: np.ndarray) -> np.ndarray:
    return x


OPERATORS: dict[str, Op] = {
    "cast": _cast,
    "normalize": _normalize,
    "reshape": _reshape,
    "layout": _layout,
    "softmax": _softmax,
    "sigmoid": _sigmoid,
    "topk": _topk,
    "argmax": _argmax,
    "identity": _identity,
}


def compile_steps(steps: Sequence[dict[str, Any]], *, where: str = "steps") -> Pipeline:
    """One callable running every step in order; unknown operators are ManifestErrors."""
    calls: list[Callable[[np.ndarray], np.ndarray]] = []
    for i, step in enumerate(steps):
        if not isinstance(step, dict) or len(step) != 1:
            raise ManifestError("each step is a mapping with one operator",
                                field=f"{where}.{i}")
        (name, options), = step.items()
        op = OPERATORS.get(name)
        if op is None:
            raise ManifestError(f"unknown operator {name!r} (known: {', '.join(OPERATORS)})",
                                field=f"{where}.{i}")
        opts = dict(options or {})
        calls.append(lambda x, op=op, opts=opts: op(x, **opts))

    def run(x: np.ndarray) -> np.ndarray:
        for call in calls:
            x = call(x)
        return x

    return run
