"""LoadGen's two interfaces over the bus: the sample library and the system under test.

```
LoadGen thread ── issue_query(samples) ──call_soon_threadsafe──► event loop
                                                                  │ chunks of <= batch_size
                                                                  │ samples, <= window in flight
        QuerySamplesComplete ◄── reply (outputs, agent times) ◄── agent (Query / QueryReply)
```

* :class:`SampleLibrary` is the QuerySampleLibrary: the model's labelled data set.
  LoadGen's ``load_samples`` callback copies the rows it names into memory once (the
  raw samples every query is built from), ``unload_samples`` drops them; a query for
  a sample that is not loaded is LoadGen's misuse and fails the run.
* :class:`AgentSUT` is the system under test: each LoadGen query becomes one or more
  ordinary agent queries (the same ``Query`` / ``QueryReply`` as mlscope's own load
  generator), at most ``window`` in flight; the rest wait in a FIFO on our side, so
  an agent is never asked past its admission bound and the wait counts as latency,
  as it would inside any system under test. Each reply completes its samples at once
  with the response LoadGen logs in accuracy mode: the predicted classes as int64,
  best first (what MLPerf's ImageNet checker reads).

LoadGen runs in its own thread (``StartTest`` releases the GIL); every state change
here happens on the event loop, so nothing is locked.

Each test runs in a child process of the server, ``python -m broker.mlperf_sut CFG``:
LoadGen keeps process-wide state (its logger, and a count of the conf files read,
which makes a second test in one process log "Multiple conf files are used" as an
error), has no way to abort a test, and its threads would share the server's GIL
with the trace ingester. The child connects to NATS itself (the server's URL and
environment), reads the raw data set the parent wrote, runs the test, and leaves
LoadGen's logs and what the SUT saw (:data:`TIMING`) in the parent's temporary
directory. ``perf_counter_ns`` is CLOCK_MONOTONIC, one clock for every process of a
host, so the parent's clock offset to the agent holds for the child.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from broker.loadgen import LOOP_REALTIME_MAX_QPS, encode_query
from broker.pacer import REALTIME_PRIORITY
from broker.tuning import ProcessTuning
from mlscope import bus as busmod
from mlscope import codec
from mlscope.bus import Bus
from mlscope.contracts import MLPerfSpec, TraceLevel, new_id
from mlscope.errors import (
    ConfigError,
    EvaluationError,
    FrameworkUnavailable,
    MLScopeError,
    WireError,
)
from mlscope.settings import Settings

__all__ = [
    "ERROR",
    "TIMING",
    "AgentSUT",
    "SampleLibrary",
    "SampleTiming",
    "load_loadgen",
    "main",
    "test_settings",
]

TIMING = "sut-timing.npz"
ERROR = "error.json"

now = time.perf_counter_ns


class SampleLibrary:
    """The QuerySampleLibrary over a data set's raw rows ``x``."""

    def __init__(self, x: np.ndarray) -> None:
        self.x = x
        self.loaded: dict[int, np.ndarray] = {}
        self.loads = 0
        self.unloads = 0

    def load(self, indices: list[int]) -> None:
        self.loads += 1
        for i in indices:
            self.loaded[int(i)] = np.array(self.x[int(i)])  # copied once

    def unload(self, indices: list[int]) -> None:
        self.unloads += 1
        for i in indices:
            self.loaded.pop(int(i), None)

    def stack(self, indices: list[int]) -> np.ndarray:
        try:
            return np.stack([self.loaded[i] for i in indices])
        except KeyError as exc:
            raise EvaluationError(
                f"LoadGen asked for sample {exc.args[0]}, which it did not load"
            ) from exc


@dataclass
class SampleTiming:
    """What the SUT saw of one sample (agent times on the agent's clock, ns)."""

    agent: tuple[int, int, int, int] = (0, 0, 0, 0)
    ok: bool = False
    prediction: int = -1
    error: str = ""


REPLY_TIMEOUT_S = 60.0
"""A chunk unanswered this long fails its samples: LoadGen waits for every sample, so
an agent that died mid-test would otherwise hold the test (and the job) forever."""


@dataclass
class _Chunk:
    query_seq: int
    first: int
    items: list[tuple[int, int]]
    """(LoadGen response id, sample index) per sample."""
    sent_ns: int = 0


@dataclass
class AgentSUT:
    """Turns LoadGen queries into agent queries; see the module doc."""

    bus: Bus
    lg: Any
    subject: str
    evaluation_id: str
    library: SampleLibrary
    batch_size: int
    window: int
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    issue_ns: list[int] = field(default_factory=list)
    """Our clock at each LoadGen query's issue, by query sequence number."""
    timing: dict[tuple[int, int], SampleTiming] = field(default_factory=dict)
    """(query sequence, position in the query) -> what came back."""
    errors: int = 0

    def __post_init__(self) -> None:
        self.inbox = f"_INBOX.{new_id('mlperf')}"
        self._backlog: deque[_Chunk] = deque()
        self._inflight: dict[int, _Chunk] = {}
        self._next = 0
        self._work = asyncio.Event()
        self._failure: BaseException | None = None

    # ------------------------------------------------------------- LoadGen's thread

    def issue_query(self, samples: list[Any]) -> None:
        t = now()
        items = [(int(s.id), int(s.index)) for s in samples]
        self.loop.call_soon_threadsafe(self._admit, t, items)

    def flush_queries(self) -> None:
        """Nothing is held back: every chunk is sent as soon as the window allows."""

    # ------------------------------------------------------------- event loop

    def _admit(self, t: int, items: list[tuple[int, int]]) -> None:
        q = len(self.issue_ns)
        self.issue_ns.append(t)
        for start in range(0, len(items), self.batch_size):
            self._backlog.append(_Chunk(q, start, items[start : start + self.batch_size]))
        self._work.set()

    async def serve(self) -> None:
        """Send waiting chunks while fewer than ``window`` are in flight (until cancelled)."""
        sub = await self.bus.nc.subscribe(self.inbox, cb=self._on_reply)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._expire)
                while True:
                    await self._work.wait()
                    self._work.clear()
                    while self._backlog and len(self._inflight) < self.window:
                        await self._send(self._backlog.popleft())
        finally:
            with anyio.CancelScope(shield=True):
                await sub.unsubscribe()

    async def _expire(self, timeout_s: float = REPLY_TIMEOUT_S) -> None:
        while True:
            await anyio.sleep(1.0)
            limit = now() - int(timeout_s * 1e9)
            for i in [i for i, c in self._inflight.items() if c.sent_ns < limit]:
                self._complete(i, None, f"no reply within {timeout_s:g} s")

    async def _send(self, chunk: _Chunk) -> None:
        i = self._next
        self._next += 1
        chunk.sent_ns = now()
        self._inflight[i] = chunk
        try:
            x = self.library.stack([idx for _, idx in chunk.items])
        except EvaluationError as exc:
            self._failure = exc
            self._complete(i, None, str(exc))
            return
        payload = encode_query(self.evaluation_id, i, x, TraceLevel.NONE)
        await self.bus.nc.publish(self.subject, payload, reply=self.inbox)

    async def _on_reply(self, msg: Any) -> None:
        try:
            data = codec.decode(msg.data)
            if data.get("kind") == "error":
                err = data.get("error") or {}
                self._complete(
                    int(err.get("fields", {}).get("index", -1)),
                    None,
                    str(err.get("message", "error")),
                )
            elif data.get("ok"):
                self._complete(int(data["index"]), data, "")
            else:
                self._complete(
                    int(data.get("index", -1)),
                    None,
                    str((data.get("error") or {}).get("message", "error")),
                )
        except (WireError, AttributeError, KeyError, TypeError, ValueError):
            return  # not a reply: its chunk is answered by a real one, or expires

    def _complete(self, i: int, reply: dict[str, Any] | None, error: str) -> None:
        chunk = self._inflight.pop(i, None)
        if chunk is None:
            return  # not ours, or a duplicate
        ranks, agent = None, (0, 0, 0, 0)
        if reply is not None:
            try:
                agent = (
                    int(reply["t_received"]),
                    int(reply["t_predict_start"]),
                    int(reply["t_predict_end"]),
                    int(reply["t_replied"]),
                )
                ranks = _rankings(reply, len(chunk.items))
            except (KeyError, TypeError, ValueError):
                ranks = None
            error = error or ("" if ranks is not None else "malformed reply")
        keep: list[np.ndarray] = []
        responses = []
        for pos, (sid, _) in enumerate(chunk.items):
            t = SampleTiming(agent=agent, ok=ranks is not None, error=error)
            if ranks is not None:
                keep.append(ranks[pos])
                t.prediction = int(ranks[pos][0])
                responses.append(
                    self.lg.QuerySampleResponse(sid, ranks[pos].ctypes.data, ranks[pos].nbytes)
                )
            else:
                self.errors += 1
                responses.append(self.lg.QuerySampleResponse(sid, 0, 0))
            self.timing[(chunk.query_seq, chunk.first + pos)] = t
        self.lg.QuerySamplesComplete(responses)  # copies the data before it returns
        del keep
        self._work.set()

    def check(self) -> None:
        """Raise what made the run meaningless (LoadGen's misuse of its library)."""
        if self._failure is not None:
            raise self._failure


def _rankings(reply: dict[str, Any], n: int) -> np.ndarray | None:
    """Per sample, the predicted classes best first (int64): the post-processed indices
    when the model returns class indices, else the argmax of its output."""
    out = reply.get("outputs")
    if not isinstance(out, np.ndarray) or out.size == 0 or out.shape[0] != n:
        return None
    rows = out.reshape(n, -1)
    if np.issubdtype(rows.dtype, np.integer):
        return np.ascontiguousarray(rows, dtype=np.int64)
    return np.ascontiguousarray(rows.argmax(axis=1)[:, None], dtype=np.int64)


def load_loadgen() -> Any:
    """The ``mlperf_loadgen`` module, or a typed error naming the extra to install."""
    try:
        import mlperf_loadgen
    except ImportError as exc:
        raise FrameworkUnavailable(
            "MLPerf LoadGen is not installed: pip install 'mlscope[mlperf]' (mlcommons-loadgen)"
        ) from exc
    return mlperf_loadgen


def test_settings(lg: Any, spec: MLPerfSpec, model: str, workdir: Path) -> Any:
    """LoadGen's TestSettings: its mlperf.conf (or the job's), the user.conf, the flags."""
    ts = lg.TestSettings()
    ts.scenario = getattr(lg.TestScenario, spec.scenario)
    ts.mode = getattr(lg.TestMode, spec.mode)
    for name, text, user in (
        ("mlperf.conf", spec.mlperf_conf, False),
        ("user.conf", spec.user_conf, True),
    ):
        if text is None and user:
            continue
        path = workdir / name
        if text is not None:
            path.write_text(text)
        # conf_type 0 loads LoadGen's built-in mlperf.conf; 1 reads the file given.
        code = ts.FromConfig(str(path), model, spec.scenario, 1 if text is not None else 0)
        if code != 0:
            raise ConfigError(
                f"LoadGen refused the {name} (FromConfig returned {code})", field=name
            )
    if spec.target_qps is not None:
        if spec.scenario == "Server":
            ts.server_target_qps = spec.target_qps
        elif spec.scenario == "Offline":
            ts.offline_expected_qps = spec.target_qps
    if spec.seed is not None:
        ts.qsl_rng_seed = ts.sample_index_rng_seed = ts.schedule_rng_seed = spec.seed
    return ts


async def run_test(bus: Bus, lg: Any, cfg: dict[str, Any], x: np.ndarray) -> AgentSUT:
    """One LoadGen test in a worker thread while the SUT serves on the event loop."""
    spec = MLPerfSpec.model_validate(cfg["spec"])
    work = Path(cfg["workdir"])
    library = SampleLibrary(x)
    sut = AgentSUT(
        bus, lg, cfg["subject"], cfg["evaluation_id"], library, spec.batch_size, spec.window
    )
    ts = test_settings(lg, spec, cfg["conf_model"], work)
    log = lg.LogSettings()
    log.log_output.outdir = cfg["logdir"]
    log.log_output.copy_summary_to_stdout = False
    log.enable_trace = True  # the per-sample records
    handles = (
        lg.ConstructSUT(sut.issue_query, sut.flush_queries),
        lg.ConstructQSL(len(x), len(x), library.load, library.unload),
    )
    # The same conditions as mlscope's own pacer (broker/loadgen.py), so the two load
    # generators can be compared: LoadGen's issue thread gets the GIL the moment it
    # wakes (not after a 5 ms switch interval), no GC pause holds it, and it runs in
    # SCHED_FIFO like the pacer thread, the event loop too below the same rate
    # (no effect without CAP_SYS_NICE). This process runs one test, then exits.
    realtime_loop = spec.scenario != "Offline" and (spec.target_qps or 0) <= LOOP_REALTIME_MAX_QPS
    try:
        with ProcessTuning().measurement(realtime_loop=realtime_loop):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sut.serve)
                await anyio.to_thread.run_sync(
                    _start_test, lg, handles, ts, log, str(work / "audit.config")
                )
                tg.cancel_scope.cancel()
    finally:
        lg.DestroyQSL(handles[1])
        lg.DestroySUT(handles[0])
    sut.check()
    return sut


def _start_test(lg: Any, handles: tuple[int, int], ts: Any, log: Any, audit: str) -> None:
    """StartTest on a real-time worker thread: LoadGen's own threads, created by it,
    inherit its scheduling policy (pthreads' default)."""
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))
        realtime = True
    except OSError:
        realtime = False
    try:
        lg.StartTestWithLogSettings(handles[0], handles[1], ts, log, audit)
    finally:
        if realtime:
            os.sched_setscheduler(0, policy, param)


def save_timing(sut: AgentSUT, path: Path) -> None:
    keys = sorted(sut.timing)
    rows = [sut.timing[k] for k in keys]
    np.savez(
        path,
        issue_ns=np.asarray(sut.issue_ns, np.int64),
        key=np.asarray(keys, np.int64).reshape(-1, 2),
        agent=np.asarray([t.agent for t in rows], np.int64).reshape(-1, 4),
        ok=np.asarray([t.ok for t in rows], bool),
        prediction=np.asarray([t.prediction for t in rows], np.int64),
        error=np.asarray([t.error for t in rows], dtype=str),
        errors=sut.errors,
    )


async def _child(cfg: dict[str, Any]) -> None:
    lg = load_loadgen()
    settings = Settings.from_env()
    if cfg.get("nats_url"):
        settings = settings.with_(nats_url=cfg["nats_url"])
    x = np.load(Path(cfg["workdir"]) / "samples.npy")
    async with busmod.connect(settings, name=f"mlperf loadgen {os.getpid()}") as bus:
        sut = await run_test(bus, lg, cfg, x)
    save_timing(sut, Path(cfg["workdir"]) / TIMING)


def main(argv: list[str] | None = None) -> int:
    """The child process: ``python -m broker.mlperf_sut CFG.json``."""
    args = sys.argv[1:] if argv is None else argv
    cfg = json.loads(Path(args[0]).read_text())
    try:
        anyio.run(_child, cfg, backend="asyncio")
    except MLScopeError as exc:  # the parent raises it again, fields intact
        (Path(cfg["workdir"]) / ERROR).write_text(json.dumps(exc.to_wire(), default=str))
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
