"""What both places that run MLPerf LoadGen share: the server's child process
(``python -m broker.mlperf_sut``, placement server) and the agent's
(``python -m agent.mlperf_local``, placement agent).

Each runs one LoadGen test per process (LoadGen keeps process-wide state), with the
settings built here (:func:`test_settings`), started here (:func:`start_test`), and
leaves in its work directory LoadGen's logs and what its system under test saw of each
sample (:data:`TIMING`, written by :func:`save_timing`, read back by
:func:`load_timing`); a typed error that ended it goes to :data:`ERROR`.
``mlperf_loadgen`` is imported only by :func:`load_loadgen`.
"""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from mlscope import codec
from mlscope.bounded import npz_headers
from mlscope.contracts import MAX_MLPERF_FILE_BYTES, MAX_SCHEDULED_QUERIES, MLPerfSpec
from mlscope.errors import ConfigError, EvaluationError, FrameworkUnavailable
from mlscope.pacer import REALTIME_PRIORITY

__all__ = [
    "ERROR",
    "MAX_CLASS",
    "MAX_LOADGEN_SAMPLES",
    "TIMING",
    "SampleTiming",
    "generated_samples",
    "load_loadgen",
    "load_timing",
    "rankings",
    "save_timing",
    "start_test",
    "test_settings",
]

TIMING = "sut-timing.npz"
"""What the system under test saw (written by :func:`save_timing`)."""
ERROR = "error.json"
"""The typed error (``MLScopeError.to_wire()``) that ended a LoadGen process."""
MAX_CLASS = 2**31 - 1
"""Largest class index a prediction may name (predictions are stored as Int32)."""
MAX_LOADGEN_SAMPLES = MAX_SCHEDULED_QUERIES
"""Most samples one LoadGen test may generate: LoadGen builds every query of a test
before it issues the first (measured here: ~210 bytes a sample for Offline, ~350 a
query for Server), so settings asking for more are refused before it starts, as
mlscope's own schedules are."""


@dataclass
class SampleTiming:
    """What the SUT saw of one sample (agent times on the agent's clock, ns)."""

    agent: tuple[int, int, int, int] = (0, 0, 0, 0)
    ok: bool = False
    prediction: int = -1
    error: str = ""


def rankings(outputs: Any, n: int) -> np.ndarray | None:
    """Per sample, the predicted classes best first (int64): the post-processed indices
    when the model returns class indices, else the argmax of its output. None when the
    outputs are not that, among them a class index past :data:`MAX_CLASS` (stored as
    an Int32 prediction: one hostile reply must fail its samples, not the stored run)."""
    if not isinstance(outputs, np.ndarray) or outputs.size == 0 or outputs.shape[0] != n:
        return None
    rows = outputs.reshape(n, -1)
    if np.issubdtype(rows.dtype, np.integer):
        if rows.min() < -MAX_CLASS - 1 or rows.max() > MAX_CLASS:
            return None
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


def test_settings(lg: Any, spec: MLPerfSpec, model: str, workdir: Path, *, samples: int) -> Any:
    """LoadGen's TestSettings: its mlperf.conf (or the job's), the user.conf, the flags;
    refused (ConfigError) when the test they ask for would generate more than
    :data:`MAX_LOADGEN_SAMPLES` samples (``samples``: the sample library's size)."""
    ts = _conf_settings(lg, spec, model, workdir)
    if spec.target_qps is not None:
        if spec.scenario == "Server":
            ts.server_target_qps = spec.target_qps
        elif spec.scenario == "Offline":
            ts.offline_expected_qps = spec.target_qps
    if spec.seed is not None:
        ts.qsl_rng_seed = ts.sample_index_rng_seed = ts.schedule_rng_seed = spec.seed
    expected = generated_samples(lg, ts, samples)
    if expected > MAX_LOADGEN_SAMPLES:
        raise ConfigError(
            f"LoadGen would generate about {expected:.3g} samples for these settings, "
            f"over the {MAX_LOADGEN_SAMPLES:,} one test may have: lower the target QPS, "
            "the minimum duration or the minimum query count",
            field="target_qps",
            limit=MAX_LOADGEN_SAMPLES,
        )
    return ts


def _conf_settings(lg: Any, spec: MLPerfSpec, model: str, workdir: Path) -> Any:
    """TestSettings from the scenario, the mode and the conf files (LoadGen's order)."""
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
    return ts


def generated_samples(lg: Any, ts: Any, samples: int) -> float:
    """About how many samples LoadGen generates up front for ``ts`` with a library of
    ``samples``, as its ``GenerateQueries`` and ``TestSettingsInternal`` compute them
    (the loaded set is counted too: LoadGen allocates it, and pads with it).

    * accuracy mode, or ``performance_issue_unique`` / ``_same``: the library (or the
      loaded set, when larger) once;
    * Offline: one query of max(min_query_count, 1.1 x min_duration x expected QPS);
    * Server: max(min_query_count, min_duration x target QPS) queries of one sample;
    * SingleStream / MultiStream: max(min_query_count, 2 x min_duration / expected
      latency) queries, of ``multi_stream_samples_per_query`` in MultiStream.

    An expected latency of 0 asks for an endless generation: infinity."""
    loaded = float(ts.performance_sample_count_override or samples)
    unique = ts.performance_issue_unique or ts.performance_issue_same
    if ts.mode == lg.TestMode.AccuracyOnly or unique:
        return max(loaded, float(samples)) + loaded
    seconds = float(ts.min_duration_ms) / 1e3
    scenario, least = ts.scenario, float(ts.min_query_count)
    if scenario == lg.TestScenario.Offline:
        return max(least, 1.1 * seconds * float(ts.offline_expected_qps)) + loaded
    if scenario == lg.TestScenario.Server:
        return max(least, seconds * float(ts.server_target_qps)) + loaded
    if scenario == lg.TestScenario.SingleStream:
        latency, per_query = ts.single_stream_expected_latency_ns, 1
    else:
        latency, per_query = ts.multi_stream_expected_latency_ns, ts.multi_stream_samples_per_query
    rate = 1e9 / latency if latency > 0 else math.inf
    return max(least, 2 * seconds * rate) * float(per_query) + loaded


def start_test(
    lg: Any,
    *,
    issue: Callable[[list[Any]], None],
    samples: int,
    load: Callable[[list[int]], None],
    unload: Callable[[list[int]], None],
    settings: Any,
    logdir: str,
    workdir: Path,
) -> None:
    """One LoadGen test, in the calling (worker) thread: the SUT and the
    QuerySampleLibrary (``samples`` in it, all of them its performance set) are
    constructed, the test runs with the trace log on, both are destroyed.

    The thread runs SCHED_FIFO while LoadGen creates its own threads, which inherit
    that policy (pthreads' default), as mlscope's pacer thread runs (no effect
    without CAP_SYS_NICE)."""
    log = lg.LogSettings()
    log.log_output.outdir = logdir
    log.log_output.copy_summary_to_stdout = False
    log.enable_trace = True  # the per-sample records
    sut = lg.ConstructSUT(issue, lambda: None)  # nothing is held back: no flush
    qsl = lg.ConstructQSL(samples, samples, load, unload)
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))
        realtime = True
    except OSError:
        realtime = False
    try:
        lg.StartTestWithLogSettings(sut, qsl, settings, log, str(workdir / "audit.config"))
    finally:
        if realtime:
            os.sched_setscheduler(0, policy, param)
        lg.DestroyQSL(qsl)
        lg.DestroySUT(sut)


def save_timing(
    path: Path | BinaryIO,
    issue_ns: list[int],
    timing: dict[tuple[int, int], SampleTiming],
    errors: int,
) -> None:
    """What the SUT saw: its clock at each LoadGen query's issue, and per sample
    (query sequence, position in the query) its agent times, outcome and prediction."""
    keys = sorted(timing)
    rows = [timing[k] for k in keys]
    np.savez(
        path,
        issue_ns=np.asarray(issue_ns, np.int64),
        key=np.asarray(keys, np.int64).reshape(-1, 2),
        agent=np.asarray([t.agent for t in rows], np.int64).reshape(-1, 4),
        ok=np.asarray([t.ok for t in rows], bool),
        prediction=np.asarray([t.prediction for t in rows], np.int64),
        error=np.asarray([t.error for t in rows], dtype=str),
        errors=errors,
    )


_TIMING_LAYOUT: dict[str, tuple[str, tuple[int, ...] | None]] = {
    "issue_ns": ("i", (-1,)),
    "key": ("i", (-2, 2)),
    "agent": ("i", (-2, 4)),
    "ok": ("b", (-2,)),
    "prediction": ("i", (-2,)),
    "error": ("U", (-2,)),
    "errors": ("i", None),
}
"""Each array of :data:`TIMING` (:func:`save_timing`): its dtype kind and shape, -1
standing for the queries LoadGen issued, -2 for the samples the SUT saw, None a
scalar."""


def load_timing(source: Path | BinaryIO) -> dict[str, np.ndarray]:
    """What :func:`save_timing` wrote, each array's header checked before any is
    read: the file may come from an agent, and a small compressed member can claim
    gigabytes (EvaluationError when it is not what ``save_timing`` writes)."""
    try:
        with np.load(source) as z:
            headers = npz_headers(z)
            _check_timing(headers)
            timing: dict[str, np.ndarray] = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise EvaluationError(f"{TIMING} is not what a LoadGen run writes: {exc}"[:300]) from exc
    predicted = timing["prediction"]
    if predicted.size and (predicted.min() < -MAX_CLASS - 1 or predicted.max() > MAX_CLASS):
        raise EvaluationError(f"{TIMING} holds a prediction past class {MAX_CLASS}")
    return timing


def _check_timing(headers: dict[str, tuple[tuple[int, ...], np.dtype[Any]]]) -> None:
    """The layout of :data:`_TIMING_LAYOUT`, one sample count throughout, and no more
    than :data:`MAX_LOADGEN_SAMPLES` samples nor ``MAX_MLPERF_FILE_BYTES`` read."""
    if set(headers) != set(_TIMING_LAYOUT):
        raise EvaluationError(f"{TIMING} has arrays {sorted(headers)[:20]}")
    counts: dict[int, int] = {}
    size = 0
    for name, (kind, layout) in _TIMING_LAYOUT.items():
        shape, dtype = headers[name]
        ok = dtype.kind == kind and (layout is None) == (shape == ())
        ok = ok and (dtype.kind != "U" or dtype.itemsize <= 4 * codec.MAX_ERROR_CHARS)
        for want, got in zip(layout or (), shape, strict=False):
            ok = ok and (got == want if want >= 0 else counts.setdefault(want, got) == got)
        ok = ok and len(shape) == len(layout or ()) and max(shape, default=0) <= MAX_LOADGEN_SAMPLES
        if not ok:
            raise EvaluationError(f"{TIMING}: array {name} is {dtype} {shape}")
        size += math.prod(shape) * dtype.itemsize
    if size > MAX_MLPERF_FILE_BYTES:
        raise EvaluationError(f"{TIMING} holds {size:,} bytes of arrays, over its limit")
