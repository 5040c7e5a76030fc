"""Unit tests of the core contracts: codec, stats, names, versions, errors, settings."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from mlscope import codec, names, stats
from mlscope.contracts import JobRequest, Query, QueryReply, TraceLevel
from mlscope.errors import (
    ConfigError,
    InputMismatchError,
    MLScopeError,
    ResolutionError,
    WireError,
    error_from_wire,
)
from mlscope.settings import Settings
from mlscope.versions import parse_constraint, satisfies


@pytest.mark.parametrize("dtype", ["float32", "float16", "int64", "uint8", "bool"])
def test_tensors_cross_the_wire_as_raw_bytes(dtype: str) -> None:
    arr = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    out = codec.decode(codec.encode({"t": arr, "n": [1, "x"]}))
    assert out["t"].dtype == arr.dtype and out["t"].shape == arr.shape
    np.testing.assert_array_equal(out["t"], arr)
    assert out["n"] == [1, "x"]
    # Raw bytes: the message is the payload plus a small header, not per-element objects.
    assert len(codec.encode(np.zeros(10_000, np.float32))) < 40_000 + 64
    scalar = codec.decode(codec.encode(np.array(16000, np.int64)))  # a 0-d input stays 0-d
    assert scalar.shape == () and scalar == 16000
    strided = np.arange(12).reshape(3, 4)[:, ::2]
    np.testing.assert_array_equal(codec.decode(codec.encode(strided)), strided)


def test_contract_messages_round_trip() -> None:
    q = Query(evaluation_id="ev", index=7, inputs=np.ones((2, 8, 8), np.float32))
    back = codec.decode_model(Query, codec.encode_model(q))
    assert back.index == 7 and back.inputs.shape == (2, 8, 8)
    r = QueryReply(index=1, ok=True, outputs=np.array([[3, 1]], np.int32), t_received=5)
    outputs = codec.decode_model(QueryReply, codec.encode_model(r)).outputs
    assert outputs is not None and outputs.tolist() == [[3, 1]]
    q = Query(
        evaluation_id="ev",
        index=8,
        inputs=np.ones((2, 576), np.float32),
        labels=True,
        more_inputs=(np.zeros((2, 2, 128), np.float32), np.array(16000, np.int64)),
    )
    back = codec.decode_model(Query, codec.encode_model(q))
    assert back.labels and [m.shape for m in back.more_inputs] == [(2, 2, 128), ()]
    job = JobRequest(model="m", framework="onnxruntime")
    assert codec.decode_model(JobRequest, codec.encode_model(job)) == job


def test_malformed_messages_are_typed_errors() -> None:
    with pytest.raises(WireError):
        codec.decode(b"\xc1\xff\x00garbage")
    with pytest.raises(WireError, match="invalid Query"):
        codec.decode_model(Query, codec.encode({"kind": "query", "index": "x"}))


def test_percentile_is_nearest_rank() -> None:
    data = list(range(1, 101))  # 1..100
    assert stats.percentile(data, 50) == 50
    assert stats.percentile(data, 90) == 90
    assert stats.percentile(data, 99) == 99
    assert stats.percentile(data, 100) == 100
    assert stats.percentile([5.0], 99) == 5.0
    assert stats.percentile([], 50) is None
    # Nearest rank never interpolates: it returns an observed sample.
    assert stats.percentile([1, 10], 50) == 1
    with pytest.raises(ValueError):
        stats.percentile(data, 0)


def test_trimmed_mean_drops_twenty_percent_each_end() -> None:
    data = [1000.0, 1, 2, 3, 4, 5, 6, 7, 8, -1000.0]  # 10 samples: drop 2 at each end
    assert stats.trimmed_mean(data) == pytest.approx(np.mean([2, 3, 4, 5, 6, 7]))
    assert stats.trimmed_mean([4.0]) == 4.0
    assert stats.trimmed_mean([]) is None
    assert not math.isnan(stats.trimmed_mean([1.0, float("nan"), 3.0]) or 0)


def test_subject_tokens_cannot_inject_wildcards() -> None:
    assert names.capability("onnxruntime", "a.b*>c") == "mlscope.cap.onnxruntime.a_b__c"
    assert names.token("") == "_"


@pytest.mark.parametrize(
    ("version", "constraint", "ok"),
    [
        ("1.31.1", ">=1.12.0 <2.0", True),
        ("1.31.1", ">=1.12,<2", True),
        ("2.0.0", ">=1.12.0 <2.0", False),
        ("2.13.0+cpu", ">=2.13", True),
        ("1.0.0", "1.0.0", True),
        ("1.0.1", "1.0.0", False),
        ("9.9", None, True),
    ],
)
def test_version_constraints(version: str, constraint: str | None, ok: bool) -> None:
    assert satisfies(version, constraint) is ok


def test_bad_constraint_is_rejected() -> None:
    with pytest.raises(ValueError, match=">>1"):
        parse_constraint(">>1")


def test_errors_survive_the_wire_with_type_and_fields() -> None:
    exc = InputMismatchError(
        "bad shape", model="m", framework="onnxruntime", expected=[1, 8, 8], actual=[3]
    )
    back = error_from_wire(codec.decode(codec.encode(exc.to_wire())))
    assert isinstance(back, InputMismatchError) and isinstance(back, ValueError)
    assert back.fields["expected"] == [1, 8, 8] and str(back) == "bad shape"
    assert isinstance(error_from_wire({"code": "nope", "message": "x"}), MLScopeError)
    assert issubclass(ResolutionError, LookupError)


def test_trace_levels_are_ordered() -> None:
    assert TraceLevel.NONE < TraceLevel.MODEL < TraceLevel.FRAMEWORK < TraceLevel.SYSTEM
    assert TraceLevel.parse("Framework") is TraceLevel.FRAMEWORK
    with pytest.raises(ValueError, match="unknown trace level"):
        TraceLevel.parse("verbose")


@pytest.mark.parametrize(
    ("var", "value", "says"),
    [
        ("MLSCOPE_JS_REPLICAS", "three", "want a whole number"),
        ("MLSCOPE_JS_REPLICAS", "0", "want a whole number from 1"),
        ("MLSCOPE_TRACE_RETENTION_DAYS", "7.5", "want a whole number"),
        ("MLSCOPE_TRACE_RETENTION_DAYS", "-1", "want a whole number from 0"),
        ("MLSCOPE_MAX_ARTIFACT_BYTES", "inf", "want a positive number"),
        ("MLSCOPE_SQL_TIMEOUT_S", "nan", "want a positive number"),
        ("MLSCOPE_SQL_TIMEOUT_S", "1e300", "want a positive number to 86400"),
        ("MLSCOPE_LOADGEN_READY_S", "0", "want a positive number"),
        ("MLSCOPE_JOB_ACK_WAIT_S", "0.5", "want a number from 1 to 3600"),
        ("MLSCOPE_JOB_ACK_WAIT_S", "1e12", "want a number from 1 to 3600"),
        ("MLSCOPE_JOB_ACK_WAIT_S", "-inf", "want a positive number"),
    ],
)
def test_a_bad_setting_is_one_line_naming_its_variable(var: str, value: str, says: str) -> None:
    """Every command reads its settings first: a bad value is a ConfigError naming the
    variable (exit 1), never a traceback from int() or float()."""
    with pytest.raises(ConfigError, match=f"{var}={value!r}: {says}") as err:
        Settings.from_env({var: value})
    assert err.value.fields["field"] == var
    good = Settings.from_env({"MLSCOPE_JS_REPLICAS": "3", "MLSCOPE_TRACE_RETENTION_DAYS": "0"})
    assert (good.js_replicas, good.trace_retention_days) == (3, 0)


def test_settings_come_from_the_environment(tmp_path: Path) -> None:
    s = Settings.from_env({"MLSCOPE_NATS_URL": "nats://h:1", "MLSCOPE_DATA_DIR": str(tmp_path)})
    assert s.nats_url == "nats://h:1" and s.data_dir == tmp_path
    assert s.dsn == f"chdb:///{(tmp_path / 'chdb').resolve()}"
    assert Settings.from_env({}).nats_url == "nats://127.0.0.1:4222"
    assert Settings.from_env({"MLSCOPE_CLICKHOUSE_DSN": "http://ch:8123"}).dsn == "http://ch:8123"


def test_a_child_process_gets_the_load_generator_readiness_limit() -> None:
    """The server reads it where ``mlscope up`` starts it: through the environment."""
    assert Settings.from_env({}).loadgen_ready_s == 60.0
    ready = Settings(loadgen_ready_s=12.5)
    assert Settings.from_env(ready.as_env()).loadgen_ready_s == 12.5


def test_a_child_process_gets_the_job_ack_wait() -> None:
    assert Settings.from_env({}).job_ack_wait_s == 15.0
    assert "MLSCOPE_JOB_ACK_WAIT_S" not in Settings().as_env()
    failover = Settings(job_ack_wait_s=2.5)
    assert Settings.from_env(failover.as_env()).job_ack_wait_s == 2.5
