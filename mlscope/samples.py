"""The sample set of a load run: which data-set samples query ``i`` carries.

One definition, used where the load is generated: by the server's load generator
(``placement: server``) and by the agent's local one (``placement: agent``), so both
send the same seeded sample order and score the same labels.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mlscope.catalog import Entry

__all__ = ["Feeders", "dataset", "feeders", "scored", "top1"]

Feeders = tuple[Callable[[int], np.ndarray], Callable[[int], np.ndarray] | None]
"""(inputs(i), labels(i) or None) for the queries of one batch size."""
FAKE_SAMPLES = 64
"""Samples of seeded noise a model without a data set is fed, cycled."""


def dataset(entry: Entry, zoo_dir: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """The model's labelled data set ``(x, y)``, or None when its manifest has none."""
    path = entry.dataset(zoo_dir)
    if path is None:
        return None
    with np.load(path) as npz:
        return npz["x"], npz["y"]


def feeders(
    data: tuple[np.ndarray, np.ndarray] | None, shape: tuple[int, ...], batch: int, seed: int
) -> Feeders:
    """Query i's raw inputs (and labels): a seeded permutation of the data set, cycled.

    The sample order has its own seed stream (stream 1 of
    ``SeedSequence(seed).spawn(2)``), independent of the arrival schedule's (stream 0).
    """
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[1])
    if data is None:
        fake = rng.standard_normal((FAKE_SAMPLES, *shape)).astype(np.float32)
        return (lambda i: fake[[(i * batch + j) % FAKE_SAMPLES for j in range(batch)]]), None
    x, y = data
    perm = rng.permutation(len(x))

    def idx(i: int) -> np.ndarray:
        return perm[(np.arange(batch) + i * batch) % len(perm)]

    return (lambda i: x[idx(i)]), (lambda i: y[idx(i)])


def scored(feed: Feeders, manifest: Any) -> Feeders:
    """Labels only for a model scored by top-k: a detector's or a latency-only model's
    top-1 would be a meaningless number (it shows none)."""
    ok = manifest.dataset is not None and manifest.dataset.metric in ("top1", "top5")
    return feed if ok else (feed[0], None)


def top1(outputs: Any) -> np.ndarray | None:
    """Each sample's predicted class: the first value of its post-processed output
    (argmax or the first of top-k), as the load generator scores it; None when the
    outputs have no per-sample values."""
    if isinstance(outputs, np.ndarray) and outputs.size and outputs.ndim >= 1:
        first: np.ndarray = outputs.reshape(outputs.shape[0], -1)[:, 0]
        return first
    return None
