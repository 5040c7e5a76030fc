"""Cross-framework divergence measures, checked against hand computations and scipy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mlscope.divergence import (
    divergence,
    log_probabilities,
    max_abs_diff,
    mean_kl,
    top1_agreement,
)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    out: np.ndarray = e / e.sum(axis=-1, keepdims=True)
    return out


def test_identical_outputs_do_not_diverge() -> None:
    z = np.random.default_rng(0).normal(size=(8, 5)).astype(np.float32)
    d = divergence(z, z.copy(), kind="logits")
    assert (d.samples, d.max_abs_diff, d.top1_agreement, d.mean_kl) == (8, 0.0, 1.0, 0.0)


def test_max_abs_diff_and_top1_agreement() -> None:
    ref = np.array([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    other = np.array([[0.0, 1.5, 2.0], [0.0, 3.25, 0.0]])
    assert max_abs_diff(ref, other) == 3.25
    assert top1_agreement(ref, other) == 0.5


def test_kl_of_two_point_distributions_by_hand() -> None:
    p = np.array([[0.5, 0.5]])
    q = np.array([[0.9, 0.1]])
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert mean_kl(p, q, kind="probabilities") == pytest.approx(expected, rel=1e-12)
    # The same distributions given as logits (log p + any constant per row).
    assert mean_kl(np.log(p) + 3.0, np.log(q) - 1.0, kind="logits") == pytest.approx(expected)


def test_kl_matches_scipy_and_is_not_symmetric() -> None:
    special = pytest.importorskip("scipy.special")
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(16, 10)), rng.normal(size=(16, 10))
    expected = float(np.mean(special.rel_entr(_softmax(a), _softmax(b)).sum(axis=1)))
    assert mean_kl(a, b, kind="logits") == pytest.approx(expected, rel=1e-9)
    assert mean_kl(_softmax(a), _softmax(b), kind="probabilities") == pytest.approx(expected)
    assert mean_kl(b, a, kind="logits") != pytest.approx(expected)


def test_logits_are_stable_for_large_values() -> None:
    z = np.array([[1000.0, 0.0, -1000.0]])
    lp = log_probabilities(z, kind="logits")
    assert np.isfinite(lp).all() and lp[0, 0] == pytest.approx(0.0)
    assert math.isfinite(mean_kl(z, z[:, ::-1], kind="logits"))


def test_zero_probabilities_are_clipped_not_infinite() -> None:
    p = np.array([[0.5, 0.5, 0.0]])
    q = np.array([[1.0, 0.0, 0.0]])
    kl = mean_kl(p, q, kind="probabilities", eps=1e-12)
    assert math.isfinite(kl) and kl > 10  # 0.5 * log(0.5 / 1e-12) ~ 13.1


def test_kind_is_explicit_and_inputs_are_checked() -> None:
    with pytest.raises(ValueError, match="kind"):
        mean_kl([[1.0, 2.0]], [[1.0, 2.0]], kind="softmax")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        mean_kl([[-1.0, 2.0]], [[1.0, 2.0]], kind="probabilities")
    with pytest.raises(ValueError, match="shape"):
        max_abs_diff(np.zeros((2, 3)), np.zeros((3, 2)))
    with pytest.raises(ValueError, match="non-empty"):
        top1_agreement(np.zeros((0,)), np.zeros((0,)))


def test_leading_axes_are_samples() -> None:
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 3, 4))
    d = divergence(a, b, kind="logits")
    flat = divergence(a.reshape(6, 4), b.reshape(6, 4), kind="logits")
    assert d == flat and d.samples == 6
