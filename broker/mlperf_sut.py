"""LoadGen's two interfaces over the bus: the sample library and the system under test.

```
LoadGen thread ── load_samples / unload_samples ── ctl request ──► agent's sample library
LoadGen thread ── issue_query(samples): chunks of <= batch_size samples, <= window in
                  flight, written to the run's query link ──► agent
link's reader ◄── reply (outputs, agent times) ◄── agent (SamplesQuery / QueryReply)
      └── QuerySamplesComplete, then the waiting chunks the answer made room for
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

LoadGen runs in its own thread (``StartTest`` releases the GIL). Its queries go out
on a :class:`mlscope.querylink.QueryLink` of the run's own, as the load generator's do
(no hop to the event loop on the way out or back): LoadGen's thread writes what it
issues, the link's reader completes each answered chunk and sends the chunks waiting
for room, both under one lock; LoadGen hears of completed samples outside it. The
event loop answers LoadGen's sample-library calls and, each second, fails chunks
unanswered for REPLY_TIMEOUT_S or refused by the server.

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
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from mlscope import bus as busmod
from mlscope import codec, wire
from mlscope.bus import Bus, request
from mlscope.contracts import (
    MLPerfSpec,
    SamplesLoadOp,
    SamplesUnloadOp,
)
from mlscope.errors import BusError, MLScopeError
from mlscope.lifeline import end_with_parent
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
from mlscope.querylink import QueryLink
from mlscope.settings import Settings
from mlscope.tuning import ProcessTuning

__all__ = ["AgentSUT", "main"]

now = time.perf_counter_ns
SAMPLES_TIMEOUT_S = 300.0
"""How long the agent may take to load (read and pre-process) the samples LoadGen names."""
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
    link: QueryLink
    """The run's own connection for its queries (replies arrive at its inbox)."""
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
        self._lock = threading.Lock()  # LoadGen's issue thread, the link's reader, expiry
        self._backlog: deque[_Chunk] = deque()
        self._inflight: dict[int, _Chunk] = {}
        self._next = 0
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
        """LoadGen's issue: its chunks go out on the link from this thread, at once,
        while fewer than ``window`` are in flight; the rest wait for answers."""
        t = now()
        items = [(int(s.id), int(s.index)) for s in samples]
        with self._lock:
            q = len(self.issue_ns)
            self.issue_ns.append(t)
            for start in range(0, len(items), self.batch_size):
                self._backlog.append(_Chunk(q, start, items[start : start + self.batch_size]))
            done = self._pump()
        self._respond(done)

    # ------------------------------------------------------------- the link's reader

    def on_reply(self, payload: bytes, t: int) -> None:
        """One reply that arrived at ``t`` (on the link's reader thread): its chunk's
        samples complete, and waiting chunks take its place. What cannot be read as a
        reply raises before it touches a chunk (the link counts it; the chunk waits for
        its real answer)."""
        reply = wire.read_reply(payload)
        with self._lock:
            chunk = self._inflight.get(reply.index)
            if chunk is not None:
                reply = reply.within(t - chunk.sent_ns)
            answer = (reply.outputs, reply.agent_ns) if reply.ok else None
            done = [self._complete(reply.index, answer, reply.error)]
            done += self._pump()
        self._respond(done)

    def fail_outstanding(self, why: str) -> None:
        """Every chunk in flight or waiting fails with ``why`` (the link is gone)."""
        with self._lock:
            done = [self._complete(i, None, why) for i in list(self._inflight)]
            while self._backlog:
                done.append(self._settle(self._backlog.popleft(), None, why))
        self._respond(done)

    def expire(self, timeout_s: float = REPLY_TIMEOUT_S) -> None:
        """Chunks unanswered for ``timeout_s`` fail; waiting ones take their place."""
        limit = now() - int(timeout_s * 1e9)
        with self._lock:
            late = [i for i, c in self._inflight.items() if c.sent_ns < limit]
            done = [self._complete(i, None, f"no reply within {timeout_s:g} s") for i in late]
            done += self._pump()
        self._respond(done)

    # ------------------------------------------------------------- under the lock

    def _pump(self) -> list[_Done]:
        """Send waiting chunks while fewer than ``window`` are in flight; what could
        not be sent is answered with why."""
        done: list[_Done] = []
        link = self.link
        while self._backlog and len(self._inflight) < self.window:
            chunk = self._backlog.popleft()
            if link.error is not None:
                done.append(self._settle(chunk, None, f"not sent: {link.error}"))
                continue
            i = self._next
            self._next += 1
            samples = np.fromiter((idx for _, idx in chunk.items), np.int64, len(chunk.items))
            query = wire.encode_samples_query(self.evaluation_id, i, samples)
            chunk.sent_ns = now()
            self._inflight[i] = chunk
            try:
                link.send(link.frame(self.agent_subjects[0], query))
            except BusError as exc:  # the bus is unreachable: these samples are lost
                done.append(self._complete(i, None, f"not sent: {exc}"))
        return done

    def _complete(self, i: int, answer: _Answer | None, error: str) -> _Done:
        chunk = self._inflight.pop(i, None)
        if chunk is None:
            return [], []  # not ours, or a duplicate
        return self._settle(chunk, answer, error)

    def _settle(self, chunk: _Chunk, answer: _Answer | None, error: str) -> _Done:
        """Record a chunk's outcome (``answer``: the agent's outputs and times, None
        when it failed with ``error``); return LoadGen's responses and the arrays they
        point into (alive until LoadGen has copied them)."""
        ranks, agent = None, (0, 0, 0, 0)
        if answer is not None:
            outputs, agent = answer
            try:
                ranks = rankings(outputs, len(chunk.items))
            except Exception:  # whatever hostile outputs hold fails only their chunk
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
        return responses, keep

    # ------------------------------------------------------------- outside the lock

    def _respond(self, done: list[_Done]) -> None:
        """Hand LoadGen its completed samples (never under our lock: LoadGen may hold
        its own while it calls issue_query)."""
        for responses, keep in done:
            if responses:
                self.lg.QuerySamplesComplete(responses)  # copies the data before it returns
            del keep

    def check(self) -> None:
        """Raise what made the run meaningless (LoadGen's misuse of its library, or
        the bus refusing the queries)."""
        if self._failure is not None:
            raise self._failure
        if self.link.error is not None:
            raise BusError(f"the bus refused the run's queries: {self.link.error}")


_Done = tuple[list[Any], list[np.ndarray]]
"""LoadGen's responses for one chunk, and the arrays they point into."""
_Answer = tuple[Any, tuple[int, int, int, int]]
"""An agent's outputs for a chunk, and its received / predict / replied times."""


async def _watch(sut: AgentSUT, link: QueryLink) -> None:
    """Each second: chunks past REPLY_TIMEOUT_S fail, and once the server refuses the
    link's queries, everything outstanding fails with its words (until cancelled)."""
    while True:
        await anyio.sleep(1.0)
        if link.error is not None:
            sut.fail_outstanding(f"the bus refused the query: {link.error}")
        sut.expire()


async def run_test(bus: Bus, lg: Any, cfg: dict[str, Any]) -> AgentSUT:
    """One LoadGen test in a worker thread; its queries go out on a query link of
    their own and the link's reader completes them."""
    spec = MLPerfSpec.model_validate(cfg["spec"])
    work = Path(cfg["workdir"])
    evaluation_id = cfg["evaluation_id"]
    inbox = bus.nc.new_inbox()  # under this connection's role's inbox prefix
    link = await anyio.to_thread.run_sync(
        lambda: QueryLink.open(
            bus.server_url(), bus.options, inbox=inbox, name=f"mlscope mlperf {evaluation_id}"
        )
    )
    sut = AgentSUT(
        bus, lg, link, (cfg["subject"], cfg["ctl"]), evaluation_id, spec.batch_size, spec.window
    )
    ts = test_settings(lg, spec, cfg["conf_model"], work, samples=int(cfg["samples"]))
    # The same conditions as mlscope's own pacer (broker/loadgen.py), so the two load
    # generators can be compared: LoadGen's issue thread gets the GIL the moment it
    # wakes (not after a 5 ms switch interval), no GC pause holds it, and it runs in
    # SCHED_FIFO like the pacer thread (mlscope.mlperf.start_test), the link's reader
    # too (no effect without CAP_SYS_NICE). The event loop only answers LoadGen's
    # sample-library calls. This process runs one test, then exits.
    try:
        link.start(sut.on_reply)
        with ProcessTuning().measurement(realtime_loop=False):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_watch, sut, link)
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
    finally:
        link.close()
    link.report()
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
    end_with_parent(cfg["parent_pid"])  # a killed server leaves no test running
    try:
        anyio.run(_child, cfg, backend="asyncio")
    except MLScopeError as exc:  # the parent raises it again, fields intact
        (Path(cfg["workdir"]) / ERROR).write_text(json.dumps(exc.to_wire(), default=str))
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
