"""``digits_cnn``: a small CNN trained on scikit-learn's 8x8 digits, fixed seed.

The split is stratified with seed 0: 1437 training and 360 held-out samples. The
held-out set is stored raw (pixel values 0..16 as uint8) in ``holdout.npz``; the
manifest's pre-processing rescales by 1/16. Training is single-threaded and seeded
so that the exported bytes are identical on every run on the same stack.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["NAME", "VERSION", "build", "build_onnx", "load_split", "train", "write_holdout"]

NAME = "digits_cnn"
VERSION = "1.0.0"
SEED = 0
PROBES = (0, 1, 2)
"""Held-out rows whose outputs the manifests pin (with a tolerance)."""
EPOCHS = 40


def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test); x as uint8 in 0..16, shape (N, 8, 8)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.images.astype(np.uint8)
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=360, random_state=SEED, stratify=y)
    return x_tr, y_tr, x_te, y_te


def train() -> Any:
    """Train the CNN with fixed seeds; returns the torch module in eval mode."""
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    x_tr, y_tr, _, _ = load_split()
    xt = torch.from_numpy(x_tr.astype(np.float32) / 16.0).unsqueeze(1)
    yt = torch.from_numpy(y_tr)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(SEED)
    for _ in range(EPOCHS):
        perm = torch.randperm(len(xt), generator=gen)
        for start in range(0, len(xt), 64):
            idx = perm[start : start + 64]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xt[idx]), yt[idx])
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
    return model.eval()


def build_onnx(model: Any, out: Path) -> Path:
    """Export to a single-file ONNX graph with a dynamic batch dimension."""
    import torch

    path = out / f"{NAME}.onnx"
    torch.onnx.export(
        model,
        (torch.zeros(1, 1, 8, 8),),
        str(path),
        dynamo=False,
        input_names=["input"],
        output_names=["logits"],
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=17,
    )
    return path


def write_holdout(out: Path) -> Path:
    _, _, x_te, y_te = load_split()
    path = out / "holdout.npz"
    with path.open("wb") as fh:
        np.savez(fh, x=x_te, y=y_te)
    (out / "labels.txt").write_text("".join(f"{d}\n" for d in range(10)))
    return path


def build(out: Path) -> dict[str, Any]:
    """Every format of the same weights plus the held-out set; top-1 per format."""
    import torch

    from mlscope.zoo.classifier import export_formats, measure
    from mlscope.zoo.convert import keras_from_sequential

    model = train()
    paths = export_formats(
        model,
        keras_from_sequential(model, (1, 8, 8)),
        torch.zeros(1, 1, 8, 8),
        out,
        NAME,
        input_shape=(1, 8, 8),
    )
    write_holdout(out)
    _, _, x_te, y_te = load_split()
    return measure(NAME, paths, (x_te.astype(np.float32) / 16.0)[:, None], y_te, probes=PROBES)
