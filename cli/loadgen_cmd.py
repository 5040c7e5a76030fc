"""``mlscope loadgen``: a load-generator service that servers deal schedules to."""

from __future__ import annotations

import argparse
from typing import Any

from cli.services import LOG_LEVELS, _serve
from mlscope.serving import configure_logging

__all__ = ["register"]


def register(sub: Any) -> None:
    lg = sub.add_parser(
        "loadgen",
        help="run a load-generator service against MLSCOPE_NATS_URL (any host); "
        "jobs name it with mlscope-submit --loadgen-hosts",
    )
    lg.add_argument(
        "--id",
        dest="loadgen_id",
        default=None,
        help="its id (default: that of its own credentials, else HOST-PID)",
    )
    lg.add_argument(
        "--log-level", default="info", choices=LOG_LEVELS, help="stderr log level (default info)"
    )
    lg.set_defaults(func=run_loadgen)


def run_loadgen(args: argparse.Namespace) -> int:
    from broker.lgservice import LoadgenService, default_id

    configure_logging(args.log_level)
    service = LoadgenService(
        args.settings,
        loadgen_id=args.loadgen_id if args.loadgen_id is not None else default_id(args.settings),
    )
    return _serve(service.run)
