"""TFLite (ai-edge-litert): no framework-level spans.

What it cannot do: LiteRT's Python ``Interpreter`` exposes no per-op timing. Its
op profiler (``tflite::profiling``) exists only in C++ (the benchmark tool
``benchmark_model --enable_op_profiling``), and ``Interpreter._get_ops_details()``
lists ops without times. XNNPACK also fuses the graph into one delegate op, so even
the C++ profiler would see one "op" per delegated partition. A ``framework``-level
TFLite evaluation therefore has model-level spans only (query, preprocess, predict,
postprocess), and this is logged once per predictor.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["make"]

log = logging.getLogger(__name__)


def make(predictor: Any) -> None:
    log.warning(
        "tflite: the LiteRT Python interpreter has no per-op timing; "
        "framework level gives model-level spans only"
    )
    return None
