"""Pre/post-processing operators, and the rule for custom Python steps."""

from __future__ import annotations

import io
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mlscope.errors import ManifestError
from mlscope.operators import OPERATORS, compile_steps


def png_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


RGB = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)


def test_decode_bytes_path_and_passthrough(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(png_bytes(RGB))
    out = OPERATORS["decode"]([png_bytes(RGB), tmp_path / "a.png", str(tmp_path / "a.png"), RGB])
    assert isinstance(out, np.ndarray) and out.shape == (4, 4, 6, 3) and out.dtype == np.uint8
    assert (out == RGB).all()
    gray = OPERATORS["decode"]([png_bytes(RGB)], mode="L")
    assert gray.shape == (1, 4, 6)
    ragged = OPERATORS["decode"]([png_bytes(RGB), png_bytes(RGB[:2])])
    assert isinstance(ragged, list) and ragged[1].shape == (2, 6, 3)
    with pytest.raises(ValueError, match="decode takes"):
        OPERATORS["decode"]([3.5])


def test_resize_keep_aspect_and_methods() -> None:
    img = np.zeros((100, 200, 3), np.uint8)
    assert OPERATORS["resize"]([img], size=50, keep_aspect=True).shape == (1, 50, 100, 3)
    assert OPERATORS["resize"]([img], size=[40, 40], keep_aspect=True).shape == (1, 20, 40, 3)
    assert OPERATORS["resize"]([img], size=32).shape == (1, 32, 32, 3)
    for method in ("nearest", "bilinear", "bicubic", "lanczos", "area"):
        assert OPERATORS["resize"]([img], size=[10, 20], method=method).shape == (1, 10, 20, 3)
    f32 = np.random.default_rng(0).random((1, 8, 8, 2), dtype=np.float32)
    out = OPERATORS["resize"](f32, size=4)
    assert out.shape == (1, 4, 4, 2) and out.dtype == np.float32
    gray = OPERATORS["resize"](np.zeros((2, 25, 25), np.uint8), size=128)
    assert gray.shape == (2, 128, 128)
    # ragged inputs become one batch once they share a size
    ragged = [np.zeros((30, 40, 3), np.uint8), np.zeros((50, 20, 3), np.uint8)]
    assert OPERATORS["resize"](ragged, size=16).shape == (2, 16, 16, 3)
    with pytest.raises(ValueError):
        OPERATORS["resize"]([img], size=5, method="magic")


def test_center_crop() -> None:
    img = np.arange(6 * 8, dtype=np.uint8).reshape(1, 6, 8)
    out = OPERATORS["center_crop"](img, size=[2, 4])
    assert (out[0] == img[0, 2:4, 2:6]).all()
    assert OPERATORS["center_crop"](np.zeros((2, 9, 9, 3)), size=3).shape == (2, 3, 3, 3)
    with pytest.raises(ValueError, match="cannot crop"):
        OPERATORS["center_crop"](img, size=10)


def test_color_modes() -> None:
    batch = RGB[None]
    bgr = OPERATORS["color_mode"](batch, source="RGB", target="BGR")
    assert (bgr[..., 0] == batch[..., 2]).all()
    assert (OPERATORS["color_mode"](bgr, source="BGR", target="RGB") == batch).all()
    gray = OPERATORS["color_mode"](batch, target="GRAY")
    expect = np.asarray(Image.fromarray(RGB).convert("L"))
    assert gray.shape == (1, 4, 6, 1) and np.abs(gray[0, ..., 0].astype(int) - expect).max() <= 1
    back = OPERATORS["color_mode"](np.zeros((1, 5, 5), np.uint8), source="GRAY", target="RGB")
    assert back.shape == (1, 5, 5, 3)
    with pytest.raises(ValueError):
        OPERATORS["color_mode"](batch, target="HSV")


def test_imagenet_pipeline_in_manifest_order() -> None:
    steps: list[dict[str, Any]] = [
        {"decode": {}},
        {"resize": {"size": 256, "keep_aspect": True}},
        {"center_crop": {"size": 224}},
        {"normalize": {"mean": 127, "std": 128}},
        {"layout": {"source": "HWC", "target": "CHW"}},
    ]
    img = np.full((300, 400, 3), 255, np.uint8)
    out = compile_steps(steps)([png_bytes(img), png_bytes(img[:, :300])])
    assert out.shape == (2, 3, 224, 224) and out.dtype == np.float32
    assert np.allclose(out, 1.0)


def test_postprocessing() -> None:
    x = np.array([[0.1, 3.0, 2.0, -1.0]], np.float32)
    out = compile_steps([{"softmax": {}}, {"topk": {"k": 2}}])(x)
    assert out.tolist() == [[1, 2]]
    assert compile_steps([{"sigmoid": {}}, {"reduce": {"op": "max"}}])(x).shape == (1, 1)
    assert compile_steps([{"identity": None}])(x) is x


@pytest.mark.parametrize("classes", [3, 10, 63, 64, 1000])
def test_index_steps_rank_the_scores_a_softmax_or_sigmoid_would_rank(classes: int) -> None:
    """Before an index step a softmax (one row per sample) or a sigmoid is skipped: the
    classes must come out as ranking the probabilities would, best first, for short
    rows (fully sorted) and long ones (partitioned)."""
    rng = np.random.default_rng(classes)
    x = rng.normal(0, 3, (16, classes)).astype(np.float32)
    k = min(5, classes)
    for first in ("softmax", "sigmoid"):
        out = compile_steps([{first: {}}, {"topk": {"k": k}}])(x)
        probs = OPERATORS[first](x)
        assert out.dtype == np.int32 and out.shape == (16, k)
        ranked = np.take_along_axis(probs, out.astype(np.int64), axis=1)
        assert np.all(np.diff(ranked, axis=1) <= 0)  # best first
        assert np.allclose(ranked[:, 0], probs.max(axis=1))
        assert (out[:, 0] == x.argmax(axis=1)).all()
    # scores that round to equal probabilities still rank by logit
    tied = np.array([[200.0, 0.0, -1.0, 1.0]], np.float32)
    assert compile_steps([{"softmax": {}}, {"topk": {"k": 4}}])(tied).tolist() == [[0, 3, 1, 2]]


def test_a_softmax_that_does_not_keep_ranking_is_not_skipped() -> None:
    """Over the batch axis, or over rows of a 3-d output, a softmax changes which
    values rank first in a flattened sample: it runs."""
    x = np.array([[[0.0, 5.0], [10.0, 9.9]]], np.float32)  # one sample, two rows
    rows = compile_steps([{"softmax": {}}, {"topk": {"k": 1}}])(x)
    assert rows.tolist() == [[1]]  # per row: 0.993 (row 0) beats 0.525 (row 1)
    assert x.reshape(1, -1).argmax() == 2  # the logits alone would say 2
    y = np.array([[5.0, 4.0], [9.0, 0.0]], np.float32)
    over_batch = compile_steps([{"softmax": {"axis": 0}}, {"topk": {"k": 1}}])(y)
    assert over_batch[:, 0].tolist() == [1, 0]  # the logits alone would say [0, 0]


def test_unknown_operator_and_bad_step() -> None:
    with pytest.raises(ManifestError, match="unknown operator 'sharpen'"):
        compile_steps([{"sharpen": {}}], where="inputs.0.steps")
    with pytest.raises(ManifestError, match="one operator"):
        compile_steps([{"cast": {}, "normalize": {}}])


@pytest.fixture
def custom_module() -> Iterator[str]:
    mod = types.ModuleType("mlscope_test_custom_step")

    def double(env: dict[str, Any], data: np.ndarray) -> np.ndarray:
        assert env["model"] == "m"
        return data * 2

    mod.double = double  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    yield mod.__name__
    del sys.modules[mod.__name__]


def test_custom_python_needs_trust_and_permission(custom_module: str) -> None:
    steps = [{"python": {"module": custom_module, "function": "double"}}]
    for trusted, allow in ((False, False), (False, True), (True, False)):
        with pytest.raises(ManifestError, match="refusing custom Python step") as info:
            compile_steps(steps, trusted=trusted, allow_custom=allow, where="inputs.0.steps")
        assert "over the bus" in str(info.value) and info.value.field == "inputs.0.steps.0"
    run = compile_steps(steps, trusted=True, allow_custom=True, env={"model": "m"})
    assert run(np.ones(2)).tolist() == [2.0, 2.0]


def test_custom_python_errors(custom_module: str) -> None:
    with pytest.raises(ManifestError, match="cannot load"):
        compile_steps(
            [{"python": {"module": custom_module, "function": "nope"}}],
            trusted=True,
            allow_custom=True,
        )
    with pytest.raises(ManifestError, match="module: M"):
        compile_steps([{"python": {"module": custom_module}}], trusted=True, allow_custom=True)
