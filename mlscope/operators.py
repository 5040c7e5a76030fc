"""Pre- and post-processing operators (paper section 4.1.1), run in manifest order.

A step in a manifest is ``{operator: {options}}``. Each operator is a function
``(batch, **options) -> batch`` over a batch whose first axis is the batch.
:func:`compile_steps` turns a step list into one callable once, at model load, so
the per-query path does no lookups.

Images travel as HWC ``uint8`` arrays (``N x H x W x C``, or ``N x H x W`` for gray).
Until ``resize``/``center_crop`` make them one size, a batch of images may be a list
of arrays of different sizes; every image operator accepts either.

Custom Python steps (``{python: {module: M, function: F}}``, called as
``F(env, data)``) run only for a trusted manifest on an agent that allows them; see
``docs/SECURITY.md``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import io
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlscope.errors import ManifestError
from mlscope.manifest import MAX_SAMPLE_DIMS, MAX_SAMPLE_ELEMENTS

__all__ = [
    "CUSTOM_STEP",
    "INDEX_STEPS",
    "MAX_IMAGE_PIXELS",
    "MAX_IMAGE_SIDE",
    "OPERATORS",
    "Pipeline",
    "compile_steps",
    "labeler",
]

Op = Callable[..., Any]
Pipeline = Callable[[Any], Any]
CUSTOM_STEP = "python"
"""Name of the custom-code step (gated, see :func:`compile_steps`)."""

Images = np.ndarray | list[np.ndarray]

MAX_IMAGE_SIDE = 16384
"""Longest side of an image a step makes (``resize``, ``center_crop``)."""
MAX_IMAGE_PIXELS = MAX_SAMPLE_ELEMENTS // 4
"""Most pixels of an image ``resize`` makes (4096 x 4096): with four channels, the
largest sample a manifest may declare. Steps come from manifests, which may come from
the bus, and a resize allocates its target size for every image of every query."""


def _cast(x: np.ndarray, *, dtype: str) -> np.ndarray:
    return np.asarray(x).astype(dtype, copy=False)


def _normalize(
    x: np.ndarray, *, mean: Any = 0.0, std: Any = 1.0, rescale: float = 1.0
) -> np.ndarray:
    """(x * rescale - mean) / std, broadcasting mean/std over the last axis or channels."""
    out = np.asarray(x).astype(np.float32, copy=False) * np.float32(rescale)
    return (out - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)


def _reshape(x: np.ndarray, *, shape: Sequence[int]) -> np.ndarray:
    return x.reshape((x.shape[0], *shape))


def _layout(x: np.ndarray, *, source: str, target: str) -> np.ndarray:
    """Transpose the per-sample axes, e.g. HWC -> CHW."""
    if sorted(source) != sorted(target):
        raise ValueError(f"cannot convert layout {source} to {target}")
    perm = [0] + [source.index(c) + 1 for c in target]
    return np.ascontiguousarray(np.asarray(x).transpose(perm))


def _softmax(x: np.ndarray, *, axis: int = -1) -> np.ndarray:
    z = x - x.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)  # type: ignore[no-any-return]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # 1 / (1 + e^-x) computed as e^-log(1 + e^-x): no overflow for large |x|
    out: np.ndarray = np.exp(-np.logaddexp(0.0, -x))
    return out


SORT_BELOW = 64
"""Rows shorter than this are fully sorted by :func:`_topk` (one call, cheaper than
partitioning for a few classes); longer rows are partitioned first."""


def _topk(x: np.ndarray, *, k: int = 5) -> np.ndarray:
    """Indices of the k largest values per sample, best first (int32; equal values in
    index order when rows are short); their labels come from :func:`labeler`, only when
    asked."""
    flat = x.reshape(x.shape[0], -1)
    k = min(k, flat.shape[1])
    if flat.shape[1] < SORT_BELOW:
        return np.argsort(-flat, axis=1, kind="stable")[:, :k].astype(np.int32)
    part = np.argpartition(-flat, k - 1, axis=1)[:, :k]
    order = np.take_along_axis(flat, part, axis=1).argsort(axis=1)[:, ::-1]
    return np.take_along_axis(part, order, axis=1).astype(np.int32)


def _argmax(x: np.ndarray) -> np.ndarray:
    best: np.ndarray = x.reshape(x.shape[0], -1).argmax(axis=1).astype(np.int32)
    return best[:, None]


_REDUCTIONS: dict[str, Callable[..., Any]] = {
    "max": np.max,
    "min": np.min,
    "mean": np.mean,
    "sum": np.sum,
}


def _reduce(x: np.ndarray, *, op: str = "max") -> np.ndarray:
    """Reduce every per-sample value to one (``max``, ``min``, ``mean``, ``sum``)."""
    if op not in _REDUCTIONS:
        raise ValueError(f"reduce op must be one of {sorted(_REDUCTIONS)}")
    reduced: np.ndarray = _REDUCTIONS[op](x.reshape(x.shape[0], -1), axis=1)
    return reduced[:, None]


def _identity(x: Any) -> Any:
    return x


# --- images ---------------------------------------------------------------------------


def _pil() -> Any:
    from PIL import Image  # a core dependency, imported by the first image step only

    return Image


def _stack(images: list[np.ndarray]) -> Images:
    """One array when every image has one shape, else the list."""
    if images and all(i.shape == images[0].shape for i in images):
        return np.stack(images)
    return images


def _decode_one(item: Any, mode: str) -> np.ndarray:
    if isinstance(item, np.ndarray) and item.dtype == np.uint8 and item.ndim in (2, 3):
        return item  # already decoded
    image = _pil()
    if isinstance(item, (bytes, bytearray, memoryview)):
        src: Any = io.BytesIO(bytes(item))
    elif isinstance(item, np.ndarray) and item.dtype == np.uint8 and item.ndim == 1:
        src = io.BytesIO(item.tobytes())
    elif isinstance(item, (str, Path)):
        src = str(item)
    else:
        raise ValueError(
            f"decode takes image bytes, a file path or a uint8 image, not {type(item).__name__}"
        )
    with image.open(src) as img:
        return np.asarray(img.convert(mode))


def _decode(x: Any, *, mode: str = "RGB") -> Images:
    """Encoded images (bytes or file paths) -> HWC uint8 (``mode``: RGB or L)."""
    return _stack([_decode_one(item, mode) for item in x])


_RESAMPLE = {
    "nearest": 0,
    "bilinear": 2,
    "bicubic": 3,
    "lanczos": 1,
    "box": 4,
    "area": 4,
    "hamming": 5,
}


def _target_size(h: int, w: int, size: int | Sequence[int], keep_aspect: bool) -> tuple[int, int]:
    if isinstance(size, int):
        if keep_aspect:  # shorter side becomes `size`
            scale = size / min(h, w)
            return max(1, round(h * scale)), max(1, round(w * scale))
        return size, size
    th, tw = int(size[0]), int(size[1])
    if keep_aspect:  # fit inside (th, tw)
        scale = min(th / h, tw / w)
        return max(1, round(h * scale)), max(1, round(w * scale))
    return th, tw


def _resize_one(
    img: np.ndarray, size: int | Sequence[int], method: str, keep_aspect: bool
) -> np.ndarray:
    h, w = img.shape[:2]
    th, tw = _target_size(h, w, size, keep_aspect)
    if th * tw > MAX_IMAGE_PIXELS:  # keep_aspect scales the longer side with the image
        raise ValueError(f"resizing a {h}x{w} image to {th}x{tw} is over {MAX_IMAGE_PIXELS} pixels")
    if (th, tw) == (h, w):
        return img
    image = _pil()
    resample = _RESAMPLE[method]
    if img.dtype == np.uint8 and (img.ndim == 2 or img.shape[2] in (1, 3, 4)):
        squeeze = img.ndim == 3 and img.shape[2] == 1
        pil = image.fromarray(img[..., 0] if squeeze else img)
        out = np.asarray(pil.resize((tw, th), resample))
        return out[..., None] if squeeze else out
    chans = [img] if img.ndim == 2 else [img[..., c] for c in range(img.shape[2])]
    res = [
        np.asarray(image.fromarray(c.astype(np.float32), mode="F").resize((tw, th), resample))
        for c in chans
    ]
    out = res[0] if img.ndim == 2 else np.stack(res, axis=-1)
    return out.astype(img.dtype)


def _resize(
    x: Images, *, size: int | Sequence[int], method: str = "bilinear", keep_aspect: bool = False
) -> Images:
    """Resize HWC images. An int ``size`` with ``keep_aspect`` sets the shorter side."""
    if method not in _RESAMPLE:
        raise ValueError(f"resize method must be one of {sorted(_RESAMPLE)}")
    return _stack([_resize_one(np.asarray(i), size, method, keep_aspect) for i in x])


def _center_crop(x: Images, *, size: int | Sequence[int]) -> Images:
    """Crop the central ``size`` (int or [h, w]) of each HWC image."""
    th, tw = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    out = []
    for img in x:
        h, w = img.shape[:2]
        if th > h or tw > w:
            raise ValueError(f"cannot crop {th}x{tw} from a {h}x{w} image")
        top, left = (h - th) // 2, (w - tw) // 2
        out.append(np.asarray(img)[top : top + th, left : left + tw])
    return _stack(out)


_LUMA = np.array([0.299, 0.587, 0.114], np.float32)  # ITU-R 601, as Pillow's "L"


def _color_one(img: np.ndarray, source: str, target: str) -> np.ndarray:
    if source == target:
        return img
    if source == "GRAY":
        gray = img if img.ndim == 2 else img[..., 0]
        rgb = np.repeat(gray[..., None], 3, axis=-1)
        return rgb if target == "RGB" else rgb[..., ::-1]
    rgb = img[..., :3] if source == "RGB" else img[..., 2::-1]
    if target == "GRAY":
        gray = rgb.astype(np.float32) @ _LUMA
        out: np.ndarray = (
            np.clip(np.rint(gray), 0, 255).astype(np.uint8)
            if img.dtype == np.uint8
            else gray.astype(img.dtype)
        )
        return out[..., None]
    return np.ascontiguousarray(rgb[..., ::-1]) if target == "BGR" else np.ascontiguousarray(rgb)


_COLOR_MODES = ("RGB", "BGR", "GRAY")


def _color_mode(x: Images, *, target: str, source: str = "RGB") -> Images:
    """Convert channel order/colour: RGB, BGR or GRAY (GRAY keeps a 1-channel axis)."""
    if source not in _COLOR_MODES or target not in _COLOR_MODES:
        raise ValueError(f"color modes are {', '.join(_COLOR_MODES)}")
    return _stack([_color_one(np.asarray(i), source, target) for i in x])


OPERATORS: dict[str, Op] = {
    "decode": _decode,
    "resize": _resize,
    "center_crop": _center_crop,
    "color_mode": _color_mode,
    "cast": _cast,
    "normalize": _normalize,
    "reshape": _reshape,
    "layout": _layout,
    "softmax": _softmax,
    "sigmoid": _sigmoid,
    "topk": _topk,
    "argmax": _argmax,
    "reduce": _reduce,
    "identity": _identity,
}

# --- option checks: run once when steps compile, so a manifest's options never make a
# query allocate without bound, and a bad one is refused before the model is served.


def _whole(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} is a whole number from {low} to {high}, not {value!r:.40}")
    return value


def _image_size(value: Any) -> tuple[int, int]:
    """``size``: one side or ``[height, width]``, each within :data:`MAX_IMAGE_SIDE`."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"size is one number or [height, width], not {len(value)} numbers")
        return (
            _whole(value[0], "size", 1, MAX_IMAGE_SIDE),
            _whole(value[1], "size", 1, MAX_IMAGE_SIDE),
        )
    side = _whole(value, "size", 1, MAX_IMAGE_SIDE)
    return side, side


def _check_resize(opts: dict[str, Any]) -> None:
    h, w = _image_size(opts["size"])
    if h * w > MAX_IMAGE_PIXELS:
        raise ValueError(f"size {h}x{w} is over {MAX_IMAGE_PIXELS} pixels")
    if opts.get("method", "bilinear") not in _RESAMPLE:
        raise ValueError(f"method must be one of {sorted(_RESAMPLE)}")


def _check_reshape(opts: dict[str, Any]) -> None:
    shape = opts["shape"]
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_SAMPLE_DIMS:
        raise ValueError(f"shape is a list of at most {MAX_SAMPLE_DIMS} dimensions")
    dims = [_whole(d, "a dimension", -1, MAX_SAMPLE_ELEMENTS) for d in shape]
    if 0 in dims or dims.count(-1) > 1:
        raise ValueError("every dimension is at least 1, except one that may be -1")


def _check_cast(opts: dict[str, Any]) -> None:
    if np.dtype(opts["dtype"]).kind not in "biuf":
        raise ValueError(f"dtype {opts['dtype']!r:.40} is not a numeric type")


def _check_layout(opts: dict[str, Any]) -> None:
    source, target = opts["source"], opts["target"]
    if not (isinstance(source, str) and isinstance(target, str)):
        raise ValueError("source and target are layouts such as HWC and CHW")
    if len(set(source)) != len(source) or len(source) > MAX_SAMPLE_DIMS:
        raise ValueError(f"layout {source:.40} names each axis once, at most {MAX_SAMPLE_DIMS}")
    if sorted(source) != sorted(target):
        raise ValueError(f"cannot convert layout {source:.40} to {target:.40}")


def _check_crop(opts: dict[str, Any]) -> None:
    _image_size(opts["size"])


def _check_topk(opts: dict[str, Any]) -> None:
    _whole(opts.get("k", 5), "k", 1, MAX_SAMPLE_ELEMENTS)


def _check_reduce(opts: dict[str, Any]) -> None:
    if opts.get("op", "max") not in _REDUCTIONS:
        raise ValueError(f"op must be one of {', '.join(_REDUCTIONS)}")


def _check_color(opts: dict[str, Any]) -> None:
    if opts["target"] not in _COLOR_MODES or opts.get("source", "RGB") not in _COLOR_MODES:
        raise ValueError(f"color modes are {', '.join(_COLOR_MODES)}")


_OPTION_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "resize": _check_resize,
    "center_crop": _check_crop,
    "reshape": _check_reshape,
    "cast": _check_cast,
    "layout": _check_layout,
    "topk": _check_topk,
    "reduce": _check_reduce,
    "color_mode": _check_color,
}
"""Bounds on an operator's options beyond its signature (which is checked for all)."""


def _operator(name: str, options: Any, where: str) -> tuple[Op, dict[str, Any]]:
    """The operator ``name`` and its options, checked now rather than per query: an
    unknown operator, unknown or missing options and values past the bounds above are
    ManifestErrors naming the step."""
    op = OPERATORS.get(name)
    if op is None:
        known = ", ".join([*OPERATORS, CUSTOM_STEP])
        raise ManifestError(f"unknown operator {name!r} (known: {known})", field=where)
    if options is not None and not isinstance(options, dict):
        raise ManifestError(f"options of {name!r} must be a mapping", field=where)
    opts = dict(options or {})
    try:
        inspect.signature(op).bind(None, **opts)
        check = _OPTION_CHECKS.get(name)
        if check is not None:
            check(opts)
    except (TypeError, ValueError) as exc:
        raise ManifestError(f"options of {name!r}: {exc}", field=where) from exc
    return op, opts


_CUSTOM_RULE = (
    "custom Python steps run only for a manifest loaded from a trusted local directory "
    "on an agent whose settings allow custom code; never for a manifest received over "
    "the bus (see docs/SECURITY.md)"
)


def _custom(
    options: Any, *, where: str, trusted: bool, allow_custom: bool, env: Mapping[str, Any]
) -> Callable[[Any], Any]:
    if not (trusted and allow_custom):
        why = "the manifest is not trusted" if not trusted else "custom code is not allowed"
        raise ManifestError(
            f"refusing custom Python step ({why}): {_CUSTOM_RULE}",
            field=where,
            reason="custom_code",
        )
    if not isinstance(options, dict) or set(options) != {"module", "function"}:
        raise ManifestError("a python step is {python: {module: M, function: F}}", field=where)
    try:
        fn = getattr(importlib.import_module(str(options["module"])), str(options["function"]))
    except (ImportError, AttributeError) as exc:
        raise ManifestError(
            f"cannot load {options['module']}.{options['function']}: {exc}", field=where
        ) from exc
    if not callable(fn):
        raise ManifestError(
            f"{options['module']}.{options['function']} is not callable", field=where
        )
    step_env = dict(env)
    return lambda x: fn(step_env, x)


def compile_steps(
    steps: Sequence[dict[str, Any]],
    *,
    where: str = "steps",
    trusted: bool = False,
    allow_custom: bool = False,
    env: Mapping[str, Any] | None = None,
) -> Pipeline:
    """One callable running every step in order; unknown operators are ManifestErrors.

    A ``python`` step runs only when ``trusted`` (the manifest came from a local
    trusted directory) and ``allow_custom`` (the agent's settings allow it) are both
    true; otherwise compiling fails with a ManifestError that states the rule.
    ``env`` is the read-only context handed to custom functions as their first argument.
    """
    calls: list[Callable[[Any], Any]] = []
    for i, step in enumerate(steps):
        if not isinstance(step, dict) or len(step) != 1:
            raise ManifestError("each step is a mapping with one operator", field=f"{where}.{i}")
        ((name, options),) = step.items()
        if name == CUSTOM_STEP:
            calls.append(
                _custom(
                    options,
                    where=f"{where}.{i}",
                    trusted=trusted,
                    allow_custom=allow_custom,
                    env=env or {},
                )
            )
            continue
        op, opts = _operator(name, options, f"{where}.{i}")
        if name in RANK_PRESERVING and _next_name(steps, i) in INDEX_STEPS:
            op = RANK_PRESERVING[name]
        calls.append(functools.partial(op, **opts))

    def run(x: Any) -> Any:
        for call in calls:
            x = call(x)
        return x

    return run


INDEX_STEPS = ("topk", "argmax")
"""Operators whose result is class indices, which a labels file can name."""


def _softmax_unless_ranked(x: np.ndarray, *, axis: int = -1) -> np.ndarray:
    if isinstance(x, np.ndarray) and x.ndim == 2 and axis in (-1, 1):
        return x  # one row of scores per sample: softmax keeps its ranking
    return _softmax(x, axis=axis)


RANK_PRESERVING: dict[str, Op] = {
    "sigmoid": lambda x: x,
    "softmax": _softmax_unless_ranked,
}
"""What a step becomes right before an index step, which keeps only the ranking: a
sigmoid (monotone) is skipped, and a softmax over each sample's one row of scores.
Besides saving work, ranking the logits keeps apart classes whose probabilities round
to the same float."""


def _next_name(steps: Sequence[dict[str, Any]], i: int) -> str | None:
    nxt = steps[i + 1] if i + 1 < len(steps) else None
    return next(iter(nxt), None) if isinstance(nxt, dict) else None


def labeler(
    steps: Sequence[dict[str, Any]], labels: Sequence[str] | None
) -> Callable[[np.ndarray], np.ndarray] | None:
    """The labels of a post-processing result, or None when there is nothing to name.

    When ``steps`` end in class indices (:data:`INDEX_STEPS`) and ``labels`` (the
    output's labels file, one per line) is given, returns a function mapping an index
    array to a same-shaped unicode array: one vectorized lookup, run only for the
    queries that ask for labels, so load runs never build strings. An index past the
    labels file is a ValueError.
    """
    if not labels or not steps or next(iter(steps[-1]), None) not in INDEX_STEPS:
        return None
    table = np.asarray(labels, dtype=str)

    def name(indices: np.ndarray) -> np.ndarray:
        if indices.size and (indices.min() < 0 or indices.max() >= len(table)):
            raise ValueError(
                f"class indices outside the {len(table)} labels "
                f"({int(indices.min())}..{int(indices.max())})"
            )
        named: np.ndarray = table[indices]
        return named

    return name
