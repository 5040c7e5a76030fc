"""``mlscope cancel JOB_ID``: stop a job; the server stores its run as ``cancelled``.

The request goes to ``mlscope.job.<job_id>.cancel``, which every server hears: the
one running the job cancels it and answers once the cancelled evaluation is stored;
servers that do not run it remember the id, so a job still queued is not run when
taken. ``mlscope-submit``, ``mlscope rerun``, ``mlscope report --suite --run`` and
``mlscope mlperf`` send the same request when interrupted (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import sys

import anyio

from cli.flag_types import identifier, wait_seconds
from mlscope.api import cancel_job

__all__ = ["register"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("cancel", help="stop a running job (stored as cancelled)")
    p.add_argument(
        "job_id", type=identifier, metavar="JOB_ID", help="as mlscope-submit prints it (job-...)"
    )
    p.add_argument(
        "--timeout", type=wait_seconds, default=10.0, help="seconds to wait for the server"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    reply = anyio.run(
        lambda: cancel_job(args.settings, args.job_id, timeout=args.timeout), backend="asyncio"
    )
    if reply is None:
        print(
            f"mlscope cancel: no server is running job {args.job_id} now; "
            "servers will not run it if it is still queued",
            file=sys.stderr,
        )
        return 1
    print(
        f"cancelled job {reply.job_id}: evaluation {reply.evaluation_id} stored as cancelled "
        f"(server {reply.server_id})"
    )
    return 0
