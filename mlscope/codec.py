"""The one wire encoding: msgpack, with numpy arrays as raw bytes + dtype + shape.

An array is encoded as the msgpack extension type 1 whose body is a small msgpack
header ``[dtype_str, shape]`` followed by the C-contiguous bytes; decoding makes a
zero-copy (read-only) view when possible. No per-element Python objects are built.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
import numpy as np
from pydantic import BaseModel, ValidationError

from mlscope.errors import WireError

__all__ = ["decode", "decode_model", "encode", "encode_model", "validate"]

_NDARRAY = 1
MAX_ERROR_CHARS = 2000
"""An error about a message says at most this much."""
M = TypeVar("M", bound=BaseModel)


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype == object:
            raise TypeError("object arrays cannot go on the wire")
        # ascontiguousarray would make a 0-d array 1-d (a scalar input such as a sample
        # rate must keep its shape); a 0-d array is always contiguous.
        arr = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)
        head = msgpack.packb([arr.dtype.str, list(arr.shape)])
        return msgpack.ExtType(_NDARRAY, head + arr.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="python")
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code != _NDARRAY:
        return msgpack.ExtType(code, data)
    unpacker = msgpack.Unpacker()
    unpacker.feed(data)
    dtype, shape = unpacker.unpack()
    offset = unpacker.tell()
    return np.frombuffer(data, dtype=np.dtype(dtype), offset=offset).reshape(shape)


def encode(obj: Any) -> bytes:
    """Encode plain data (dicts, lists, scalars, numpy arrays) to bytes."""
    try:
        return msgpack.packb(obj, default=_default, use_bin_type=True)  # type: ignore[no-any-return]
    except (TypeError, ValueError) as exc:
        raise WireError(f"cannot encode message: {exc}") from exc


def decode(data: bytes) -> Any:
    """Decode bytes produced by :func:`encode`; malformed input raises WireError."""
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises a zoo of types; translate them all here
        raise WireError(f"malformed message ({len(data)} bytes): {exc}") from exc


def encode_model(model: BaseModel) -> bytes:
    return encode(model.model_dump(mode="python", by_alias=True))


def decode_model(cls: type[M], data: bytes) -> M:
    """Decode and validate one contract message; every failure is a WireError."""
    return validate(cls, decode(data))


def validate(cls: type[M], raw: Any) -> M:
    """Validate one decoded contract message; a failure is a WireError."""
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        # Without the input: an error must not echo (and so amplify) a hostile message.
        why = str(exc.errors(include_url=False, include_input=False))
        raise WireError(f"invalid {cls.__name__}: {why[:MAX_ERROR_CHARS]}") from exc
