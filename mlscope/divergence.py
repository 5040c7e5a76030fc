"""Cross-framework output divergence: how far one model's outputs drift between runtimes.

All functions take two arrays of the same shape, ``(batch, classes)`` or any shape
whose last axis is the class axis, computed from the *same* inputs: ``reference``
(e.g. the framework the model was trained in) and ``other``. Pure numpy; float64
inside so that the measure does not add its own rounding.

- :func:`max_abs_diff`   ``max |r - o|`` over every element.
- :func:`top1_agreement` fraction of samples with ``argmax r == argmax o``.
- :func:`mean_kl`        mean over samples of ``KL(P || Q) = sum_i p_i (log p_i - log q_i)``,
  where ``P`` comes from the reference and ``Q`` from the other output, in nats.

Outputs are logits or probabilities, and the caller says which (``kind``) -- guessing
from the values is wrong for a softmax output that happens to contain small logits:

- ``kind="logits"``: ``log p = log_softmax(z) = z - logsumexp(z)`` (stable: the max
  is subtracted before ``exp``), so no probability is ever rounded to 0 and KL is
  finite.
- ``kind="probabilities"``: each row is clipped to ``[eps, 1]`` and renormalized to
  sum 1 before the log (``eps = 1e-12`` by default): a probability a runtime rounded to
  exactly 0 then costs at most ``p log(p / eps)`` instead of infinity. Rows must be
  non-negative.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "Divergence",
    "OutputKind",
    "divergence",
    "log_probabilities",
    "max_abs_diff",
    "mean_kl",
    "top1_agreement",
]

OutputKind = Literal["logits", "probabilities"]
ArrayLike = npt.ArrayLike
_EPS = 1e-12


@dataclass(frozen=True)
class Divergence:
    """Divergence of ``other`` from ``reference`` over ``samples`` samples."""

    samples: int
    max_abs_diff: float
    top1_agreement: float
    mean_kl: float
    """Mean KL(reference || other) in nats."""


def _pair(
    reference: ArrayLike, other: ArrayLike
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    r = np.asarray(reference, dtype=np.float64)
    o = np.asarray(other, dtype=np.float64)
    if r.shape != o.shape:
        raise ValueError(f"outputs differ in shape: {r.shape} vs {o.shape}")
    if r.ndim == 0 or r.size == 0:
        raise ValueError("outputs must be non-empty arrays with a class axis")
    return r, o


def _rows(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """(samples, classes): every axis but the last is a sample axis."""
    return x.reshape(-1, x.shape[-1]) if x.ndim > 1 else x.reshape(1, -1)


def max_abs_diff(reference: ArrayLike, other: ArrayLike) -> float:
    """Largest absolute element-wise difference."""
    r, o = _pair(reference, other)
    return float(np.max(np.abs(r - o)))


def top1_agreement(reference: ArrayLike, other: ArrayLike) -> float:
    """Fraction of samples whose arg-max class is the same (ties: the first index)."""
    r, o = _pair(reference, other)
    return float(np.mean(np.argmax(_rows(r), axis=1) == np.argmax(_rows(o), axis=1)))


def log_probabilities(
    x: ArrayLike, *, kind: OutputKind, eps: float = _EPS
) -> npt.NDArray[np.float64]:
    """Row-wise log-probabilities of logits or probabilities (see the module doc)."""
    rows = _rows(np.asarray(x, dtype=np.float64))
    if kind == "logits":
        shifted = rows - rows.max(axis=1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))  # type: ignore[no-any-return]
    if kind == "probabilities":
        if np.any(rows < 0):
            raise ValueError("probabilities must be non-negative; pass kind='logits'")
        clipped = np.clip(rows, eps, 1.0)
        return np.log(clipped / clipped.sum(axis=1, keepdims=True))  # type: ignore[no-any-return]
    raise ValueError(f"kind must be 'logits' or 'probabilities', not {kind!r}")


def mean_kl(
    reference: ArrayLike, other: ArrayLike, *, kind: OutputKind, eps: float = _EPS
) -> float:
    """Mean over samples of KL(P_reference || Q_other) in nats (0 when identical)."""
    r, o = _pair(reference, other)
    log_p = log_probabilities(r, kind=kind, eps=eps)
    log_q = log_probabilities(o, kind=kind, eps=eps)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=1)
    # Rounding can give -1e-17 for identical rows; KL is never negative.
    return float(np.mean(np.maximum(kl, 0.0)))


def divergence(
    reference: ArrayLike, other: ArrayLike, *, kind: OutputKind, eps: float = _EPS
) -> Divergence:
    """All three measures at once."""
    r, o = _pair(reference, other)
    return Divergence(
        samples=_rows(r).shape[0],
        max_abs_diff=max_abs_diff(r, o),
        top1_agreement=top1_agreement(r, o),
        mean_kl=mean_kl(r, o, kind=kind, eps=eps),
    )
