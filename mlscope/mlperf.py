"""What both places that run MLPerf LoadGen share: the server's child process
(``python -m broker.mlperf_sut``, placement server) and the agent's
(``python -m agent.mlperf_local``, placement agent).

Each runs one LoadGen test per process (LoadGen keeps process-wide state), with the
settings built here (:func:`test_settings`), started here (:func:`start_test`), and
leaves in its work directory LoadGen's logs and what its system under test saw of each
sample (:data:`TIMING`, written by :func:`save_timing`); a typed error that ended it
goes to :data:`ERROR`. ``mlperf_loadgen`` is imported only by :func:`load_loadgen`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlscope.contracts import MLPerfSpec
from mlscope.errors import ConfigError, FrameworkUnavailable
from mlscope.pacer import REALTIME_PRIORITY

__all__ = [
    "ERROR",
    "TIMING",
    "SampleTiming",
    "load_loadgen",
    "rankings",
    "save_timing",
    "start_test",
    "test_settings",
]

TIMING = "sut-timing.npz"
"""What the system under test saw (written by :func:`save_timing`)."""
ERROR = "error.json"
"""The typed error (``MLScopeError.to_wire()``) that ended a LoadGen process."""


@dataclass
class SampleTiming:
    """What the SUT saw of one sample (agent times on the agent's clock, ns)."""

    agent: tuple[int, int, int, int] = (0, 0, 0, 0)
    ok: bool = False
    prediction: int = -1
    error: str = ""


def rankings(outputs: Any, n: int) -> np.ndarray | None:
    """Per sample, the predicted classes best first (int64): the post-processed indices
    when the model returns class indices, else the argmax of its output."""
    if not isinstance(outputs, np.ndarray) or outputs.size == 0 or outputs.shape[0] != n:
        return None
    rows = outputs.reshape(n, -1)
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
    path: Path,
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
