"""``mlscope report``: reports of evaluations, and the paper's Table 2 for the zoo.

* ``mlscope report EVAL_ID... -o report.html`` (``.md``, ``.json``): the format from the
  extension, any other refused; a Markdown report's figures are SVG files in
  ``report_files/`` beside it. ``--json`` prints the JSON form, no ``-o``: Markdown
  without images on stdout;
* ``mlscope report --suite [--run] [--models digits_cnn/onnxruntime,...]``: Table 2 from
  the evaluations in the database; ``--run`` first submits, for each model, one online
  run and batched runs over ``--batch-sizes`` to the running server.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import anyio

from cli.console import Bar, progress
from cli.flag_types import positive_float, positive_ints
from cli.submit_errors import InFlight, StopSignals, flags_contract, interrupted_many
from mlscope.contracts import JobRequest, ScenarioSpec
from mlscope.errors import MLScopeError
from mlscope.settings import Settings

if TYPE_CHECKING:
    from analysis.report_render import Report
    from mlscope.catalog import Catalog

__all__ = ["register", "suite_jobs"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("report", help="report evaluations (HTML/Markdown) or the suite table")
    p.add_argument("evaluations", nargs="*", metavar="EVAL_ID")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        help="report.html, report.md (figures in report_files/) or report.json "
        "(default: Markdown on stdout)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--suite", action="store_true", help="print the paper's Table 2")
    p.add_argument(
        "--run",
        action="store_true",
        help="with --suite: run the evaluations first (needs a running server)",
    )
    p.add_argument(
        "--models",
        default=None,
        help="with --suite: MODEL/FRAMEWORK,... (default: every model built)",
    )
    p.add_argument(
        "--batch-sizes",
        type=positive_ints,
        default="1,2,4,8,16,32",
        help="with --suite --run: batched runs at these batch sizes",
    )
    p.add_argument(
        "--qps", type=positive_float, default=100.0, help="with --suite --run: online rate"
    )
    # The validity rules' minimum run length (mlscope.validity.ValidityPolicy, not imported
    # here: it brings scipy into every --help); a shorter default made every run INVALID,
    # and Table 2 then showed older valid runs in place of the ones just made.
    p.add_argument(
        "--duration",
        type=positive_float,
        default=10.0,
        help="with --suite --run: seconds per run (default 10, the shortest VALID run by default)",
    )
    p.add_argument(
        "--price",
        type=_price,
        action="append",
        default=[],
        metavar="SYSTEM=USD_PER_HOUR",
        help="price per hour of a system, for the cost per million inferences",
    )
    p.set_defaults(func=run)


def _pairs(settings: Settings, catalog: Catalog, spec: str | None) -> list[tuple[str, str]]:
    if spec:
        out = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            model, _, fw = item.partition("/")
            out.append((model, fw or "onnxruntime"))
        return out
    built = []
    for e in catalog.entries:
        m = e.manifest
        try:
            if (e.root(settings.zoo_dir) / m.assets.graph_path).exists():
                built.append((m.name, m.framework.name))
        except MLScopeError:  # remote assets: not part of the local zoo
            continue
    return sorted(set(built))


def suite_jobs(
    pairs: list[tuple[str, str]], *, batch_sizes: list[int], qps: float, duration_s: float
) -> list[JobRequest]:
    """One online run (batch 1) and one batched run per batch size, per model."""
    jobs = []
    with flags_contract():
        for model, fw in pairs:
            jobs.append(
                JobRequest(
                    model=model,
                    framework=fw,
                    scenario=ScenarioSpec(name="online", qps=qps, duration_s=duration_s),
                )
            )
            jobs += [
                JobRequest(
                    model=model,
                    framework=fw,
                    scenario=ScenarioSpec(name="batched", batch_size=b, duration_s=duration_s),
                )
                for b in batch_sizes
            ]
    return jobs


def _run_jobs(settings: Settings, jobs: list[JobRequest], in_flight: InFlight) -> list[str]:
    """Run ``jobs`` one after another (``in_flight`` holds the one running); the ids of
    those that ran."""

    async def go() -> list[str]:
        ids = []
        for job in jobs:
            label = f"{job.model}/{job.framework} {job.scenario.name} b={job.scenario.batch_size}"
            try:
                s = await in_flight.submit(settings, job)
            except MLScopeError as exc:  # one failing model does not stop the suite
                print(f"  {label}: FAILED {exc}", file=sys.stderr, flush=True)
                continue
            print(f"  {label}: {s.evaluation_id}", file=sys.stderr, flush=True)
            ids.append(s.evaluation_id)
        return ids

    return anyio.run(go, backend="asyncio")


def run_suite(args: argparse.Namespace) -> int:
    from analysis import suite
    from analysis.figures import model_sizes
    from analysis.source import open_source
    from analysis.summary import summary
    from mlscope.catalog import Catalog, default_manifest_dirs

    settings: Settings = args.settings
    catalog = Catalog.load(default_manifest_dirs(settings.manifests_dir))
    pairs = _pairs(settings, catalog, args.models)
    if args.run:
        jobs = suite_jobs(
            pairs, batch_sizes=args.batch_sizes, qps=args.qps, duration_s=args.duration
        )
        in_flight = InFlight()
        with StopSignals() as stops:
            try:
                _run_jobs(settings, jobs, in_flight)
            except KeyboardInterrupt:  # the running job is cancelled, the rest never sent
                interrupted_many(settings, in_flight, program="mlscope report")
                return stops.code
    with open_source(settings) as source:
        ids = suite.shown_evaluations(source, pairs)
        summ = summary(source, ids) if ids else None
    if summ is None:
        print(
            "mlscope report --suite: no evaluations of these models yet (add --run to run them)",
            file=sys.stderr,
        )
        return 1
    table = suite.table2(summ, model_sizes(catalog, settings.zoo_dir, pairs))
    print(suite.format_table(table))
    return 0


def _price(text: str) -> tuple[str, float]:
    """An argparse type: ``SYSTEM=USD_PER_HOUR`` (the system as reports name it, which
    may itself hold ``=``), the price a finite number above 0."""
    system, sep, price = text.rpartition("=")
    if not sep or not system.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not SYSTEM=USD_PER_HOUR")
    try:
        return system, positive_float(price)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: the price {exc}") from None


REPORT_FORMATS = {".html": "html", ".htm": "html", ".md": "markdown", ".json": "json"}
"""Report formats by the extension of ``-o``."""


def _format(args: argparse.Namespace) -> str | None:
    """The format asked for, or None after saying why it cannot be (one line)."""
    out: Path | None = args.output
    if out is None:
        return "json" if args.json else "markdown"
    fmt = REPORT_FORMATS.get(out.suffix.lower())
    if fmt is None:
        known = ", ".join(sorted(set(REPORT_FORMATS) - {".htm"}))
        print(
            f"mlscope report: cannot write {out.suffix or 'a file without extension'} "
            f"({out}); -o takes {known}",
            file=sys.stderr,
        )
        return None
    if args.json and fmt != "json":
        print(f"mlscope report: --json with -o {out}: use -o FILE.json", file=sys.stderr)
        return None
    return fmt


def _build(args: argparse.Namespace, bar: Bar) -> Report:
    """The report of ``args.evaluations``; the catalog (for the models' sizes) is read on
    a thread of its own meanwhile, as the reads mostly wait on the server."""
    from analysis import report
    from analysis.source import open_source

    settings: Settings = args.settings
    n = len(args.evaluations)
    bar.update(f"reading {n} evaluation{'s' if n != 1 else ''}", advance=1)
    with (
        ThreadPoolExecutor(1, thread_name_prefix="catalog") as pool,
        open_source(settings) as source,  # one connection for every read
    ):
        sizes = pool.submit(_model_sizes, settings)
        return report.build(
            source, args.evaluations, sizes=sizes.result, prices_per_hour=dict(args.price)
        )


def _model_sizes(settings: Settings) -> dict[str, int]:
    # imported here, on the catalog's thread: the manifests' models load while the
    # report's reads wait on the server
    from analysis.figures import model_sizes
    from mlscope.catalog import Catalog, default_manifest_dirs

    return model_sizes(
        Catalog.load(default_manifest_dirs(settings.manifests_dir)), settings.zoo_dir
    )


SUITE_ONLY = (("run", "--run"), ("models", "--models"))
"""Flags that only ``--suite`` reads (attribute, flag)."""


def _misused(args: argparse.Namespace) -> str | None:
    """Why the flags given cannot go together (a usage error), or None: ``--suite``
    prints its table on stdout only, so ``-o``, ``--json``, ``--price`` and EVAL_IDs
    would be ignored; the suite's own flags mean nothing without it."""
    if args.suite:
        given = [
            flag
            for flag, on in (
                ("EVAL_ID", bool(args.evaluations)),
                ("-o", args.output is not None),
                ("--json", args.json),
                ("--price", bool(args.price)),
            )
            if on
        ]
        if given:
            return f"--suite prints its table on stdout; it takes no {', '.join(given)}"
        return None
    given = [flag for attr, flag in SUITE_ONLY if getattr(args, attr, None) not in (None, False)]
    if given:
        return f"{', '.join(given)}: only with --suite"
    return None


def run(args: argparse.Namespace) -> int:
    problem = _misused(args)
    if problem is not None:
        print(f"mlscope report: {problem}", file=sys.stderr)
        return 2
    if args.suite:
        return run_suite(args)
    if not args.evaluations:
        print("mlscope report: give EVAL_ID... or --suite", file=sys.stderr)
        return 2
    fmt = _format(args)
    if fmt is None:
        return 2
    if args.output is not None:
        from cli.trace_cmd import writable

        writable(args.output)  # before the report is built
    from analysis import report_render as render

    out: Path | None = args.output
    with progress("connecting", total=3) as bar:
        rep = _build(args, bar)
        bar.update(f"rendering {fmt}", advance=1)
        if fmt == "html":
            text = render.to_html(rep)
        elif fmt == "json":
            text = json.dumps(render.to_json(rep), indent=1)
        else:
            text = render.to_markdown(rep, render.figure_dir_for(out) if out is not None else None)
        bar.update(advance=1)
    for warning in rep.warnings:  # after the progress bar, before the report
        print(f"mlscope report: warning: {warning}", file=sys.stderr)
    if out is None:
        print(text)
    else:
        out.write_text(text)
        print(f"wrote {out}", file=sys.stderr)
    return 0
