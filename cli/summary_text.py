"""An evaluation's summary as the text ``mlscope-submit``, ``mlscope rerun``,
``mlscope mlperf`` and ``mlscope demo`` print: aligned ``label  value`` lines."""

from __future__ import annotations

from mlscope.contracts import EvaluationSummary

__all__ = ["format_summary"]


def _f(v: float | None, unit: str = "", nd: int = 3) -> str:
    """A figure with ``nd`` decimals, or "-" when there is none."""
    return "-" if v is None else f"{v:.{nd}f}{unit}"


def format_summary(s: EvaluationSummary) -> str:
    """The summary as aligned ``label  value`` lines; each part says what it shows only
    when the summary has it (a sweep's points, a search's peak, a cold start's loads)."""
    rows = [
        *_identity_rows(s),
        *_load_rows(s),
        *_resource_rows(s),
        *_detail_rows(s),
        *_search_rows(s),
        *_cold_start_rows(s),
        *_mlperf_rows(s),
    ]
    return "\n".join(f"  {k:<13} {v}" for k, v in rows)


_PREPROCESS = {
    "ahead": "samples pre-processed ahead (not timed)",
    "timed": "pre-processing timed in each query",
}


def _identity_rows(s: EvaluationSummary) -> list[tuple[str, str]]:
    """What ran where, and its verdict."""
    verdict = "VALID" if s.valid else "INVALID: " + "; ".join(s.invalid_reasons)
    sc = s.scenario
    return [
        ("evaluation", s.evaluation_id),
        ("model", f"{s.model['name']} {s.model['version']}"),
        ("framework", f"{s.framework['name']} {s.framework['version']} on {s.device}"),
        ("agent", f"{s.agent_id} ({s.host})"),
        ("scenario", f"{sc['name']} batch={sc['batch_size']}{_sut(sc)} seed={sc['seed']}"),
        ("placement", f"load generated in the {s.placement}; {_PREPROCESS[s.preprocess]}"),
        ("verdict", verdict),
    ]


def _sut(scenario: dict[str, object]) -> str:
    """An MLPerf run's SUT batch (its rows are one sample each: batch 1)."""
    sut = scenario.get("sut_batch_size")
    return f" (SUT batch {sut})" if sut else ""


def _load_rows(s: EvaluationSummary) -> list[tuple[str, str]]:
    """Counts, rates, latency, issue lag and throughput."""
    lat, lag = s.latency_ms, s.issue_lag_us
    warm = f"; {s.warmup_queries} warm-up" if s.warmup_queries else ""
    backlog = f"; backlog {s.backlog_s:.3g} s" if s.backlog_s is not None else ""
    return [
        (
            "queries",
            f"{s.queries} ({s.samples} samples; {s.failed} failed, {s.refused} "
            f"refused, {s.lost} lost, {s.not_issued} not issued{warm}) in {s.duration_s:.2f} s",
        ),
        (
            "rate",
            f"requested {_f(s.requested_qps, '', 1)} / offered "
            f"{_f(s.scheduled_qps, '', 1)} / issued {_f(s.achieved_qps, '', 1)} / "
            f"completed {_f(s.completed_qps, '', 1)} QPS{backlog}",
        ),
        (
            "latency ms",
            f"trimmed mean {_f(lat.trimmed_mean)}  p50 {_f(lat.p50)}  p90 "
            f"{_f(lat.p90)}  p99 {_f(lat.p99)}  max {_f(lat.max)}",
        ),
        (
            "issue lag µs",
            f"p50 {_f(lag.get('p50'), '', 1)}  p99 {_f(lag.get('p99'), '', 1)}  "
            f"p99.9 {_f(lag.get('p99.9'), '', 1)}  max {_f(lag.get('max'), '', 1)}",
        ),
        ("throughput", f"{_f(s.throughput_ips, '', 1)} inputs/s"),
    ]


def _detail_rows(s: EvaluationSummary) -> list[tuple[str, str]]:
    """Issue-lag parts, load-generator cost, warnings, accuracy, latency split, hosts."""
    rows: list[tuple[str, str]] = []
    if split := s.issue_lag_split_us or {}:
        parts = (
            f"{k} p99 {_f(v.get('p99'), '', 1)} max {_f(v.get('max'), '', 1)}"
            for k, v in split.items()
        )
        rows.append(("  lag parts", "  ".join(parts)))
    cost = s.loadgen_cost or {}
    if cost.get("cpu_us_per_query") is not None:
        where = (
            " in the agent's process"
            if cost.get("placement") == "agent"
            else " (the agent's host)"
            if cost.get("shared_host")
            else ""
        )
        rows.append(
            (
                "loadgen",
                f"{cost['cpu_us_per_query']:.0f} µs CPU per query on {cost.get('host')}{where}",
            )
        )
    rows += [("WARNING", w) for w in s.warnings]
    if s.accuracy:
        rows.append(("accuracy", "  ".join(f"{k} {v:.4f}" for k, v in s.accuracy.items())))
    if s.latency_split_ms:
        parts = (f"{k} {_f(v.get('p50'))}" for k, v in s.latency_split_ms.items())
        rows.append(("split ms p50", "  ".join(parts)))
    if s.scenario.get("loadgen_hosts"):
        rows.append(
            ("loadgens", f"services {', '.join(s.scenario['loadgen_hosts'])}, one schedule")
        )
    elif s.scenario.get("loadgens", 1) > 1:
        rows.append(("loadgens", f"{s.scenario['loadgens']} processes, one schedule"))
    return rows


def _search_rows(s: EvaluationSummary) -> list[tuple[str, str]]:
    """What a run of several runs found (a peak rate, an optimal batch) and each run."""
    rows: list[tuple[str, str]] = []
    if s.peak_qps is not None:
        bound = s.scenario.get("latency_bound_ms")
        rows.append(("peak", f"{_f(s.peak_qps, ' QPS', 1)} with p99 <= {bound} ms"))
    if s.optimal_batch_size is not None:
        rows.append(("optimal batch", f"{s.optimal_batch_size}"))
    for pt in s.points:
        lat = pt["latency_ms"]
        rows.append(
            (
                "  tried",
                f"qps {_f(pt['qps'], '', 1)} batch {pt['batch_size']}: p50 "
                f"{_f(lat['p50'])} p99 {_f(lat['p99'])} ms, "
                f"{_f(pt['throughput_ips'], '', 1)} inputs/s, "
                f"{'VALID' if pt['valid'] else 'INVALID'} ({pt['evaluation_id']})",
            )
        )
    return rows


def _cold_start_rows(s: EvaluationSummary) -> list[tuple[str, str]]:
    """Load and first inference apart from warm inference, when they were measured: a
    cold-start scenario's repetitions, or the one prepare of any other run (whose model
    may have been loaded already by an earlier evaluation: then nothing was measured)."""
    c = s.cold_start
    if not c:
        return []
    if "repetitions" not in c:
        if not c.get("cold"):
            return [("cold start", "not measured: the model was already loaded (warm)")]
        return [
            (
                "cold start",
                f"load {_f(c.get('load_ms'))} ms  first inference "
                f"{_f(c.get('first_inference_ms'))} ms",
            )
        ]
    return [
        (
            "cold start",
            f"load {_f(c.get('load_ms'))} ms  first inference "
            f"{_f(c.get('first_inference_ms'))} ms  warm predict "
            f"{_f(c.get('warm_predict_ms'))} ms  "
            f"({c.get('cold_loads')}/{c['repetitions']} loads)",
        )
    ]


def _mlperf_rows(s: EvaluationSummary) -> list[tuple[str, str]]:
    """LoadGen's own figures of an MLPerf run, apart from mlscope's (which the lines
    above compute from its rows, one per sample): its rate, its percentiles (per query
    in MultiStream) and its runtime errors."""
    m = s.mlperf
    if not m:
        return []
    pct = m.get("percentiles_ns") or {}
    shown = "  ".join(
        f"p{float(q):g} {_f(ns / 1e6)}"
        for q, ns in sorted(pct.items(), key=lambda kv: float(kv[0]))
        if float(q) in (50.0, 90.0, 99.0)
    )
    return [
        (
            "LoadGen",
            f"{_f(m.get('throughput_ips'), '', 1)} samples/s; latency ms {shown or '-'}; "
            f"{m.get('samples_per_query', '-')} samples per query; "
            f"{m.get('num_errors', 0)} runtime errors",
        )
    ]


def _resource_rows(s: EvaluationSummary) -> list[tuple[str, str]]:
    """The agent's memory over the run and the energy used, or that it is unknown."""
    rows = []
    if s.peak_rss_mb is not None:
        growth = "-" if s.rss_growth_mb is None else f"{s.rss_growth_mb:+.1f} MB"
        rows.append(("memory", f"agent peak RSS {s.peak_rss_mb:.1f} MB, growth {growth}"))
    if s.host_other_cores is not None:
        steal = "" if s.host_steal_cores is None else f", steal {s.host_steal_cores:.2f}"
        busy = f"other processes kept {s.host_other_cores:.2f} cores busy{steal}"
        rows.append(("host", f"{busy} (mean over the evaluation)"))
    if s.energy_j is None:
        rows.append(("energy", "not available (no power source was read)"))
        return rows
    per = s.energy_per_inference_j
    each = f" ({per * 1e3:.3f} mJ per inference)" if per is not None else ""
    rows.append(("energy", f"{s.energy_j:.3f} J{each}"))
    return rows
