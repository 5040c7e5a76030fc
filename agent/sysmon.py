"""System-level sampling on the agent (trace level ``system`` and above).

One sampler thread per agent, running only while at least one evaluation at level
``system`` or more is prepared. Every ``interval_s`` it reads, with psutil:

- ``cpu.util`` per core (device ``cpuN``) and overall (``all``), percent;
- ``cpu.freq_mhz`` per core where the kernel reports frequencies;
- ``proc.rss_bytes``, ``proc.threads``, ``proc.cpu`` (percent, may exceed 100)
  for the agent process;
- ``gpu.util``, ``gpu.mem_used_bytes``, ``gpu.power_w``, ``gpu.sm_clock_mhz`` per
  GPU through NVML, when ``pynvml`` imports and finds a driver (else silently none);

and, when Linux ``perf`` is installed and allowed (``perf_event_paranoid``), a
``perf stat -I`` child on the agent process adds ``perf.<event>`` counters
(task-clock, context switches, user cycles and instructions) at the same interval.

Samples carry the agent's monotonic clock, like spans, and go into a
:class:`~agent.tracer.SampleBuffer` of every watched evaluation.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

__all__ = ["PERF_EVENTS", "RssWatch", "Sampler", "give_back_free_memory"]

log = logging.getLogger(__name__)
now = time.perf_counter_ns
PERF_EVENTS = ("task-clock", "context-switches", "cycles:u", "instructions:u")

Sink = Callable[[int, str, str, float], None]


class Sampler:
    """Samples the machine and this process into the sinks of watched evaluations."""

    def __init__(self, *, interval_s: float = 0.1, perf: bool = True) -> None:
        self.interval_s = interval_s
        self.use_perf = perf
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._perf: subprocess.Popen[str] | None = None
        self._proc = psutil.Process(os.getpid())
        self._nvml: Any = None
        self.samples = 0

    # ------------------------------------------------------------------ control

    def watch(self, key: str, sink: Sink) -> None:
        with self._lock:
            self._sinks[key] = sink
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="sysmon", daemon=True)
                self._thread.start()

    def unwatch(self, key: str) -> None:
        with self._lock:
            self._sinks.pop(key, None)
            thread = self._thread if not self._sinks else None
            if thread is not None:
                self._thread = None
                self._stop.set()
        if thread is not None:
            thread.join(timeout=5)

    def close(self) -> None:
        with self._lock:
            keys = list(self._sinks)
        for key in keys:
            self.unwatch(key)

    # ------------------------------------------------------------------ sampling

    def _emit(self, ts: int, metric: str, device: str, value: float) -> None:
        with self._lock:
            sinks = list(self._sinks.values())
        for sink in sinks:
            sink(ts, metric, device, float(value))
        self.samples += 1

    def _run(self) -> None:
        self._nvml = open_nvml()
        perf = self._start_perf() if self.use_perf else None
        psutil.cpu_percent(percpu=True)  # the first call only sets the baseline
        self._proc.cpu_percent()
        try:
            while not self._stop.wait(self.interval_s):
                self.sample_once()
        finally:
            if perf is not None:
                perf.terminate()
                try:
                    perf.wait(5)
                except subprocess.TimeoutExpired:
                    perf.kill()
            if self._nvml is not None:
                self._nvml.nvmlShutdown()

    def sample_once(self) -> None:
        ts = now()
        per_core = psutil.cpu_percent(percpu=True)
        for i, v in enumerate(per_core):
            self._emit(ts, "cpu.util", f"cpu{i}", v)
        if per_core:
            self._emit(ts, "cpu.util", "all", sum(per_core) / len(per_core))
        try:
            freqs = psutil.cpu_freq(percpu=True) or []
        except (OSError, NotImplementedError):
            freqs = []
        for i, f in enumerate(freqs):
            self._emit(ts, "cpu.freq_mhz", f"cpu{i}", f.current)
        with self._proc.oneshot():
            self._emit(ts, "proc.rss_bytes", "proc", self._proc.memory_info().rss)
            self._emit(ts, "proc.threads", "proc", self._proc.num_threads())
            self._emit(ts, "proc.cpu", "proc", self._proc.cpu_percent())
        if self._nvml is not None:
            self._sample_gpus(ts)

    def _sample_gpus(self, ts: int) -> None:
        nv = self._nvml
        try:
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                dev = f"gpu{i}"
                self._emit(ts, "gpu.util", dev, nv.nvmlDeviceGetUtilizationRates(h).gpu)
                self._emit(ts, "gpu.mem_used_bytes", dev, nv.nvmlDeviceGetMemoryInfo(h).used)
                self._emit(ts, "gpu.power_w", dev, nv.nvmlDeviceGetPowerUsage(h) / 1000.0)
                self._emit(
                    ts, "gpu.sm_clock_mhz", dev, nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
                )
        except Exception as exc:  # NVML errors are their own class tree; stop asking
            log.warning("NVML sampling failed, GPU samples stop: %s", exc)
            self._nvml = None

    # ------------------------------------------------------------------ perf stat

    def _start_perf(self) -> subprocess.Popen[str] | None:
        exe = shutil.which("perf")
        if exe is None:
            log.info("perf not installed: no hardware counters")
            return None
        ms = max(10, int(self.interval_s * 1000))
        cmd = [
            exe,
            "stat",
            "-x",
            ",",
            "-I",
            str(ms),
            "-e",
            ",".join(PERF_EVENTS),
            "-p",
            str(os.getpid()),
        ]
        try:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
            )
        except OSError as exc:
            log.info("perf stat did not start: %s", exc)
            return None
        threading.Thread(
            target=self._read_perf, args=(proc,), name="sysmon-perf", daemon=True
        ).start()
        return proc

    def _read_perf(self, proc: subprocess.Popen[str]) -> None:
        if proc.stderr is None:  # started without a pipe: nothing to read
            return
        for line in proc.stderr:
            parsed = parse_perf_line(line)
            if parsed is not None:
                self._emit(now(), f"perf.{parsed[0]}", "proc", parsed[1])


def parse_perf_line(line: str) -> tuple[str, float] | None:
    """``time,value,unit,event,...`` (``perf stat -x, -I``) -> (event, value)."""
    parts = line.strip().split(",")
    if len(parts) < 4:
        return None
    try:
        value = float(parts[1])
    except ValueError:  # "<not supported>", "<not counted>", a header or an error text
        return None
    event = parts[3].split(":")[0]
    return (event, value) if event else None


def open_nvml() -> Any:
    try:
        import pynvml  # type: ignore[import-not-found, unused-ignore]

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # not installed, no driver, no GPU: no GPU samples
        return None


class RssWatch:
    """The agent process's resident memory over each prepared evaluation, at every
    trace level: RSS when it was prepared, the highest RSS seen while it ran, RSS when
    it was released.

    One thread reads the RSS (psutil: ``/proc/self/statm`` on Linux, a few µs) every
    ``interval_s`` while any evaluation is watched, so a peak shorter than the
    interval can be missed; on Linux the kernel's own high-water mark (``VmHWM``) is
    folded in while it is above the start, which catches such peaks when the process
    never went that high before. Evaluations prepared at once share one process, so
    each one's figures include what the others use.

    When no other evaluation is watched, the C allocator's free memory goes back to
    the system (:func:`give_back_free_memory`) before the RSS at prepare and at release
    is read: glibc keeps what a run freed for reuse (hundreds of MB after a run of
    millions of queries), and the growth would count it as kept by the run.
    """

    def __init__(self, *, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self._proc = psutil.Process(os.getpid())
        self._lock = threading.Lock()
        self._watched: dict[str, list[int]] = {}  # key -> [start, peak, hwm at start]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def start(self, key: str) -> None:
        """Start watching ``key`` (a second start keeps the first baseline)."""
        with self._lock:
            alone = not self._watched
        if alone:  # another evaluation's run is not slowed by it
            give_back_free_memory()
        rss = self.rss()
        with self._lock:
            if key in self._watched:
                return
            self._watched[key] = [rss, rss, _high_water_mark() or 0]
            if self._thread is None:
                self._stop.clear()
                self._thread = threading.Thread(target=self._run, name="rss", daemon=True)
                self._thread.start()

    def stop(self, key: str) -> tuple[int, int, int] | None:
        """(start, peak, end) RSS in bytes of ``key``; None when it was not watched."""
        hwm = _high_water_mark()
        with self._lock:
            got = self._watched.pop(key, None)
            alone = not self._watched
            thread = self._thread if alone else None
            if thread is not None:
                self._thread = None
                self._stop.set()
        if thread is not None:
            thread.join(timeout=5)
        if got is None:
            return None
        if alone:
            give_back_free_memory()
        end = self.rss()
        start, peak, hwm0 = got
        if hwm is not None and hwm > hwm0:  # a new high for the process: during this run
            peak = max(peak, hwm)
        return start, max(peak, end), end

    def close(self) -> None:
        """Stop watching every evaluation (the agent is stopping; none is released)."""
        with self._lock:
            self._watched.clear()
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not None:
            thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            rss = self.rss()
            with self._lock:
                for v in self._watched.values():
                    v[1] = max(v[1], rss)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc: its allocator keeps no such memory
        return None
    return trim


_MALLOC_TRIM = _malloc_trim()


def give_back_free_memory() -> None:
    """Hand the C allocator's free pages back to the system (glibc's ``malloc_trim``;
    nothing elsewhere): what the process still holds is then what its RSS shows. It
    walks the heap (milliseconds for a large one): called outside any measurement."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _high_water_mark() -> int | None:
    """The process's peak RSS so far (Linux ``VmHWM``), bytes; None elsewhere."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
