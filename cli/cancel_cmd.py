"""``mlscope cancel JOB_ID``: stop a job; the server stores its run as ``cancelled``.

The request goes to ``mlscope.job.<job_id>.cancel``, which every server hears: the
one running the job cancels it and answers once the cancelled evaluation is stored;
servers that do not run it remember the id, so a job still queued is not run when
taken. ``mlscope-submit`` sends the same request when interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys

import anyio

from mlscope import bus as busmod
from mlscope import codec, names
from mlscope.contracts import CancelReply, CancelRequest
from mlscope.errors import BusError
from mlscope.settings import Settings

__all__ = ["cancel_job", "register"]


async def cancel_job(
    settings: Settings, job_id: str, *, reason: str = "cancelled by the user", timeout: float
) -> CancelReply | None:
    """Ask the servers to cancel ``job_id``; the reply of the one that ran it, or None
    when none answered within ``timeout`` (not running anywhere, or still stopping)."""
    async with busmod.connect(settings, name="mlscope cancel") as bus:
        try:
            reply = await busmod.request(
                bus,
                names.job_cancel(job_id),
                codec.encode_model(CancelRequest(job_id=job_id, reason=reason)),
                timeout=timeout,
            )
        except BusError:  # no answer: no server runs it now
            return None
    return CancelReply.model_validate(reply)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("cancel", help="stop a running job (stored as cancelled)")
    p.add_argument("job_id", metavar="JOB_ID", help="as mlscope-submit prints it (job-...)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server")
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
