"""MLPerf LoadGen as a job's load generator, and MLPerf logs imported as evaluations.

A job with ``JobRequest.mlperf`` is resolved, prepared and stored like any other job
(:class:`broker.evaluate.Evaluator`); only the load generator differs: official
LoadGen drives the agent through :class:`broker.mlperf_sut.AgentSUT`, with the
model's labelled data set as the QuerySampleLibrary, which the agent holds. Each test
runs in its own child process (why: broker/mlperf_sut.py), so several MLPerf jobs may
run at once and the server never imports LoadGen. With ``placement: agent`` the agent
runs that process next to the model and ships its files back
(:mod:`broker.mlperf_agent`); they are parsed and stored with the same code, the
SUT's clock being the agent's (mapped with the ping offset, as a local run's).

What is stored (``evaluations`` + ``queries`` + ``mlperf_logs``):

* one ``queries`` row per LoadGen sample from its trace log (scheduled, issued,
  completed on LoadGen's clock, from its start of the test), with the agent's
  timestamps of the query that carried the sample; LoadGen's clock is tied to ours by
  the median difference between each query's issue in the trace and the moment
  ``issue_query`` ran here. A row is one sample (``batch_size`` 1), as every reader of
  the rows takes a row of batch size 1 to be;
* the summary's figures (counts, errors, rates, latency, throughput) are mlscope's,
  from those rows with the definitions every evaluation has (:func:`broker.summary.figures`),
  so ``mlscope report`` recomputes the same; its verdict is LoadGen's (and no sample
  failed in the agent). LoadGen's own figures, read back from its detail and summary
  logs (:mod:`broker.mlperf_logs`) and never recomputed, are kept apart under
  ``summary.mlperf``: its percentiles (per query in MultiStream), rate, query count,
  samples per query and runtime errors (``num_errors``). An import without a trace
  has no rows: its figures are then LoadGen's;
* every log file verbatim (``mlperf_logs``, in parts), so ``mlscope mlperf`` can
  write them where the user asked and an imported run keeps its originals.

An imported run is stored once, under the id of its summary and detail logs
(:meth:`mlscope.contracts.MLPerfImport.identity`); importing it again answers with
what was stored (:func:`import_logs`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import anyio

from broker import lgclock
from broker import mlperf_logs as logs
from broker.db import Database
from broker.evalprep import PREPARE_TIMEOUT_S
from broker.evalspec import specification
from broker.evalsummary import budget_warnings, host_warnings, release_agent, release_figures
from broker.lgclock import estimate_offset
from broker.mlperf_agent import START_TIMEOUT_S, run_in_agent
from broker.mlperf_record import (
    loadgen_accuracy,
    loadgen_summary,
    sample_record,
    store_logs,
)
from mlscope import codec, names, scratch
from mlscope.bus import Bus, request
from mlscope.catalog import Entry
from mlscope.contracts import (
    AgentDescription,
    EvaluationSummary,
    JobRequest,
    MLPerfImport,
    MLPerfSpec,
    PrepareReply,
    evaluation_id_for,
    mlperf_run_identity,
)
from mlscope.errors import ConfigError, EvaluationError, error_from_wire
from mlscope.mlperf import ERROR, TIMING, load_timing
from mlscope.record import RunRecord
from mlscope.samples import dataset

__all__ = ["Host", "import_logs", "run"]


class Host(Protocol):
    """What an MLPerf run needs of the server's evaluator (``broker.evaluate.Evaluator``
    is one; it calls this module, so this module names only what it uses)."""

    bus: Bus
    db: Database
    zoo_dir: Path
    import_lock: anyio.Lock
    """Held while an import looks for its run and stores it (:func:`import_logs`)."""

    def store_evaluation(
        self, s: EvaluationSummary, rec: RunRecord | None, spec_doc: dict[str, Any]
    ) -> None:
        """The evaluation row and its query rows."""
        ...


async def run(
    ev: Host, job: JobRequest, agent: AgentDescription, entry: Entry
) -> EvaluationSummary:
    """One LoadGen test against ``agent`` (``ev`` is the server's evaluator)."""
    spec = job.mlperf
    if spec is None:
        raise EvaluationError("not an MLPerf job")
    m = entry.manifest
    data = dataset(entry, ev.zoo_dir)
    if data is None:
        raise EvaluationError(
            f"{m.name} has no labelled data set in its manifest: it "
            "cannot be LoadGen's sample library",
            model=m.name,
        )
    eval_id = evaluation_id_for(job.job_id)  # one evaluation per job
    ctl = names.agent_ctl(agent.agent_id)
    prep = await _prepare(ev.bus, ctl, eval_id, entry, spec)
    offset, rtt = await estimate_offset(ev.bus, agent.agent_id)
    started = time.time()
    conf_model = spec.conf_model or m.name
    released: dict[str, Any] = {}  # the agent's release reply: {} when it did not answer
    asked = lgclock.now()
    try:
        if job.placement == "agent":  # LoadGen next to the model, its clock the agent's
            timing, files = await run_in_agent(ev.bus, spec, conf_model, eval_id, agent)
        else:
            timing, files = await _test(ev, spec, conf_model, eval_id, agent, len(data[0]))
    finally:
        with anyio.CancelScope(shield=True):
            released = await release_agent(ev.bus, agent.agent_id, eval_id)
    missing = logs.missing(files)
    if missing:
        raise EvaluationError(f"LoadGen wrote no {', '.join(missing)}", evaluation_id=eval_id)
    result = logs.parse_result(files[logs.SUMMARY], files[logs.DETAIL])
    here = job.placement == "agent"
    trace = logs.trace_samples(files.get(logs.TRACE, ""))
    rec = sample_record(trace, timing, 0 if here else offset, data[1])
    if here and rec.n:  # tied to the agent's clock: onto ours, as a local run's t0
        rec.t0_ns = lgclock.on_our_clock(
            rec.t0_ns,
            offset,
            since_ns=asked,
            slack_s=START_TIMEOUT_S,
            what=f"agent {agent.agent_id} started its LoadGen test",
            agent_id=agent.agent_id,
            evaluation_id=eval_id,
        )
    elif here:
        rec.t0_ns -= offset
    accuracy = loadgen_accuracy(result, files, data[1])
    summary = loadgen_summary(result, rec, job, eval_id, started, accuracy=accuracy)
    summary = _described(
        summary, rec, int(timing["errors"]), job, agent, entry, (offset, rtt), prep
    )
    # What the agent's release says (its memory, energy and spans), as every run's says.
    figures = release_figures(released, summary.samples)
    host = host_warnings(figures, summary.loadgen_cost or {})
    warnings = (*summary.warnings, *budget_warnings(released), *host)
    summary = summary.model_copy(update={**figures, "warnings": warnings})
    spec_doc = specification(job, agent, entry, prep.dump())
    # Its logs written out (--output) and imported later are this run, found by this.
    spec_doc["mlperf_logs"] = {"sha256": mlperf_run_identity(files)}
    # The evaluation row last: a server that sees it takes the evaluation as stored whole.
    await anyio.to_thread.run_sync(store_logs, ev.db, eval_id, files)
    await anyio.to_thread.run_sync(ev.store_evaluation, summary, rec, spec_doc)
    return summary


async def _prepare(
    bus: Bus, ctl: str, eval_id: str, entry: Entry, spec: MLPerfSpec
) -> PrepareReply:
    """The agent loads the model for the test (untraced); its answer (load and first
    inference times, cold or not), checked now: a reply that lacks them is a typed
    error before the test, not a failure after it."""
    m = entry.manifest
    prepare = {
        "op": "prepare",
        "evaluation_id": eval_id,
        "model": m.name,
        "model_version": m.version,
        "batch_size": spec.batch_size,
        "trace_level": "none",
    }
    reply = await request(bus, ctl, codec.encode(prepare), timeout=PREPARE_TIMEOUT_S)
    return codec.validate(PrepareReply, reply)


def _described(
    summary: EvaluationSummary,
    rec: RunRecord,
    failed: int,
    job: JobRequest,
    agent: AgentDescription,
    entry: Entry,
    clock: tuple[int, int],
    prep: PrepareReply,
) -> EvaluationSummary:
    """LoadGen's summary with what ran it (framework, model, agent, placement, clock,
    cold start); ``failed`` samples answered to LoadGen with no data make it INVALID
    (the summary's ``errors`` counts them already, from the rows)."""
    if failed:
        summary = summary.model_copy(
            update={
                "valid": False,
                "invalid_reasons": (
                    *summary.invalid_reasons,
                    f"{failed} samples failed in the agent "
                    f"(first: {next(iter(rec.errors.values()), '')})",
                ),
            }
        )
    m = entry.manifest
    fw = next(x for x in agent.frameworks if x.name == job.framework)
    return summary.model_copy(
        update={
            "framework": {"name": fw.name, "version": fw.version},
            "model": {"name": m.name, "version": m.version},
            "agent_id": agent.agent_id,
            "host": agent.host,
            "placement": job.placement,
            "clock_offset_ns": clock[0],
            "clock_rtt_ns": clock[1],
            "cold_start": {
                "load_ms": prep.load_ns / 1e6,
                "first_inference_ms": prep.first_inference_ns / 1e6,
                "cold": prep.cold,
            },
        }
    )


async def _test(
    ev: Host,
    spec: MLPerfSpec,
    conf_model: str,
    eval_id: str,
    agent: AgentDescription,
    samples: int,
) -> tuple[dict[str, Any], dict[str, str]]:
    """Run the test in a child process (see broker/mlperf_sut.py for why); return what
    its SUT saw and LoadGen's log files (``samples``: the data set's size, which the
    agent holds)."""
    url = ev.bus.nc.connected_url
    with scratch.scratch_dir("mlperf") as tmp:
        work = Path(tmp)
        out = work / "logs"
        out.mkdir()
        cfg = {
            "spec": spec.model_dump(),
            "conf_model": conf_model,
            "evaluation_id": eval_id,
            "samples": samples,
            "subject": names.agent_samples(agent.agent_id),
            "ctl": names.agent_ctl(agent.agent_id),
            "workdir": str(work),
            "logdir": str(out),
            "nats_url": url.geturl() if url is not None else None,
            "parent_pid": os.getpid(),
        }
        (work / "config.json").write_text(json.dumps(cfg))
        with (work / "stderr.txt").open("wb") as err:
            proc = await anyio.open_process(
                [sys.executable, "-m", "broker.mlperf_sut", str(work / "config.json")],
                env=_child_env(),
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
            try:
                code = await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()  # LoadGen has no abort: a cancelled job ends its process
                    with anyio.CancelScope(shield=True):
                        await proc.wait()
        if (work / ERROR).exists():
            raise error_from_wire(json.loads((work / ERROR).read_text()))
        if code != 0:
            tail = (work / "stderr.txt").read_text(errors="replace")[-500:]
            raise EvaluationError(f"the LoadGen process failed (exit code {code}): {tail}")
        timing = load_timing(work / TIMING)
        files = {p.name: p.read_text(errors="replace") for p in out.iterdir() if p.is_file()}
    return timing, files


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


async def import_logs(ev: Host, job: JobRequest) -> EvaluationSummary:
    """Store MLPerf logs written elsewhere as an evaluation tagged ``imported``, once:
    logs stored before (by any job, from any path, or by the ``mlscope mlperf`` run on
    this server that wrote them: :func:`_ran_here`) answer with that evaluation's
    stored summary, its ``job_id`` the job that stored it, and nothing is stored again.

    What a run is, is :meth:`MLPerfImport.identity` (its summary and detail logs), and
    its evaluation id is derived from it, so every server agrees on it without asking
    another. Two imports of one run on this server take turns (``ev.import_lock``): the
    second finds the first's evaluation. On two servers at once both may find none and
    both store, under the one id: every table is a ReplacingMergeTree keyed by that id
    (the logs by id, name and part, the rows by id and query index), the same logs make
    the same rows, and every read of an evaluation is FINAL, so the run shows once
    (its evaluation row the later import's, the same figures)."""
    imp = job.mlperf_import
    if imp is None:
        raise EvaluationError("not an MLPerf import job")
    missing = logs.missing(imp.files)
    if missing:
        raise ConfigError(f"{imp.source or 'the import'} lacks {', '.join(missing)}", field="files")
    identity = imp.identity()
    eval_id = job.evaluation_id()  # the run's, not the job's
    async with ev.import_lock:
        stored = await anyio.to_thread.run_sync(_imported, ev.db, eval_id, identity)
        if stored is None:  # the logs of a run mlscope mlperf made and stored here?
            stored = await anyio.to_thread.run_sync(_ran_here, ev.db, identity)
        if stored is not None:
            return stored
        return await _store_import(ev, job, imp, eval_id, identity)


def _imported(db: Database, eval_id: str, identity: str) -> EvaluationSummary | None:
    """The stored summary of the run ``identity`` names (None: not imported yet).

    The id holds the identity's first 64 bits; the whole digest is stored with the run
    and must match, or these logs are not the run stored under it (two logs whose
    digests share 64 bits: made so on purpose), refused rather than answered with
    another run."""
    rows = db.rows(
        "SELECT spec, summary FROM evaluations FINAL WHERE evaluation_id = {id:String}",
        {"id": eval_id},
    )
    if not rows:
        return None
    stored = (json.loads(rows[0][0]).get("imported") or {}).get("sha256")
    if stored != identity:
        raise EvaluationError(
            f"evaluation {eval_id} holds other MLPerf logs than these (sha256 {stored} "
            f"stored, {identity} imported): not imported",
            evaluation_id=eval_id,
        )
    return EvaluationSummary.model_validate_json(rows[0][1])


def _ran_here(db: Database, identity: str) -> EvaluationSummary | None:
    """The stored summary of the ``mlscope mlperf`` run whose logs are ``identity``
    (its specification's ``mlperf_logs``), or None: its logs written out with
    ``--output`` and imported are that run, not a second evaluation of it."""
    rows = db.rows(
        "SELECT summary FROM evaluations FINAL "
        "WHERE JSONExtractString(spec, 'mlperf_logs', 'sha256') = {sha:String} "
        "ORDER BY created_at LIMIT 1",
        {"sha": identity},
    )
    return EvaluationSummary.model_validate_json(rows[0][0]) if rows else None


async def _store_import(
    ev: Host, job: JobRequest, imp: MLPerfImport, eval_id: str, identity: str
) -> EvaluationSummary:
    result = logs.parse_result(imp.files[logs.SUMMARY], imp.files[logs.DETAIL])
    rec = sample_record(logs.trace_samples(imp.files.get(logs.TRACE, "")), None, 0, None)
    summary = loadgen_summary(
        result, rec, job, eval_id, time.time(), accuracy=None, imported=True
    ).model_copy(update={"host": imp.system})
    stored_job = job.dump()
    stored_job["mlperf_import"] = {
        "source": imp.source,
        "system": imp.system,
        "files": sorted(imp.files),
    }
    spec_doc = {
        "job": stored_job,
        "imported": {
            "source": imp.source,
            "system": imp.system,
            "sut_name": result.sut_name,
            "sha256": identity,  # what the run is (MLPerfImport.identity)
        },
        # what analysis shows as the system of a run
        "agent": {"cpu_model": imp.system or result.sut_name},
    }
    # The evaluation row last: found, it means the run is stored whole.
    await anyio.to_thread.run_sync(store_logs, ev.db, eval_id, dict(imp.files))
    await anyio.to_thread.run_sync(ev.store_evaluation, summary, rec, spec_doc)
    return summary
