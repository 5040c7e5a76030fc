"""Child processes that end with the process that started them.

A parent killed outright (SIGKILL, the OOM killer) runs none of its cleanup, so its
children would run on as orphans: ``mlscope up``'s nats-server, server and agents
holding the port and the database directory the next ``mlscope up`` needs, or a
LoadGen test still sending queries to an agent for a job that another server runs
again. On Linux each child asks the kernel for :data:`PARENT_DEATH_SIGNAL` when its
parent ends (``prctl(PR_SET_PDEATHSIG)``): SIGTERM, so a service among them shuts down
as on ``kill``. Elsewhere nothing is asked, and the parent's own stop still ends them.

The kernel sends the signal when the *thread* that started the child ends, not only
its process, so a child started from another thread than the main one (a test that
restarts nats-server from a worker thread) is not tied to it: that thread may end long
before the child should. A child that ties itself (:func:`end_with_parent`) is started
from an event loop's thread, which outlives the coroutine that waits for it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

__all__ = ["PARENT_DEATH_SIGNAL", "end_with_parent", "ends_with_this_process"]

PARENT_DEATH_SIGNAL = signal.SIGTERM
"""What a child receives when its parent ends."""

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl() -> Callable[..., int] | None:
    """libc's prctl on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    return prctl


def _ask(prctl: Callable[..., int] | None, parent: int) -> None:
    """In the child: the signal on the parent's end; at once when ``parent`` is gone
    already (the child was then handed to init or a subreaper)."""
    if prctl is None or prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) != 0:
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), PARENT_DEATH_SIGNAL)


def end_with_parent(parent: int) -> None:
    """Make this process end with ``parent``, the pid of the process that started it
    (call it first thing in a child that the parent started without
    :func:`ends_with_this_process`, e.g. through ``anyio.open_process``)."""
    _ask(_prctl(), parent)


def ends_with_this_process() -> Callable[[], None] | None:
    """A ``preexec_fn`` for :class:`subprocess.Popen` that makes the child end with this
    process: None where the platform cannot, or away from the main thread (whose end is
    the process's). libc is looked up here, in the parent: between fork and exec the
    child only calls it."""
    prctl, parent = _prctl(), os.getpid()
    if prctl is None or threading.current_thread() is not threading.main_thread():
        return None

    def preexec() -> None:
        _ask(prctl, parent)

    return preexec
