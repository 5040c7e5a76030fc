"""``cold-start``: the model unloaded and loaded again ``repetitions`` times, each load
followed by ``warm_queries`` closed-loop queries (broker/coldstart.py measures)."""

from __future__ import annotations

from dataclasses import replace

from broker import coldstart
from broker.context import Context
from broker.run import Run
from broker.scenario import Outcome, Scenario, driver
from broker.summary import figures, latency_split
from mlscope.contracts import ScenarioSpec
from mlscope.record import RunRecord
from mlscope.validity import Verdict

__all__ = ["ColdStart"]


class ColdStart(Scenario):
    """Load and first inference measured apart from warm inference."""

    kind = "cold-start"

    async def execute(self, ctx: Context, spec: ScenarioSpec) -> Outcome:
        """Loads measured apart from warm inference; valid when every load really happened
        and no query failed (the load-rate rules do not apply to a handful of queries)."""

        async def drive(warm: ScenarioSpec) -> RunRecord:
            inputs, labels = ctx.feeders(warm.batch_size)
            return await driver(ctx, warm, inputs, labels).run()

        rec, cold = await coldstart.run(ctx.bus, ctx.agent_id, ctx.prepare, spec, drive)
        failed = int(rec.n - int(rec.ok.sum()))
        why = (*coldstart.reasons(cold), *((f"{failed} warm queries failed",) if failed else ()))
        # Throughput of the warm queries: the reloads between repetitions are not
        # inference time (the span of the concatenated record holds them).
        f = replace(figures(rec, has_labels=False), throughput_ips=cold["warm_throughput_ips"])
        run = Run(
            ctx.evaluation_id,
            spec,
            rec,
            f,
            Verdict(valid=not why, reasons=why),
            latency_split(rec),
            None,
        )
        return Outcome(run, cold_start=cold)
