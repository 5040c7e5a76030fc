"""``mlscope mlperf`` (LoadGen against an agent) and ``mlscope import mlperf DIR``.

Both are jobs for the server: ``mlscope mlperf`` submits a job whose load generator is
MLPerf LoadGen (run by the server, see broker/mlperf.py), waits for its summary and
then writes LoadGen's log files, read back from the evaluation database, into
``--output``. ``mlscope import mlperf`` reads result directories (any directory
holding an ``mlperf_log_summary.txt``) and submits one import job per directory; the
server stores each run once (a run is its summary and detail logs:
``MLPerfImport.identity``), so importing a tree again stores only the runs it did not
have and answers the others with what it stored before ("already imported"). The
logs ``mlscope mlperf --output`` wrote are its run, already stored on that server
("already stored"), not a second evaluation of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import anyio

from broker import mlperf_logs as logs
from cli.flag_types import framework_name, identifier, positive_float, positive_int
from cli.submit_errors import StopSignals, flags_contract, interrupted
from cli.summary_text import format_summary
from mlscope import bus as busmod
from mlscope import remote
from mlscope.bounded import MAX_DOCUMENT_BYTES
from mlscope.contracts import EvaluationSummary, JobRequest, MLPerfImport, MLPerfSpec
from mlscope.errors import ConfigError
from mlscope.jobs import submit
from mlscope.regular_files import read_text
from mlscope.settings import Settings

__all__ = [
    "already_imported",
    "fetch_logs",
    "find_results",
    "import_doc",
    "import_job",
    "register",
]

SCENARIOS = ("SingleStream", "MultiStream", "Server", "Offline")
MODES = ("PerformanceOnly", "AccuracyOnly")
RUN_TIMEOUT_S = 6 * 3600.0
"""An official run lasts at least 10 minutes per scenario; the server bounds it."""
IMPORT_MAX_BYTES = 900_000
"""What one import job may carry (under the bus's 1 MiB job limit)."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "mlperf",
        help="run MLPerf LoadGen with an agent as the system "
        "under test; write LoadGen's logs to --output",
    )
    p.add_argument("model", metavar="MODEL[@VERSION]")
    p.add_argument("--framework", type=framework_name, required=True)
    p.add_argument("--framework-version", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--agent", dest="agent_id", type=identifier, default=None)
    p.add_argument("--scenario", required=True, choices=SCENARIOS)
    p.add_argument("--mode", default="PerformanceOnly", choices=MODES)
    p.add_argument(
        "--target-qps",
        type=positive_float,
        default=None,
        help="Server: target QPS; Offline: expected QPS",
    )
    p.add_argument("--user-conf", type=Path, default=None, help="an MLPerf user.conf")
    p.add_argument(
        "--mlperf-conf",
        type=Path,
        default=None,
        help="an mlperf.conf (default: the one LoadGen ships)",
    )
    p.add_argument(
        "--conf-model", default=None, help="the model name the conf files use (default: MODEL)"
    )
    p.add_argument(
        "--batch-size", type=positive_int, default=32, help="most samples per agent query (Offline)"
    )
    p.add_argument("--window", type=positive_int, default=8, help="agent queries in flight")
    p.add_argument("--seed", type=int, default=None, help="LoadGen's three RNG seeds")
    p.add_argument(
        "--placement",
        choices=("server", "agent"),
        default="server",
        help="where LoadGen runs: on the server's host, its system under test sending "
        "queries over the bus (default), or on the agent's host next to the model",
    )
    p.add_argument("--output", type=Path, required=True, help="where LoadGen's logs go")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_run)
    imp = sub.add_parser("import", help="load results made elsewhere into the database")
    kinds = imp.add_subparsers(dest="format", required=True, metavar="FORMAT")
    m = kinds.add_parser(
        "mlperf",
        help="MLPerf LoadGen result directories (a run stored before, found by its "
        "summary and detail logs, is not stored again: it is listed as already imported)",
    )
    m.add_argument("directory", type=Path)
    m.add_argument("--model", default=None, help="default: from the results tree")
    m.add_argument("--framework", default="mlperf", help="recorded framework name")
    m.add_argument("--system", default=None, help="default: from the results tree")
    m.add_argument(
        "--json",
        action="store_true",
        help="a JSON list, one per directory: its stored summary with "
        '"import": {"source", "already_imported"}',
    )
    m.set_defaults(func=_import)


def mlperf_job(args: argparse.Namespace) -> JobRequest:
    name, _, version = args.model.partition("@")
    user_conf, mlperf_conf = _read(args.user_conf), _read(args.mlperf_conf)
    with flags_contract():
        spec = MLPerfSpec(
            scenario=args.scenario,
            mode=args.mode,
            target_qps=args.target_qps,
            user_conf=user_conf,
            mlperf_conf=mlperf_conf,
            conf_model=args.conf_model,
            batch_size=args.batch_size,
            window=args.window,
            seed=args.seed,
        )
        return JobRequest(
            model=name,
            model_version=version or None,
            framework=args.framework,
            framework_version=args.framework_version,
            device=args.device,
            agent_id=args.agent_id,
            trace_level="none",
            mlperf=spec,
            placement=args.placement,
        )


def _read(path: Path | None) -> str | None:
    """A conf file's text: a FIFO or device is refused rather than waited on or read
    without end, and a conf file is a document as small as a manifest."""
    if path is None:
        return None
    try:
        return read_text(path, MAX_DOCUMENT_BYTES)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}", field=str(path)) from exc


async def fetch_logs(bus: busmod.Bus, evaluation_id: str) -> dict[str, str]:
    """The log files stored with an evaluation, part by part (each fits one message)."""
    _, rows = await remote.sql(
        bus,
        "SELECT name, max(part) FROM mlperf_logs FINAL "
        "WHERE evaluation_id = {id:String} GROUP BY name",
        {"id": evaluation_id},
    )
    files: dict[str, str] = {}
    for name, last in rows:
        parts = []
        for k in range(int(last) + 1):
            _, got = await remote.sql(
                bus,
                "SELECT text FROM mlperf_logs FINAL WHERE evaluation_id = {id:String} "
                "AND name = {name:String} AND part = {part:UInt32}",
                {"id": evaluation_id, "name": name, "part": k},
            )
            parts.append(str(got[0][0]) if got else "")
        files[str(name)] = "".join(parts)
    return files


async def run_mlperf(
    settings: Settings, job: JobRequest
) -> tuple[EvaluationSummary, dict[str, str]]:
    """Submit, wait, and read back LoadGen's logs (and the accuracy output)."""
    summary = await submit(settings, job, timeout=RUN_TIMEOUT_S)
    async with busmod.connect(settings, name="mlscope mlperf") as bus:
        return summary, await fetch_logs(bus, summary.evaluation_id)


def write_logs(files: dict[str, str], output: Path) -> list[Path]:
    output.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in sorted(files.items()):
        path = output / Path(name).name  # names are LoadGen's own; never a path
        path.write_text(text)
        written.append(path)
    return written


def _run(args: argparse.Namespace) -> int:
    job = mlperf_job(args)
    with StopSignals() as stops:
        try:
            summary, files = anyio.run(run_mlperf, args.settings, job, backend="asyncio")
        except KeyboardInterrupt:  # the test would go on holding the agent: cancel it
            interrupted(args.settings, job.job_id, program="mlscope mlperf")
            return stops.code
    written = write_logs(files, args.output)
    if args.json:
        print(json.dumps(summary.model_dump(mode="json", by_alias=True)))
        return 0
    print(format_summary(summary))
    lg = summary.mlperf or {}
    print(
        f"  {'LoadGen':<13} {lg.get('scenario')} {lg.get('mode')}: "
        f"{lg.get('validity') or 'no verdict (accuracy run)'}"
    )
    for path in written:
        print(f"  {'wrote':<13} {path}")
    return 0


# --------------------------------------------------------------------------- import


def find_results(root: Path) -> list[Path]:
    """Every directory under ``root`` (or ``root`` itself) with a LoadGen summary log."""
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory", field="directory")
    found = sorted({p.parent for p in root.rglob(logs.SUMMARY) if p.is_file()})
    if not found:
        raise ConfigError(f"no {logs.SUMMARY} under {root}", field="directory")
    return found


def _tree_names(run_dir: Path) -> tuple[str | None, str | None]:
    """(model, system) from an MLPerf results tree:
    ``<system>/<model>/<Scenario>/performance/run_1``."""
    parts = run_dir.resolve().parts
    for i in range(len(parts) - 1, 1, -1):
        if parts[i] in SCENARIOS:
            return parts[i - 1], parts[i - 2]
    return None, None


def import_job(
    run_dir: Path, *, model: str | None, framework: str, system: str | None
) -> JobRequest:
    """The import job for one result directory (the trace is left out if too large)."""
    sizes = {n: (run_dir / n).stat().st_size for n in logs.LOG_FILES if (run_dir / n).is_file()}
    if logs.DETAIL not in sizes:
        raise ConfigError(f"{run_dir} has a summary but no {logs.DETAIL}", field="directory")
    for optional in (logs.TRACE, logs.ACCURACY):  # sized before they are read
        if optional in sizes and sum(sizes.values()) > IMPORT_MAX_BYTES:
            del sizes[optional]
    if sum(sizes.values()) > IMPORT_MAX_BYTES:
        raise ConfigError(
            f"{run_dir}: the summary and detail logs exceed {IMPORT_MAX_BYTES} bytes",
            field="directory",
        )
    files = {name: (run_dir / name).read_text(errors="replace") for name in sizes}
    if sum(len(t) for t in files.values()) > IMPORT_MAX_BYTES:
        files.pop(logs.TRACE, None)  # per-sample records are optional; LoadGen's numbers not
        if logs.ACCURACY in files and sum(len(t) for t in files.values()) > IMPORT_MAX_BYTES:
            files.pop(logs.ACCURACY)
    if sum(len(t) for t in files.values()) > IMPORT_MAX_BYTES:
        raise ConfigError(
            f"{run_dir}: the summary and detail logs exceed {IMPORT_MAX_BYTES} bytes",
            field="directory",
        )
    tree_model, tree_system = _tree_names(run_dir)
    named = model or tree_model
    if named is None:  # a directory's own name is no model's
        raise ConfigError(
            f"{run_dir} is not in an MLPerf results tree (<system>/<model>/<Scenario>/...): "
            "name its model with --model",
            field="model",
        )
    with flags_contract():
        return JobRequest(
            model=named,
            framework=framework,
            trace_level="none",
            mlperf_import=MLPerfImport(
                files=files, source=str(run_dir.resolve()), system=system or tree_system or ""
            ),
        )


async def import_dirs(settings: Settings, jobs: list[JobRequest]) -> list[EvaluationSummary]:
    return [await submit(settings, job, timeout=120.0) for job in jobs]


def already_imported(job: JobRequest, summary: EvaluationSummary) -> bool:
    """Whether the server answered ``job`` with a run stored before, by another job
    (an import of the same logs: the server finds it, ``broker.mlperf.import_logs``)."""
    return summary.job_id != job.job_id


def import_doc(job: JobRequest, summary: EvaluationSummary) -> dict[str, Any]:
    """What ``--json`` prints for one directory: the stored summary as every command
    prints one, and ``import``: the directory read and whether its run was stored
    before (then the summary is the one stored then: same id, same figures, the
    labels of that import)."""
    return {
        **summary.model_dump(mode="json", by_alias=True),
        "import": {
            "source": job.mlperf_import.source if job.mlperf_import else "",
            "already_imported": already_imported(job, summary),
        },
    }


def _relabelled(job: JobRequest, s: EvaluationSummary) -> str:
    """The labels a re-import asked for and the stored run does not have ("" if none):
    the stored run keeps its first import's."""
    system = job.mlperf_import.system if job.mlperf_import else ""
    asked = (
        ("model", job.model, s.model.get("name")),
        ("framework", job.framework, s.framework.get("name")),
        ("system", system, s.host),
    )
    return ", ".join(f"{what} {got!r}" for what, want, got in asked if want != got)


def _import(args: argparse.Namespace) -> int:
    jobs = [
        import_job(d, model=args.model, framework=args.framework, system=args.system)
        for d in find_results(args.directory)
    ]
    summaries = anyio.run(import_dirs, args.settings, jobs, backend="asyncio")
    if args.json:
        print(json.dumps([import_doc(j, s) for j, s in zip(jobs, summaries, strict=True)]))
        return 0
    before = 0
    for job, s in zip(jobs, summaries, strict=True):
        src = job.mlperf_import.source if job.mlperf_import else ""
        lg: dict[str, Any] = s.mlperf or {}
        note = ""
        if already_imported(job, s) and not lg.get("imported"):  # its logs, written out
            before += 1
            note = f"  already stored: the mlscope mlperf run of job {s.job_id}"
        elif already_imported(job, s):
            before += 1
            kept = _relabelled(job, s)
            note = f"  already imported{f' (as {kept})' if kept else ''}"
        print(
            f"{s.evaluation_id}  {s.model['name']}  {lg.get('scenario')} {lg.get('mode')} "
            f"{lg.get('validity') or '-'}  p99 {s.latency_ms.p99} ms  <- {src}{note}",
            file=sys.stdout,
        )
    print(f"{len(jobs) - before} imported, {before} already imported", file=sys.stdout)
    return 0
