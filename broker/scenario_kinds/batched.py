"""``batched``: a closed-loop sweep of batch sizes; the highest throughput wins."""

from __future__ import annotations

from broker.context import Context
from broker.scenario import Outcome, Scenario, run_once
from mlscope.contracts import ScenarioSpec

__all__ = ["Batched"]


class Batched(Scenario):
    """Closed loop at each of ``batch_sizes``: max throughput and the optimal batch size.

    Of several sizes, each point is a run with its own evaluation id (``<parent>-<k>``:
    its queries and spans), stored on its own and listed in the parent summary's
    ``points``; the parent's figures are the best's. A sweep of one size is one run,
    the evaluation itself.
    """

    kind = "batched"

    async def execute(self, ctx: Context, spec: ScenarioSpec) -> Outcome:
        sizes = spec.batch_sizes or (spec.batch_size,)
        runs = []
        for k, b in enumerate(sizes):
            point = spec.model_copy(update={"batch_size": b})
            runs.append(await run_once(ctx, self, point, self.run_id(ctx, spec, k)))
        best = max(runs, key=lambda r: r.figures.throughput_ips or 0.0)
        return Outcome(best, runs, optimal_batch_size=best.spec.batch_size)
