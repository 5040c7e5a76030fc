"""MLPerf LoadGen next to the model (``mlscope mlperf --placement agent``).

::

    agent (ctl MLPerfRunOp) ── writes CFG ──► python -m agent.mlperf_local CFG
      ◄── MLPerfStarted {pid}                   model opened here (same manifest, graph and
                                                options as the agent's), its own Executor
                                                LoadGen thread: load_samples ─► SampleLibrary
                                                issue_query ─► chunks ≤ batch_size, ≤ window
                                                in flight ─► Executor (pre-processed samples)
                                                predict thread: QuerySamplesComplete
      ◄── exit: mlperf_log_*, sut-timing.npz (kept until the evaluation is released)
      ── MLPerfDone {files: sizes} ──► the server, which fetches them part by part
         (ctl MLPerfFetchOp ─► MLPerfFile) and stores them as for placement server

The test runs in a child process for the reason the server's does (LoadGen keeps
process-wide state and cannot abort a test: a released or cancelled evaluation kills
the process), and its system under test calls the model in that process: no query
crosses the bus, so LoadGen measures the model, as a local run does. The child is
this module's :func:`main`; the agent's side is :class:`MLPerfRunner`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from agent.job import Job
from agent.pipeline import Executor, ExecutorConfig
from agent.samplelib import MemoryBudget, SampleLibrary
from agent.worker import LoadedModel
from mlscope import codec, samples, scratch
from mlscope.catalog import Entry
from mlscope.contracts import (
    MAX_MLPERF_FILE_BYTES,
    MAX_MLPERF_FILES_BYTES,
    MLPERF_FILE_NAMES,
    MLPerfDone,
    MLPerfFetchOp,
    MLPerfFile,
    MLPerfRunOp,
    MLPerfSpec,
    QueryReply,
    TraceLevel,
)
from mlscope.errors import ConfigError, EvaluationError, MLScopeError
from mlscope.lifeline import end_with_parent
from mlscope.manifest import ModelManifest
from mlscope.mlperf import (
    ERROR,
    TIMING,
    SampleTiming,
    load_loadgen,
    rankings,
    save_timing,
    start_test,
    test_settings,
)
from mlscope.predictor import PredictorOptions
from mlscope.tuning import ProcessTuning

__all__ = ["FILE_HEADROOM", "LocalSUT", "MLPerfRunner", "main"]

now = time.perf_counter_ns
log = logging.getLogger("mlscope.agent")
FILE_HEADROOM = 4096
"""Room left in each file message for its envelope (name, offset)."""
KEEP = 4
"""Finished runs whose files an agent keeps for the server to fetch."""


# --------------------------------------------------------------------------- the child


@dataclass
class LocalSUT:
    """LoadGen's system under test over an in-process executor: each LoadGen query
    becomes executor jobs of at most ``batch_size`` held samples, at most ``window``
    in flight and the rest waiting here (the wait counts as latency)."""

    lg: Any
    worker: Executor
    library: SampleLibrary
    batch_size: int
    window: int
    issue_ns: list[int] = field(default_factory=list)
    timing: dict[tuple[int, int], SampleTiming] = field(default_factory=dict)
    errors: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._backlog: deque[tuple[int, int, list[tuple[int, int]]]] = deque()
        self._inflight = 0
        self._next = 0

    def issue_query(self, query: list[Any]) -> None:
        """LoadGen's thread: queue the query's chunks, send what the window allows."""
        t = now()
        items = [(int(s.id), int(s.index)) for s in query]
        with self._lock:
            seq = len(self.issue_ns)
            self.issue_ns.append(t)
            for a in range(0, len(items), self.batch_size):
                self._backlog.append((seq, a, items[a : a + self.batch_size]))
        self._pump()

    def _pump(self) -> None:
        while True:
            with self._lock:
                if not self._backlog or self._inflight >= self.window:
                    return
                seq, first, items = self._backlog.popleft()
                self._inflight += 1
            self._send(seq, first, items)

    def _send(self, seq: int, first: int, items: list[tuple[int, int]]) -> None:
        try:
            x = self.library.take(np.asarray([i for _, i in items], np.int64))
        except MLScopeError as exc:
            self._done(seq, first, items, None, str(exc))
            return
        job = Job(
            index=seq,
            inputs=x,
            received_ns=now(),
            level=TraceLevel.NONE,
            spans=None,
            reply=lambda r: self._done(seq, first, items, r, ""),
            preprocessed=self.library.preprocessed,
        )
        if not self.worker.submit(job):
            self._done(seq, first, items, None, "the executor is full")

    def _done(
        self,
        seq: int,
        first: int,
        items: list[tuple[int, int]],
        reply: QueryReply | None,
        error: str,
    ) -> None:
        """A chunk's answer (predict thread): complete its samples, send the next."""
        ranks = None
        agent = (0, 0, 0, 0)
        if reply is not None and reply.ok:
            ranks = rankings(reply.outputs, len(items))
            agent = (reply.t_received, reply.t_predict_start, reply.t_predict_end, reply.t_replied)
            error = "" if ranks is not None else "malformed outputs"
        elif reply is not None:
            error = str((reply.error or {}).get("message", "error"))
        responses = []
        for pos, (sid, _) in enumerate(items):
            t = SampleTiming(agent=agent, ok=ranks is not None, error=error)
            if ranks is not None:
                t.prediction = int(ranks[pos][0])
                data = ranks[pos]
                responses.append(self.lg.QuerySampleResponse(sid, data.ctypes.data, data.nbytes))
            else:
                responses.append(self.lg.QuerySampleResponse(sid, 0, 0))
            self.timing[(seq, first + pos)] = t
        with self._lock:
            self.errors += 0 if ranks is not None else len(items)
            self._inflight -= 1
        self.lg.QuerySamplesComplete(responses)  # copies the data before it returns
        self._pump()


def _open(cfg: dict[str, Any]) -> tuple[LoadedModel, np.ndarray]:
    """The model and its data set's inputs, as the agent has them."""
    manifest = ModelManifest.model_validate_json(cfg["manifest"])
    entry = Entry(manifest=manifest, path=Path(cfg["manifest_path"]), trusted=cfg["trusted"])
    data = samples.dataset(entry, Path(cfg["zoo_dir"]))
    if data is None:
        raise ConfigError(
            f"{manifest.name} has no labelled data set: it cannot be LoadGen's sample library",
            model=manifest.name,
        )
    opts = PredictorOptions(**cfg["options"])
    model = LoadedModel.open(entry, Path(cfg["graph"]), opts, allow_custom=cfg["allow_custom"])
    return model, data[0]


def run_child(cfg: dict[str, Any]) -> None:
    """Open the model, run one LoadGen test against it, leave the logs and timing."""
    lg = load_loadgen()
    spec = MLPerfSpec.model_validate(cfg["spec"])
    work = Path(cfg["workdir"])
    model, x = _open(cfg)
    worker = Executor(
        model, ExecutorConfig(**cfg["executor"], max_batch=spec.batch_size), warm=True
    )
    worker.first_inference_ns()  # on the thread that predicts (see Executor)
    library = SampleLibrary(
        cfg["evaluation_id"], x, model, MemoryBudget(int(cfg["sample_memory_bytes"]))
    )
    window = min(spec.window, int(cfg["executor"]["capacity"]))  # never past admission
    sut = LocalSUT(lg, worker, library, spec.batch_size, window)
    try:
        settings = test_settings(lg, spec, cfg["conf_model"], work, samples=len(x))
        with ProcessTuning().measurement(realtime_loop=False):
            start_test(
                lg,
                issue=sut.issue_query,
                samples=len(x),
                load=library.load,
                unload=library.unload,
                settings=settings,
                logdir=cfg["logdir"],
                workdir=work,
            )
    finally:
        worker.stop()
    save_timing(work / TIMING, sut.issue_ns, sut.timing, sut.errors)


def main(argv: list[str] | None = None) -> int:
    """The child process: ``python -m agent.mlperf_local CFG.json``."""
    args = sys.argv[1:] if argv is None else argv
    cfg = json.loads(Path(args[0]).read_text())
    end_with_parent(cfg["parent_pid"])  # a killed agent leaves no test running
    try:
        run_child(cfg)
    except MLScopeError as exc:  # the server raises it again, fields intact
        (Path(cfg["workdir"]) / ERROR).write_text(json.dumps(exc.to_wire(), default=str))
        return 2
    return 0


# --------------------------------------------------------------------------- the agent


@dataclass
class _Kept:
    """The files a finished run left, until the server fetched them and released."""

    tmp: tempfile.TemporaryDirectory[str]
    files: dict[str, Path]


@dataclass
class MLPerfRunner:
    """The agent's MLPerf runs in its host: one child process per evaluation, its files
    kept (at most :data:`KEEP` runs) until the evaluation is released."""

    service: str
    procs: dict[str, Any] = field(default_factory=dict)
    kept: dict[str, _Kept] = field(default_factory=dict)

    async def start(
        self,
        op: MLPerfRunOp,
        cfg: dict[str, Any],
        publish: Callable[[bytes], Awaitable[None]],
        *,
        env: dict[str, str],
    ) -> tuple[int, Callable[[], Coroutine[Any, Any, None]]]:
        """Start LoadGen for ``op``; returns its pid and the task that waits for it and
        says it is done (run it in the agent's task group)."""
        ev = op.evaluation_id
        if ev in self.procs or ev in self.kept:
            raise EvaluationError(
                f"an MLPerf run of evaluation {ev} is already running here", evaluation_id=ev
            )
        tmp = scratch.scratch_dir("mlperf-agent")
        work = Path(tmp.name)
        (work / "logs").mkdir()
        cfg = {
            **cfg,
            "workdir": str(work),
            "logdir": str(work / "logs"),
            "parent_pid": os.getpid(),
        }
        (work / "config.json").write_text(json.dumps(cfg))
        with (work / "stderr.txt").open("wb") as err:
            try:
                proc = await anyio.open_process(
                    [sys.executable, "-m", "agent.mlperf_local", str(work / "config.json")],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            except BaseException:
                tmp.cleanup()
                raise
        self.procs[ev] = proc

        async def finish() -> None:
            try:
                await self._finish(ev, proc, tmp, publish)
            finally:
                self.procs.pop(ev, None)

        return int(proc.pid), finish

    async def stop(self, evaluation_id: str) -> None:
        """The evaluation was released (or cancelled): end its LoadGen process (LoadGen
        has no abort) and drop its files."""
        proc = self.procs.get(evaluation_id)
        if proc is not None and proc.returncode is None:
            proc.kill()
        kept = self.kept.pop(evaluation_id, None)
        if kept is not None:
            kept.tmp.cleanup()

    def fetch(self, op: MLPerfFetchOp) -> MLPerfFile:
        """Part of a file a finished run left (only the names it listed)."""
        kept = self.kept.get(op.evaluation_id)
        path = kept.files.get(op.name) if kept is not None else None
        if path is None:
            raise EvaluationError(
                f"no file {op.name!r} of an MLPerf run of evaluation {op.evaluation_id} here",
                evaluation_id=op.evaluation_id,
            )
        with path.open("rb") as f:
            f.seek(op.offset)
            data = f.read(max(1, op.max_bytes - FILE_HEADROOM))
        return MLPerfFile(name=op.name, offset=op.offset, data=data)

    async def _finish(
        self,
        ev: str,
        proc: Any,
        tmp: tempfile.TemporaryDirectory[str],
        publish: Callable[[bytes], Awaitable[None]],
    ) -> None:
        work = Path(tmp.name)
        done = MLPerfDone(evaluation_id=ev)
        try:
            error = _outcome(work, await proc.wait())
            if error is None:
                self._keep(ev, tmp, [work / TIMING, *sorted((work / "logs").iterdir())])
                done = self._done(ev)
            else:
                done = MLPerfDone(evaluation_id=ev, error=error)
        finally:
            if proc.returncode is None:
                proc.kill()  # the agent shuts down: LoadGen cannot be stopped otherwise
            if ev not in self.kept:
                tmp.cleanup()
            with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                if proc.returncode is None:
                    await proc.wait()
                    done = MLPerfDone(
                        evaluation_id=ev,
                        error=EvaluationError("the agent stopped during the run").to_wire(),
                    )
                await publish(codec.encode_model(done))

    def _keep(self, ev: str, tmp: tempfile.TemporaryDirectory[str], paths: list[Path]) -> None:
        """Keep the files the server may fetch (only the names MLPerfDone allows)."""
        while len(self.kept) >= KEEP:  # a server that never released: oldest first
            self.kept.pop(next(iter(self.kept))).tmp.cleanup()
        files = {p.name: p for p in paths if p.name in MLPERF_FILE_NAMES and p.is_file()}
        self.kept[ev] = _Kept(tmp, files)

    def _done(self, ev: str) -> MLPerfDone:
        """The run's end with its files' sizes; a typed error when they are past what
        the server takes (MLPerfDone's limits), which it would refuse unread."""
        sizes = {name: p.stat().st_size for name, p in self.kept[ev].files.items()}
        limit = MAX_MLPERF_FILE_BYTES
        big = [f"{name} ({size:,} bytes)" for name, size in sizes.items() if size > limit]
        if big or sum(sizes.values()) > MAX_MLPERF_FILES_BYTES:
            error = EvaluationError(
                f"the LoadGen run left more than the server takes: {', '.join(big) or 'in all'} "
                f"(at most {MAX_MLPERF_FILE_BYTES:,} bytes a file, "
                f"{MAX_MLPERF_FILES_BYTES:,} in all): lower the run's duration or rate",
                evaluation_id=ev,
            )
            return MLPerfDone(evaluation_id=ev, error=error.to_wire())
        return MLPerfDone(evaluation_id=ev, files=sizes)


def _outcome(work: Path, code: int) -> dict[str, Any] | None:
    """The typed error (as on the wire) of a LoadGen process that failed, else None."""
    if (work / ERROR).exists():
        wire: dict[str, Any] = json.loads((work / ERROR).read_text())
        return wire
    if code != 0:
        tail = (work / "stderr.txt").read_text(errors="replace")[-500:]
        return EvaluationError(
            f"the agent's LoadGen process failed (exit code {code}): {tail}"
        ).to_wire()
    return None


if __name__ == "__main__":
    raise SystemExit(main())
