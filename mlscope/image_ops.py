"""The image operators of a manifest's steps: ``decode``, ``resize``, ``center_crop``,
``color_mode`` (:mod:`mlscope.operators` runs them with the others).

Images travel as HWC ``uint8`` arrays (``N x H x W x C``, or ``N x H x W`` for gray).
Until ``resize``/``center_crop`` make them one size, a batch of images may be a list
of arrays of different sizes; every image operator accepts either. Their options are
checked once, when steps compile (:data:`IMAGE_OPTION_CHECKS`): steps come from
manifests, which may come from the bus, and a resize allocates its target size for
every image of every query.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mlscope.manifest import MAX_SAMPLE_ELEMENTS

__all__ = [
    "IMAGE_OPERATORS",
    "IMAGE_OPTION_CHECKS",
    "MAX_IMAGE_PIXELS",
    "MAX_IMAGE_SIDE",
    "whole",
]

Images = np.ndarray | list[np.ndarray]
MAX_IMAGE_SIDE = 16384
"""Longest side of an image a step makes (``resize``, ``center_crop``)."""
MAX_IMAGE_PIXELS = MAX_SAMPLE_ELEMENTS // 4
"""Most pixels of an image ``resize`` makes (4096 x 4096): with four channels, the
largest sample a manifest may declare. Steps come from manifests, which may come from
the bus, and a resize allocates its target size for every image of every query."""


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


IMAGE_OPERATORS: dict[str, Callable[..., Any]] = {
    "decode": _decode,
    "resize": _resize,
    "center_crop": _center_crop,
    "color_mode": _color_mode,
}


def whole(value: Any, what: str, low: int, high: int) -> int:
    """``value`` when it is a whole number from ``low`` to ``high`` (else ValueError)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} is a whole number from {low} to {high}, not {value!r:.40}")
    return value


def _image_size(value: Any) -> tuple[int, int]:
    """``size``: one side or ``[height, width]``, each within :data:`MAX_IMAGE_SIDE`."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"size is one number or [height, width], not {len(value)} numbers")
        return (
            whole(value[0], "size", 1, MAX_IMAGE_SIDE),
            whole(value[1], "size", 1, MAX_IMAGE_SIDE),
        )
    side = whole(value, "size", 1, MAX_IMAGE_SIDE)
    return side, side


def _check_resize(opts: dict[str, Any]) -> None:
    h, w = _image_size(opts["size"])
    if h * w > MAX_IMAGE_PIXELS:
        raise ValueError(f"size {h}x{w} is over {MAX_IMAGE_PIXELS} pixels")
    if opts.get("method", "bilinear") not in _RESAMPLE:
        raise ValueError(f"method must be one of {sorted(_RESAMPLE)}")


def _check_crop(opts: dict[str, Any]) -> None:
    _image_size(opts["size"])


def _check_color(opts: dict[str, Any]) -> None:
    if opts["target"] not in _COLOR_MODES or opts.get("source", "RGB") not in _COLOR_MODES:
        raise ValueError(f"color modes are {', '.join(_COLOR_MODES)}")


IMAGE_OPTION_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "resize": _check_resize,
    "center_crop": _check_crop,
    "color_mode": _check_color,
}
"""Bounds on the image operators' options beyond their signatures."""
