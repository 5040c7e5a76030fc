"""``mlscope runs`` (alias ``ls``): past evaluations, newest first, filtered.

``--since`` takes a duration back from now (``90s``, ``30m``, ``2h``, ``3d``, ``1w``) or
an ISO date or date-time (UTC unless it names its zone). ``--valid`` lists VALID
completed runs only; ``--invalid`` the others (INVALID, failed or cancelled ones).
``--framework`` and ``--scenario`` take a name mlscope knows, or one a stored run has
(an MLPerf run's scenario, an import's framework); any other is refused as misspelt.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from cli.console import help_text, print_table
from cli.flag_types import positive_int
from cli.submit_errors import FlagError
from mlscope import scenario_traits
from mlscope.settings import Settings

if TYPE_CHECKING:  # analysis loads pandas: only when the command runs
    from analysis.source import Source

__all__ = ["check_names", "parse_since", "register"]

_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
COLUMNS = (
    ("evaluation_id", "evaluation"),
    ("created_at", "created (UTC)"),
    ("model", "model"),
    ("framework", "framework"),
    ("scenario", "scenario"),
    ("batch_size", "batch"),
    ("status", "status"),
    ("valid", "verdict"),
    ("queries", "queries"),
    ("throughput_ips", "inputs/s"),
)


def parse_since(text: str, *, now: datetime | None = None) -> datetime:
    """``2h`` / ``3d`` back from ``now``, or an ISO date (time); a ValueError that names
    the forms accepted otherwise."""
    now = now or datetime.now(UTC)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if m:
        try:
            return now - timedelta(**{_UNITS[m.group(2)]: float(m.group(1))})
        except OverflowError:  # before year 1, or more days than a timedelta holds
            raise ValueError(f"--since {text!r}: further back than the calendar goes") from None
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(
            f"--since {text!r}: give a duration (90s, 30m, 2h, 3d, 1w) or an ISO date "
            "(2026-11-24 or 2026-11-24T08:00)"
        ) from None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def _since(text: str) -> datetime:
    try:
        return parse_since(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--since {text!r}: ")) from None


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "runs",
        aliases=["ls"],
        help="past evaluations, newest first (filters, --json)",
        description=help_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None, help="only this model (any version)")
    p.add_argument("--framework", default=None, help="only this framework")
    p.add_argument("--scenario", default=None, help="only this scenario (online, batched, ...)")
    verdict = p.add_mutually_exclusive_group()
    verdict.add_argument(
        "--valid", dest="valid", action="store_const", const=True, help="VALID completed runs"
    )
    verdict.add_argument(
        "--invalid",
        dest="valid",
        action="store_const",
        const=False,
        help="INVALID, failed or cancelled runs",
    )
    p.add_argument("--since", type=_since, default=None, metavar="WHEN", help="2h, 3d, ISO date")
    p.add_argument("--limit", type=positive_int, default=20, help="at most N, newest (default 20)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=run, valid=None)


def run(args: argparse.Namespace) -> int:
    from analysis.data import RunFilter, find_evaluations
    from analysis.source import open_source

    settings: Settings = args.settings
    source = open_source(settings)
    check_names(source, framework=args.framework, scenario=args.scenario)
    frame = find_evaluations(
        source,
        RunFilter(
            model=args.model,
            framework=args.framework,
            scenario=args.scenario,
            valid=args.valid,
            since=args.since,
            limit=args.limit,
        ),
    )
    rows = [_row(r) for r in frame.to_dict("records")]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    if not rows:
        print("no evaluations match", file=sys.stderr)
        return 0
    cells = [[_cell(k, r) for k, _ in COLUMNS] for r in rows]
    print_table(
        [h for _, h in COLUMNS], cells, plain=_table(rows), right=("batch", "queries", "inputs/s")
    )
    return 0


def check_names(source: Source, *, framework: str | None, scenario: str | None) -> None:
    """Refuse a misspelt ``--framework`` or ``--scenario`` (a :class:`FlagError`, exit 2,
    naming the known ones) rather than list nothing. A name is known when it is one of
    :data:`mlscope.manifest.FRAMEWORKS` or a registered scenario, or when a stored run
    has it: an MLPerf run's scenario (``mlperf-offline``) or an import's recorded
    framework."""
    from analysis.data import RunFilter, find_evaluations
    from mlscope.manifest import FRAMEWORKS

    for what, value, known, stored in (
        ("framework", framework, FRAMEWORKS, RunFilter(framework=framework, limit=1)),
        ("scenario", scenario, scenario_traits.names(), RunFilter(scenario=scenario, limit=1)),
    ):
        if value is None or value in known or len(find_evaluations(source, stored)):
            continue
        raise FlagError(
            f"argument --{what}: unknown {what} {value!r} (no run has it); "
            f"known: {', '.join(known)}"
        )


def _row(r: dict[str, Any]) -> dict[str, Any]:
    from analysis.records import json_value

    out = {
        k: r[k]
        for k in (
            "evaluation_id",
            "created_at",
            "model",
            "model_version",
            "framework",
            "framework_version",
            "agent_id",
            "scenario",
            "batch_size",
            "requested_qps",
            "status",
            "valid",
            "invalid_reasons",
            "queries",
            "errors",
            "duration_s",
            "throughput_ips",
            "rerun_of",
            "role",
        )
    }
    return {k: json_value(v) for k, v in out.items()}


def _cell(key: str, row: dict[str, Any]) -> str:
    v = row[key]
    if key == "valid":
        return "VALID" if v and row["status"] == "completed" else "INVALID"
    if key == "created_at":
        return str(v)[:19].replace("T", " ")
    if key == "throughput_ips":
        return "-" if v is None else f"{v:.1f}"
    return "-" if v is None else str(v)


def _table(rows: list[dict[str, Any]]) -> str:
    cells = [[_cell(k, r) for k, _ in COLUMNS] for r in rows]
    heads = [h for _, h in COLUMNS]
    widths = [max(len(x) for x in col) for col in zip(heads, *cells, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)
