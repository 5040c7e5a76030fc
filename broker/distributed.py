"""Distributed load: one seeded global schedule dealt to K load-generator processes.

How they connect: the server (parent) builds the global schedule and every query's
payload, deals the schedule round-robin (:func:`mlscope.schedule.deal`: query ``i`` goes
to process ``i % K``) and starts K processes ``python -m broker.distributed CONFIG``.
Each child connects to NATS on its own (same URL and credentials as the server),
reads its slice (offsets, global indices, payloads) from files the parent wrote in a
private temporary directory, prints ``ready`` on stdout and waits for the start time
on stdin. The parent then sends every child the same start time, a
``perf_counter_ns`` (CLOCK_MONOTONIC) value 200 ms ahead: CLOCK_MONOTONIC is one
clock for every process of a host, so the K pacers share one time origin (the K
processes must therefore run on the server's host). Each child runs its own pacer
thread and :class:`broker.loadgen.Driver`, publishes straight to the agent with its own
reply inbox, and writes its raw per-query arrays (``.npz``) when done. The parent
merges them by global index into one :class:`RunRecord`, judged once (the result
files and their merge: :mod:`broker.lgresults`). While they run, each child prints ``progress DONE``
lines (queries completed in its slice); the parent sums them into the evaluation's
progress events (without a running p50: the latencies stay in the children until the
end). A child that is not ready within the server's ``loadgen_ready_s``, or that fails while
the others run, ends the run at once, named by its slice. A cancelled job's parent
writes ``stop`` to every child: each stops its load, writes the arrays of what it had
issued and answered, and ends; the merged record, up to where the first child stopped,
is what the cancelled run stores, as a run on one load generator does.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import anyio
import numpy as np
from anyio.lowlevel import current_token

from broker.context import Context
from broker.lgresults import load_result, merge_results, save_result, until_first_stop
from broker.loadgen import Driver, encode_query
from mlscope import bus as busmod
from mlscope import codec, scenario_traits, schedule, scratch
from mlscope.contracts import ScenarioSpec, TraceLevel
from mlscope.errors import EvaluationError
from mlscope.record import RunRecord
from mlscope.schedule import Schedule
from mlscope.settings import Settings
from mlscope.tuning import ProcessTuning

__all__ = ["main", "run_dealt"]

START_LEAD_S = 0.2
PROGRESS_S = 0.5
STOP_WAIT_S = 5.0
"""How long stopped processes have to write what they had sent and end."""


async def run_dealt(
    ctx: Context,
    spec: ScenarioSpec,
    sched: Schedule,
    inputs: Callable[[int], np.ndarray],
    labels: Callable[[int], np.ndarray] | None,
) -> RunRecord:
    """Run ``sched`` on ``spec.loadgens`` processes; the merged record of all of them."""
    parts = schedule.deal(sched, spec.loadgens)
    payloads = [
        encode_query(ctx.query_id, g, inputs(g), ctx.trace_level) for g in range(len(sched))
    ]
    cfg = {
        "evaluation_id": ctx.evaluation_id,
        "subject": ctx.subject,
        "spec": spec.model_dump(mode="json"),
        "offset_ns": ctx.offset_ns,
        "trace_level": int(ctx.trace_level),
        "nats_url": ctx.nats_url,
        "has_labels": labels is not None,
    }
    timeout = spec.duration_s * 3 + 120
    on_progress = ctx.on_progress

    stop = threading.Event()
    kept: list[RunRecord] = []  # a stopped run's merged record
    finished = threading.Event()

    def report(done: int, elapsed_s: float) -> None:  # from the waiting thread
        if on_progress is None or stop.is_set():
            return
        rec = RunRecord(n=0, batch_size=spec.batch_size)  # a count: the rows are theirs
        rec.done = done

        async def emit() -> None:
            await on_progress(rec, elapsed_s)

        anyio.from_thread.run(emit)

    def work() -> RunRecord:
        try:
            return _run_processes(
                cfg, parts, payloads, labels, timeout, report, stop, kept, ctx.loadgen_ready_s
            )
        finally:
            finished.set()

    t0 = time.monotonic()
    try:
        # Abandoned when cancelled: the thread then sees ``stop``, stops the processes
        # within a progress interval and returns, instead of the job waiting them out.
        return await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
    except anyio.get_cancelled_exc_class():
        stop.set()
        with anyio.CancelScope(shield=True):
            # what the processes had issued and answered, as the cancelled run's record
            await anyio.to_thread.run_sync(finished.wait, PROGRESS_S + STOP_WAIT_S + 5)
            if kept and on_progress is not None:
                kept[0].warmup = min(spec.warmup_queries, kept[0].n)
                await on_progress(kept[0], time.monotonic() - t0)
        raise


def _run_processes(
    cfg: dict[str, Any],
    parts: list[Schedule],
    payloads: list[bytes],
    labels: Callable[[int], np.ndarray] | None,
    timeout: float,
    report: Callable[[int, float], None],
    stop: threading.Event,
    kept: list[RunRecord],
    ready_s: float,
) -> RunRecord:
    """Write each slice, start one process per slice, start them together, merge.
    ``stop`` (the job was cancelled) stops them: their merged record of what they had
    sent goes into ``kept`` (when every one wrote it), and the run ends without a
    result."""
    with scratch.scratch_dir("loadgen") as tmp:
        children: list[_Child] = []
        try:
            for j, part in enumerate(parts):
                base = Path(tmp) / f"lg{j}"
                np.savez(f"{base}-schedule.npz", offsets=part.offsets_ns, index=part.index)
                Path(f"{base}-payloads.bin").write_bytes(
                    codec.encode([payloads[int(g)] for g in part.index])
                )
                if labels is not None:
                    np.save(f"{base}-labels.npy", np.stack([labels(int(g)) for g in part.index]))
                Path(f"{base}.json").write_text(json.dumps({**cfg, "base": str(base)}))
                proc = subprocess.Popen(
                    [sys.executable, "-m", "broker.distributed", f"{base}.json"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env=_child_env(),
                    text=True,
                )
                children.append(_Child(j, proc))
            started = _start(children, stop, ready_s)
            codes = _wait(children, timeout, report, stop) if started else []
        finally:
            for c in children:
                if c.proc.poll() is None:
                    c.proc.kill()
                    c.proc.wait()
        if stop.is_set():
            written = all((Path(tmp) / f"lg{j}-result.npz").is_file() for j in range(len(parts)))
            if written and not any(codes):  # a slice stopped before its start has none
                kept.append(until_first_stop(_merged(Path(tmp), parts), parts))
            raise EvaluationError("the run was stopped: its job was cancelled")
        if any(codes):
            raise EvaluationError(f"a load-generator process failed (exit codes {codes})")
        return _merged(Path(tmp), parts)


def _merged(tmp: Path, parts: list[Schedule]) -> RunRecord:
    return merge_results(
        parts, [load_result(tmp / f"lg{j}-result.npz", len(part)) for j, part in enumerate(parts)]
    )


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


class _Child:
    """One load-generator process and what it said on stdout, read by a thread of its
    own from the moment it starts: ``ready`` (then its start time is due) and
    ``progress DONE`` lines (queries completed in its slice)."""

    def __init__(self, j: int, proc: subprocess.Popen[str]) -> None:
        self.j, self.proc = j, proc
        self.first = ""
        """Its first line (``ready``, or what it said instead)."""
        self.done = 0
        self.heard = threading.Event()
        """Set by its first line, or by the end of its output (it exited)."""
        self._reader = threading.Thread(target=self._read, name=f"lg{j}-out", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for line in _pipe(self.proc, self.proc.stdout):
                word, _, value = line.strip().partition(" ")
                if not self.heard.is_set():
                    self.first = line.strip()[:200]
                    self.heard.set()
                elif word == "progress" and value.isdigit():
                    self.done = int(value)
        finally:
            self.heard.set()

    def join(self) -> None:
        self._reader.join(5)


def _start(children: list[_Child], stop: threading.Event, ready_s: float) -> bool:
    """Wait for every child's ``ready`` (at most ``ready_s`` in all), then
    give all of them one start time; False (nothing started) when ``stop`` came first.
    A child that ends or says anything else first, or is not ready in time, is an
    EvaluationError naming it: the run cannot start without its slice."""
    deadline = time.monotonic() + ready_s
    for c in children:
        while not c.heard.wait(min(PROGRESS_S, max(0.0, deadline - time.monotonic()))):
            if stop.is_set():
                return False
            if time.monotonic() >= deadline:
                raise EvaluationError(
                    f"load-generator process {c.proc.pid} (slice {c.j}) was not ready "
                    f"after {ready_s:g} s (MLSCOPE_LOADGEN_READY_S)",
                    slice=c.j,
                )
        if c.first != "ready":
            raise EvaluationError(
                f"load-generator process {c.proc.pid} (slice {c.j}) did not start "
                f"({c.first!r}, exit code {c.proc.poll()})",
                slice=c.j,
            )
    if stop.is_set():
        return False
    start = time.perf_counter_ns() + int(START_LEAD_S * 1e9)
    for c in children:
        stdin = _pipe(c.proc, c.proc.stdin)
        stdin.write(f"{start}\n")
        stdin.flush()
    return True


def _pipe(p: subprocess.Popen[str], stream: IO[str] | None) -> IO[str]:
    """One of a child's pipes (each is opened with ``PIPE``)."""
    if stream is None:
        raise EvaluationError(f"load-generator process {p.pid} has no pipe to talk over")
    return stream


def _wait(
    children: list[_Child],
    timeout: float,
    report: Callable[[int, float], None],
    stop: threading.Event,
) -> list[int]:
    """Exit codes of every child; their ``progress`` lines summed into ``report`` about
    every half second while they run. ``stop`` set: each child is told to stop and has
    :data:`STOP_WAIT_S` to end (the caller kills those that did not; their code is -1).
    A child that fails while the others run ends the run at once (an EvaluationError
    naming it): the merged run cannot be whole, and the others' load would go on to the
    end of their schedules for nothing."""
    procs = [c.proc for c in children]
    t0 = time.monotonic()
    deadline = t0 + timeout
    while None in [p.poll() for p in procs]:  # every one polled: any of them may have failed
        failed = next((c for c in children if c.proc.returncode not in (None, 0)), None)
        if failed is not None:
            raise EvaluationError(
                f"load-generator process {failed.proc.pid} (slice {failed.j}) failed during "
                f"the run (exit code {failed.proc.returncode})",
                slice=failed.j,
                exit_code=failed.proc.returncode,
            )
        if time.monotonic() > deadline:
            raise EvaluationError(f"load-generator processes still running after {timeout:g} s")
        if stop.wait(PROGRESS_S):
            return _stopped(procs)
        report(sum(c.done for c in children), time.monotonic() - t0)
    for c in children:
        c.join()
    return [int(p.returncode) for p in procs]


def _stopped(procs: list[subprocess.Popen[str]]) -> list[int]:
    """Tell every child still running to stop; the exit codes of all of them after at
    most :data:`STOP_WAIT_S` (-1 for one still running)."""
    for p in procs:
        with contextlib.suppress(OSError):  # ended meanwhile: its pipe is closed
            stdin = _pipe(p, p.stdin)
            stdin.write("stop\n")
            stdin.flush()
    deadline = time.monotonic() + STOP_WAIT_S
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))
    return [-1 if p.returncode is None else int(p.returncode) for p in procs]


# --------------------------------------------------------------------------- child


def _read_slice(base: str) -> tuple[Schedule, list[bytes]]:
    with np.load(f"{base}-schedule.npz") as z:
        sched = Schedule(z["offsets"], index=z["index"])
    return sched, list(codec.decode(Path(f"{base}-payloads.bin").read_bytes()))


async def _child(cfg: dict[str, Any]) -> None:
    base = cfg["base"]
    settings = Settings.from_env()
    scenario_traits.load_modules(settings.scenario_modules)  # the spec may name one of theirs
    if cfg.get("nats_url"):
        settings = settings.with_(nats_url=cfg["nats_url"])
    sched, payloads = await anyio.to_thread.run_sync(_read_slice, base)
    first = int(sched.index[0]) if len(sched) else 0
    stride = int(sched.index[1] - sched.index[0]) if len(sched) > 1 else 1
    labels_fn = None
    if cfg["has_labels"]:
        lab = np.load(f"{base}-labels.npy")

        def labels_fn(g: int) -> np.ndarray:
            return lab[(g - first) // stride]  # type: ignore[no-any-return]

    def no_inputs(g: int) -> np.ndarray:
        raise EvaluationError("payloads are prebuilt by the parent")

    async with busmod.connect(settings, name=f"loadgen {os.getpid()}") as bus:
        print("ready", flush=True)
        start_ns = int(await anyio.to_thread.run_sync(sys.stdin.readline))
        driver = Driver(
            bus,
            evaluation_id=cfg["evaluation_id"],
            subject=cfg["subject"],
            spec=ScenarioSpec.model_validate(cfg["spec"]),
            inputs=no_inputs,
            labels=labels_fn,
            trace_level=TraceLevel(cfg["trace_level"]),
            offset_ns=int(cfg["offset_ns"]),
            schedule=sched,
            start_ns=start_ns,
            payloads=payloads,
            on_progress=_print_progress,
            tuning=ProcessTuning(),  # this process runs one slice
        )
        rec: RunRecord | None = None
        with anyio.CancelScope() as scope:
            _stop_on_stdin(scope)
            rec = await driver.run()
        if rec is None:  # cancelled: every query issued up to the stop
            rec = driver.record
    if rec is not None:
        save_result(rec, f"{base}-result.npz")


def _stop_on_stdin(scope: anyio.CancelScope) -> None:
    """The parent's next line on stdin (``stop``, or the end of the pipe: the parent is
    gone) cancels ``scope``. A daemon thread: a blocked read must not keep the process."""
    token = current_token()

    def watch() -> None:
        sys.stdin.readline()
        with contextlib.suppress(Exception):  # the run ended first: nothing to stop
            anyio.from_thread.run_sync(scope.cancel, token=token)

    threading.Thread(target=watch, name="stop-on-stdin", daemon=True).start()


async def _print_progress(rec: RunRecord, elapsed_s: float) -> None:
    print(f"progress {rec.done}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    cfg = json.loads(Path(args[0]).read_text())
    anyio.run(_child, cfg, backend="asyncio")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
