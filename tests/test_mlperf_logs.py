"""MLPerf LoadGen's logs read by ``mlscope import mlperf`` (``broker/mlperf_logs.py``):
what a log can say that no run produces is refused by file and key, never stored as a
result. Fast: no stack, no LoadGen run (``tests/test_mlperf.py`` has those).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from broker import mlperf_logs as logs
from cli.mlperf_cmd import import_job
from mlscope.contracts import IMPORT_ID_HEX, IMPORT_IDENTITY_LOGS, JobRequest, evaluation_id_for
from mlscope.errors import ConfigError
from mlscope.hashing import sha256_path


def test_malformed_logs_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        logs.parse_detail(":::MLLOG {not json\n")
    with pytest.raises(ConfigError):
        logs.parse_detail("no records at all")
    with pytest.raises(ConfigError):
        logs.accuracy_entries('[{"qsl_idx": 1, "data": "zz"}]')
    with pytest.raises(ConfigError):
        logs.trace_samples('{"name":"Sample","cat":"default","ph":"b","ts":"x","args":{}},')
    (tmp_path / logs.SUMMARY).write_text("")
    with pytest.raises(ConfigError):
        import_job(tmp_path, model=None, framework="mlperf", system=None)


def _detail(**values: Any) -> str:
    base = {"effective_scenario": "Server", "effective_test_mode": "PerformanceOnly"}
    return "".join(
        f":::MLLOG {json.dumps({'key': k, 'value': v})}\n" for k, v in {**base, **values}.items()
    )


def _sample(**change: Any) -> str:
    ev: dict[str, Any] = {
        "name": "Sample",
        "ph": "b",
        "ts": 10.0,
        "args": {
            "sample_seq": 0,
            "query_seq": 0,
            "sample_idx": 0,
            "issue_start_ns": 5,
            "complete_ns": 900,
        },
    }
    ev["args"].update({k: v for k, v in change.items() if k != "ts"})
    if "ts" in change:
        ev["ts"] = change["ts"]
    return json.dumps(ev, separators=(",", ":")) + ",\n"


@pytest.mark.parametrize(
    "detail",
    [
        _detail(**{"result_99.00_percentile_latency_ns": float("nan")}),
        _detail(**{"result_99.00_percentile_latency_ns": float("inf")}),
        _detail(**{"result_99.00_percentile_latency_ns": -5_000_000}),
        _detail(**{"result_99.00_percentile_latency_ns": "abc"}),
        _detail(**{"result_99.00_percentile_latency_ns": None}),
        _detail(**{"result_99.00_percentile_latency_ns": 2**70}),
        _detail(num_errors="x"),
        _detail(num_errors=-3),
        _detail(result_query_count=2**70),
        _detail(result_scheduled_samples_per_sec=float("nan")),
        _detail(result_completed_samples_per_sec=-1.0),
        _detail(result_completed_samples_per_sec="fast"),
        _detail(effective_target_qps=float("inf")),
        _detail(result_anything=float("-inf")),
        ":::MLLOG " + "[" * 100_000 + "]" * 100_000 + "\n",
        ":::MLLOG [1, 2]\n",
    ],
)
def test_impossible_numbers_in_a_detail_log_are_refused_by_name(detail: str) -> None:
    """LoadGen's numbers are taken as written, so what no run can produce (negative,
    NaN, infinite, past Int64, not a number) is refused, never stored as a result."""
    with pytest.raises(ConfigError, match=logs.DETAIL):
        logs.parse_result("", detail)


@pytest.mark.parametrize(
    "line",
    [
        _sample(ts=1e400),
        _sample(ts=1e20),
        _sample(ts=-1.0),
        _sample(sample_seq=2**63),
        _sample(complete_ns=-900),
        _sample(complete_ns=2**63 - 1),
        _sample(issue_start_ns=True),
        '{"name":"Sample","ph":"b",' + '"x":' + "[" * 5000 + "]" * 5000 + "},\n",
    ],
)
def test_impossible_times_in_a_trace_are_refused(line: str) -> None:
    assert len(logs.trace_samples(_sample())) == 1  # the same event, well formed
    with pytest.raises(ConfigError, match=logs.TRACE):
        logs.trace_samples(line)


def test_accuracy_entries_that_name_no_sample_are_refused() -> None:
    labels = np.array([1, 2, 0])
    one = np.int64(1).tobytes().hex()
    for doc in (
        f'[{{"qsl_idx": -1, "data": "{one}"}}]',
        f'[{{"qsl_idx": 1e400, "data": "{one}"}}]',
        "[" * 100_000 + "]" * 100_000,
    ):
        with pytest.raises(ConfigError, match=logs.ACCURACY):
            logs.accuracy_entries(doc)
    with pytest.raises(ConfigError, match="past the data set"):
        logs.imagenet_top1(logs.accuracy_entries(f'[{{"qsl_idx": 3, "data": "{one}"}}]'), labels)
    with pytest.raises(ConfigError, match="not whole"):
        logs.imagenet_top1([(0, b"\x01\x02\x03")], labels)


def test_an_import_sizes_the_logs_before_it_reads_them(tmp_path: Path) -> None:
    """A trace too large for the job is left out unread, and summary and detail logs
    too large are refused by name, whatever their size (1 TiB, sparse: reading one
    would fail for memory)."""
    (tmp_path / logs.SUMMARY).write_text("Scenario : Server\n")
    (tmp_path / logs.DETAIL).write_text(_detail(**{"result_99.00_percentile_latency_ns": 5}))
    with (tmp_path / logs.TRACE).open("wb") as fh:
        fh.truncate(1 << 40)
    job = import_job(tmp_path, model="m", framework="mlperf", system=None)
    assert job.mlperf_import is not None
    assert set(job.mlperf_import.files) == {logs.SUMMARY, logs.DETAIL}
    with (tmp_path / logs.DETAIL).open("wb") as fh:
        fh.truncate(1 << 40)
    with pytest.raises(ConfigError, match="exceed"):
        import_job(tmp_path, model="m", framework="mlperf", system=None)


def test_an_import_outside_a_results_tree_needs_its_model_named(tmp_path: Path) -> None:
    """The model of a directory that is no ``<system>/<model>/<Scenario>/...`` tree is
    not guessed from its name (``mlscope mlperf --output results/server`` then
    ``import`` stored a model called "server"); in a tree it is the tree's."""
    run = tmp_path / "results" / "server"
    run.mkdir(parents=True)
    (run / logs.SUMMARY).write_text("Scenario : Server\n")
    (run / logs.DETAIL).write_text(_detail(**{"result_99.00_percentile_latency_ns": 5}))
    with pytest.raises(ConfigError, match="name its model with --model"):
        import_job(run, model=None, framework="mlperf", system=None)
    assert (
        import_job(run, model="digits_cnn", framework="mlperf", system=None).model == "digits_cnn"
    )
    tree = tmp_path / "box" / "digits_cnn" / "Server" / "performance" / "run_1"
    tree.mkdir(parents=True)
    for f in (logs.SUMMARY, logs.DETAIL):
        (tree / f).write_text((run / f).read_text())
    job = import_job(tree, model=None, framework="mlperf", system=None)
    assert job.model == "digits_cnn" and job.mlperf_import is not None
    assert job.mlperf_import.system == "box"


def test_checker_counts_each_sample_once() -> None:
    one, two = np.int64(1).tobytes(), np.int64(2).tobytes()
    entries = [(0, one), (1, one), (0, two), (2, b"")]
    assert logs.imagenet_top1(entries, np.array([1, 2, 0])) == (1, 3)
    assert logs.format_accuracy(1, 3) == "accuracy=33.333%, good=1, total=3\n"


# --------------------------------------------------------------------------- identity


def _run_dir(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / logs.SUMMARY).write_text("Scenario : Server\n")
    (root / logs.DETAIL).write_text(_detail(**{"result_99.00_percentile_latency_ns": 5}))
    return root


def test_an_imported_run_is_its_summary_and_detail_logs(tmp_path: Path) -> None:
    """The evaluation an import is stored as follows from the two logs LoadGen writes
    for every run, and from nothing else: not the path, system, model or framework it
    is imported with, nor the trace and accuracy logs that may come with it; one
    changed character in either log is another run."""
    assert IMPORT_IDENTITY_LOGS == logs.REQUIRED  # the logs every import carries
    first = _run_dir(tmp_path / "box" / "digits_cnn" / "Server" / "performance" / "run_1")
    ev = import_job(first, model=None, framework="mlperf", system=None).evaluation_id()
    assert ev.startswith("ev-") and len(ev) == 3 + IMPORT_ID_HEX
    copy = tmp_path / "elsewhere" / "run"
    shutil.copytree(first, copy)
    (copy / logs.TRACE).write_text(_sample())
    (copy / logs.ACCURACY).write_text("[]")
    job = import_job(copy, model="other", framework="onnxruntime", system="rack-2")
    assert job.mlperf_import is not None and set(job.mlperf_import.files) == set(logs.LOG_FILES)
    assert job.evaluation_id() == ev
    assert job.mlperf_import.source != str(first.resolve())
    for name, was, now in ((logs.SUMMARY, "Server", "server"), (logs.DETAIL, ": 5}", ": 6}")):
        changed = tmp_path / f"changed-{name}"
        shutil.copytree(first, changed)
        text = (changed / name).read_text()
        assert was in text
        (changed / name).write_text(text.replace(was, now, 1))  # one character
        again = import_job(changed, model="digits_cnn", framework="mlperf", system=None)
        assert again.evaluation_id() != ev, name
    # A directory of just the two logs hashes as its run (mlscope.hashing's one rule).
    just = tmp_path / "just"
    just.mkdir()
    for name in logs.REQUIRED:
        shutil.copy(first / name, just / name)
    assert job.mlperf_import.identity() == sha256_path(just)
    # Any other job's evaluation is its own, derived from its id.
    plain = JobRequest(model="m", framework="onnxruntime")
    assert plain.evaluation_id() == evaluation_id_for(plain.job_id)
