"""LoadGen's two interfaces over the bus: the sample library and the system under test.

```
LoadGen thread ── load_samples / unload_samples ── ctl request ──► agent's sample library
LoadGen thread ── issue_query(samples) ──call_soon_threadsafe──► event loop
                                                                  │ chunks of <= batch_size
                                                                  │ samples, <= window in flight
        QuerySamplesComplete ◄── reply (outputs, agent times) ◄── agent (SamplesQuery / QueryReply)
```

* The QuerySampleLibrary is held by the agent (:mod:`agent.samplelib`): LoadGen's
  ``load_samples`` / ``unload_samples`` callbacks become ``load_samples`` /
  ``unload_samples`` control requests, answered once the agent holds (or dropped)
  the samples of its own copy of the data set, pre-processed once where the model's
  pipeline allows. A load the agent refuses (its memory limit, an index out of
  range) fails the run after LoadGen's test.
* :class:`AgentSUT` is the system under test: each LoadGen query becomes one or more
  agent queries naming held samples by index (``SamplesQuery`` on
  ``mlscope.agent.<id>.samples``, answered with the ``QueryReply`` of any query), at
  most ``window`` in flight; the rest wait in a FIFO on our side, so
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
environment), runs the test, and leaves LoadGen's logs and what the SUT saw
(:data:`mlscope.mlperf.TIMING`) in the parent's temporary directory.
``perf_counter_ns`` is CLOCK_MONOTONIC, one clock for every process of a host, so the
parent's clock offset to the agent holds for the child.
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

from mlscope import bus as busmod
from mlscope import codec
from mlscope.bus import Bus, request
from mlscope.contracts import (
    MLPerfSpec,
    SamplesLoadOp,
    SamplesQuery,
    SamplesUnloadOp,
    new_id,
)
from mlscope.errors import MLScopeError, WireError
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
from mlscope.settings import Settings
from mlscope.tuning import ProcessTuning

__all__ = ["AgentSUT", "main"]

now = time.perf_counter_ns
SAMPLES_TIMEOUT_S = 300.0
"""How long the agent may take to load (read and pre-process) the samples LoadGen names."""
REPLY_TIMEOUT_S = 60.0
"""A chunk unanswered this long fails its samples: LoadGen waits for every sample, so
an agent that died mid-test would otherwise hold the test (and the job) forever."""
LOOP_REALTIME_MAX_QPS = 5_000.0
"""Above this target rate the event loop, which publishes what LoadGen issues, keeps
its normal priority: it is busy most of the time there, and a busy real-time thread
would take a core from the agent and nats-server (the system under test)."""


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
    agent_subjects: tuple[str, str]
    """The agent's samples and control subjects."""
    evaluation_id: str
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

    def load_samples(self, indices: list[int]) -> None:
        """LoadGen's QSL callback: the agent holds these samples before it returns."""
        self._library(SamplesLoadOp(evaluation_id=self.evaluation_id, indices=tuple(indices)))

    def unload_samples(self, indices: list[int]) -> None:
        self._library(SamplesUnloadOp(evaluation_id=self.evaluation_id, indices=tuple(indices)))

    def _library(self, op: SamplesLoadOp | SamplesUnloadOp) -> None:
        """One sample-library request, waited for on LoadGen's thread; a refusal is
        kept (LoadGen cannot take an error) and fails the run after the test."""
        call = request(
            self.bus, self.agent_subjects[1], codec.encode_model(op), timeout=SAMPLES_TIMEOUT_S
        )
        try:
            asyncio.run_coroutine_threadsafe(call, self.loop).result()
        except MLScopeError as exc:
            self._failure = self._failure or exc

    def issue_query(self, samples: list[Any]) -> None:
        t = now()
        items = [(int(s.id), int(s.index)) for s in samples]
        self.loop.call_soon_threadsafe(self._admit, t, items)

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
        query = SamplesQuery(
            evaluation_id=self.evaluation_id,
            index=i,
            samples=np.fromiter((idx for _, idx in chunk.items), np.int64, len(chunk.items)),
        )
        payload = codec.encode_model(query)
        await self.bus.nc.publish(self.agent_subjects[0], payload, reply=self.inbox)

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
                ranks = rankings(reply.get("outputs"), len(chunk.items))
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


async def run_test(bus: Bus, lg: Any, cfg: dict[str, Any]) -> AgentSUT:
    """One LoadGen test in a worker thread while the SUT serves on the event loop."""
    spec = MLPerfSpec.model_validate(cfg["spec"])
    work = Path(cfg["workdir"])
    sut = AgentSUT(
        bus,
        lg,
        (cfg["subject"], cfg["ctl"]),
        cfg["evaluation_id"],
        spec.batch_size,
        spec.window,
    )
    ts = test_settings(lg, spec, cfg["conf_model"], work)
    # The same conditions as mlscope's own pacer (broker/loadgen.py), so the two load
    # generators can be compared: LoadGen's issue thread gets the GIL the moment it
    # wakes (not after a 5 ms switch interval), no GC pause holds it, and it runs in
    # SCHED_FIFO like the pacer thread (mlscope.mlperf.start_test); the event loop,
    # which publishes here, too below LOOP_REALTIME_MAX_QPS (no effect without
    # CAP_SYS_NICE). This process runs one
    # test, then exits.
    realtime_loop = spec.scenario != "Offline" and (spec.target_qps or 0) <= LOOP_REALTIME_MAX_QPS
    with ProcessTuning().measurement(realtime_loop=realtime_loop):
        async with anyio.create_task_group() as tg:
            tg.start_soon(sut.serve)
            await anyio.to_thread.run_sync(
                lambda: start_test(
                    lg,
                    issue=sut.issue_query,
                    samples=int(cfg["samples"]),
                    load=sut.load_samples,
                    unload=sut.unload_samples,
                    settings=ts,
                    logdir=cfg["logdir"],
                    workdir=work,
                )
            )
            tg.cancel_scope.cancel()
    sut.check()
    return sut


async def _child(cfg: dict[str, Any]) -> None:
    lg = load_loadgen()
    settings = Settings.from_env()
    if cfg.get("nats_url"):
        settings = settings.with_(nats_url=cfg["nats_url"])
    async with busmod.connect(settings, name=f"mlperf loadgen {os.getpid()}") as bus:
        sut = await run_test(bus, lg, cfg)
    save_timing(Path(cfg["workdir"]) / TIMING, sut.issue_ns, sut.timing, sut.errors)


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
