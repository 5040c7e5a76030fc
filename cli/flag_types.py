"""The argparse types of ``mlscope-submit``'s and ``mlscope``'s flags.

Each number, list and id flag of either program goes through one of these before
anything connects (:func:`positive_int`, :func:`positive_float`, :func:`wait_seconds`,
:func:`positive_ints`, :func:`identifier`; a framework through :func:`framework_name`,
an agent's device through :func:`device_name`), so a hostile value is a usage error
in argparse's style (exit 2), never a traceback or a value the server would refuse.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable

__all__ = [
    "MAX_COUNT",
    "MAX_WAIT_S",
    "check_frameworks",
    "device_name",
    "framework_name",
    "framework_names",
    "identifier",
    "port",
    "port_or_zero",
    "positive_float",
    "positive_int",
    "positive_ints",
    "wait_seconds",
]


MAX_COUNT = 2**63 - 1
"""The largest whole number a flag takes: what the database and the wire carry (Int64);
the models bound most counts well below it."""
MAX_WAIT_S = 3600.0
"""The longest a command waits for a reply it was told to wait for (``--timeout``)."""


def positive_int(text: str) -> int:
    """An argparse type: a whole number from 1 to :data:`MAX_COUNT` (a count, a limit,
    a batch size)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number above 0")
    if n > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text!r} is too large (at most {MAX_COUNT})")
    return n


def port(text: str) -> int:
    """An argparse type: a TCP port, 1 to 65535."""
    n = _whole_number(text)
    if not 1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1 to 65535)")
    return n


def framework_name(text: str) -> str:
    """An argparse type: one framework name (``mlscope agent --framework``)."""
    problem = check_frameworks([text.strip()])
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text.strip()


def device_name(text: str) -> str:
    """An argparse type: a device a predictor opens models on (``mlscope agent
    --device``): ``cpu``, ``cuda``, ``cuda:1``... (:data:`mlscope.devices.DEVICE_KINDS`)."""
    from mlscope.devices import device_problem

    problem = device_problem(text.strip())
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text.strip()


def framework_names(text: str) -> str:
    """An argparse type: comma-separated framework names (``mlscope up --frameworks``)."""
    names = [f.strip() for f in text.split(",") if f.strip()]
    problem = check_frameworks(names) if names else f"{text!r} names no framework"
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return ",".join(names)


def port_or_zero(text: str) -> int:
    """An argparse type: a TCP port, or 0 for any free one."""
    n = _whole_number(text)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 for any, or 1 to 65535)")
    return n


def _whole_number(text: str) -> int:
    """``text`` as an int; -1 when it is not one (every caller refuses -1)."""
    try:
        return int(text)
    except ValueError:
        return -1


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0 (a rate, a duration, a price)."""
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number above 0")
    return x


def wait_seconds(text: str) -> float:
    """An argparse type: how long to wait, in seconds: above 0 and at most
    :data:`MAX_WAIT_S` (a wait with no end is Ctrl-C's job, not a flag's)."""
    x = positive_float(text)
    if x > MAX_WAIT_S:
        raise argparse.ArgumentTypeError(f"{text!r} is longer than {MAX_WAIT_S:g} s")
    return x


def positive_ints(text: str) -> list[int]:
    """An argparse type: ``1,8,32``, whole numbers from 1 (a sweep's batch sizes)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} names no number (e.g. 1,8,32)")
    return [positive_int(t) for t in items]


def identifier(text: str) -> str:
    """An argparse type: an id as mlscope prints them (``job-1f3a9c2b7d4e``): at most
    :data:`~mlscope.contracts.MAX_ID_CHARS` characters, none of them blank."""
    from mlscope.contracts import MAX_ID_CHARS

    if len(text) > MAX_ID_CHARS:
        raise argparse.ArgumentTypeError(
            f"{text[:20]!r}... is {len(text)} characters long; an id has at most {MAX_ID_CHARS}"
        )
    if not text or any(c.isspace() or not c.isprintable() for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an id (job-..., ev-...)")
    return text


def check_frameworks(names: Iterable[str]) -> str | None:
    """Why these framework names cannot be used (unknown, or one named twice), or None."""
    from mlscope.manifest import FRAMEWORKS

    seen: set[str] = set()
    for name in names:
        if name not in FRAMEWORKS:
            return f"unknown framework {name!r}; known: {', '.join(FRAMEWORKS)}"
        if name in seen:
            return f"framework {name!r} named twice"
        seen.add(name)
    return None
