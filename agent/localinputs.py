"""A local run's query inputs (:mod:`agent.localrun`): the server's sample order over
the data set's rows, held pre-processed by the agent when they may be."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from agent.job import Model
from agent.samplelib import MemoryBudget, preprocess_all
from mlscope import samples
from mlscope.catalog import Entry
from mlscope.contracts import RunOp
from mlscope.errors import ConfigError

__all__ = ["run_inputs"]

log = logging.getLogger("mlscope.agent")


def run_inputs(
    entry: Entry, model: Model, req: RunOp, *, zoo_dir: Path, budget: MemoryBudget
) -> tuple[samples.QueryRows, int | None]:
    """A local run's query inputs (the server's sample order) and, when its samples are
    held pre-processed, the bytes they took of ``budget`` (else None; the caller gives
    them back when the run's rows are shipped).

    ``preprocess`` None holds them where the pipeline pre-processes sample by sample and
    they fit; ``ahead`` insists (a typed error otherwise); ``timed`` never does."""
    spec = req.scenario
    data = samples.dataset(entry, zoo_dir)
    x, _ = samples.table(data, entry.manifest.inputs[0].shape, spec.seed)
    _refuse_a_query_over_the_budget(entry, x, spec.batch_size, budget, req.evaluation_id)
    pre: np.ndarray | None = None
    if spec.preprocess != "timed":
        try:
            pre = preprocess_all(req.evaluation_id, x, model, budget)
        except ConfigError:
            if spec.preprocess == "ahead":
                raise
            log.info("local run %s: samples over the sample memory: timed", req.evaluation_id)
        if pre is None and spec.preprocess == "ahead":
            raise ConfigError(
                f"{entry.manifest.name}: its pre-processing does not run sample by sample, "
                "so its samples cannot be held pre-processed; use preprocess timed",
                field="preprocess",
            )
    inputs, _ = samples.feed(pre if pre is not None else x, None, spec.batch_size, spec.seed)
    return inputs, (None if pre is None else pre.nbytes)


def _refuse_a_query_over_the_budget(
    entry: Entry, x: np.ndarray, batch: int, budget: MemoryBudget, evaluation_id: str
) -> None:
    """A query's inputs are gathered for it (a copy of ``batch`` rows, raw or
    pre-processed): one larger than all the samples this agent may hold is refused
    before anything is allocated (efficientnet_lite0 at batch 65,536 would be 39 GB)."""
    first = entry.manifest.inputs[0]
    row = max(
        int(x[0].nbytes) if len(x) else 0,
        math.prod(first.shape) * np.dtype(first.element_type).itemsize,
    )
    if batch * row > budget.limit:
        raise ConfigError(
            f"a query of batch size {batch} holds {batch * row:,} bytes of inputs, over this "
            f"agent's sample memory of {budget.limit:,} (mlscope agent --sample-memory); "
            f"the largest batch size that fits is {budget.limit // row:,}",
            field="batch_size",
            evaluation_id=evaluation_id,
            batch_size=batch,
            limit_bytes=budget.limit,
        )
