"""Pre- and post-processing operators (paper section 4.1.1), run in manifest order.

A step in a manifest is ``{operator: {options}}``. Each operator is a function
``(batch, **options) -> batch`` over a batch whose first axis is the batch.
:func:`compile_steps` turns a step list into one callable once, at model load, so
the per-query path does no lookups.

The image operators (``decode``, ``resize``, ``center_crop``, ``color_mode``) are in
:mod:`mlscope.image_ops`.

Custom Python steps (``{python: {module: M, function: F}}``, called as
``F(env, data)``) run only for a trusted manifest on an agent that allows them; see
``docs/SECURITY.md``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from mlscope.errors import ManifestError
from mlscope.image_ops import IMAGE_OPERATORS, IMAGE_OPTION_CHECKS, whole
from mlscope.manifest import MAX_SAMPLE_DIMS, MAX_SAMPLE_ELEMENTS

__all__ = [
    "CUSTOM_STEP",
    "INDEX_STEPS",
    "OPERATORS",
    "Pipeline",
    "compile_steps",
    "labeler",
]

Op = Callable[..., Any]
Pipeline = Callable[[Any], Any]
CUSTOM_STEP = "python"
"""Name of the custom-code step (gated, see :func:`compile_steps`)."""


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


OPERATORS: dict[str, Op] = {
    **IMAGE_OPERATORS,
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


def _check_reshape(opts: dict[str, Any]) -> None:
    shape = opts["shape"]
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_SAMPLE_DIMS:
        raise ValueError(f"shape is a list of at most {MAX_SAMPLE_DIMS} dimensions")
    dims = [whole(d, "a dimension", -1, MAX_SAMPLE_ELEMENTS) for d in shape]
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


def _check_topk(opts: dict[str, Any]) -> None:
    whole(opts.get("k", 5), "k", 1, MAX_SAMPLE_ELEMENTS)


def _check_reduce(opts: dict[str, Any]) -> None:
    if opts.get("op", "max") not in _REDUCTIONS:
        raise ValueError(f"op must be one of {', '.join(_REDUCTIONS)}")


_OPTION_CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    **IMAGE_OPTION_CHECKS,
    "reshape": _check_reshape,
    "cast": _check_cast,
    "layout": _check_layout,
    "topk": _check_topk,
    "reduce": _check_reduce,
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
