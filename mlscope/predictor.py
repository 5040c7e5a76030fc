"""The predictor interface (paper Listing 3): open, predict, close. Nothing else.

Each framework lives in its own module ``agent.predictors.<framework>`` exposing

    def probe() -> FrameworkInfo | None        # what really loads on this machine
    def open(model_path, manifest, options) -> Predictor

and is imported by name only when used, so ``import mlscope`` never loads a
framework. The common pipeline (pre-process, batching, post-process, tracing,
timing) is the same for every framework; only the predictor differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

__all__ = ["Predictor", "PredictorOptions"]


@dataclass(frozen=True, kw_only=True)
class PredictorOptions:
    """How to open a model; values come from the framework manifest and the job."""

    device: str = "cpu"
    """``cpu``, ``cuda`` / ``cuda:N``, or ``fpga:N``."""
    threads: int | None = None
    """Intra-op threads; None lets the runtime choose."""
    batch_size: int = 1
    """Largest batch the pipeline will send (for runtimes that need it up front)."""
    profile: bool = False
    """Collect framework-level (layer/op) timings for the tracer."""
    runtime: dict[str, Any] = field(default_factory=dict)
    """Framework-specific options from the framework manifest
    (:meth:`mlscope.framework_manifest.FrameworkManifest.runtime`)."""

    @property
    def intra_op_threads(self) -> int | None:
        """``threads`` when given, else the manifest's ``intra_op_threads``; None (or a
        manifest's 0) lets the runtime choose."""
        if self.threads:
            return self.threads
        value = self.runtime.get("intra_op_threads")
        return int(value) if value else None


class Predictor(Protocol):
    """An opened model. ``predict`` takes and returns batches, one array per tensor."""

    framework: str
    device: str

    def predict(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        """Run one batch synchronously; the device is synchronized before returning."""
        ...

    def close(self) -> None:
        """Release the model and its device memory; idempotent."""
        ...


# A predictor may also define ``effective_options() -> dict``: what its runtime says it
# really runs with (providers after fallback, thread counts). The agent stores it with
# each evaluation's specification; it is optional, not part of the interface above.
