"""The one sample order (mlscope.samples): properties of the helper itself, and that
the per-query labels a real run stores follow it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mlscope import schedule as sch
from mlscope.errors import ConfigError
from mlscope.samples import (
    ARRIVAL_STREAM,
    SAMPLE_STREAM,
    SampleOrder,
    feeders,
    sample_indices,
    stream,
    top1,
)


def test_each_cycle_is_a_permutation_of_its_own() -> None:
    idx = sample_indices(35, 10, seed=4)
    assert idx.dtype == np.int64 and idx.shape == (35,)
    cycles = [idx[k : k + 10] for k in range(0, 30, 10)]
    for c in cycles:
        assert sorted(c.tolist()) == list(range(10))
    assert len({tuple(c.tolist()) for c in cycles}) == 3  # a fresh permutation per cycle
    assert len(set(idx[30:].tolist())) == 5  # the fourth cycle has begun, no repeat
    few = sample_indices(5, 1000, seed=4)
    assert len(set(few.tolist())) == 5  # no replacement while the data set lasts
    multi = sample_indices(4, 100, seed=4, samples_per_query=8)
    assert multi.shape == (32,) and len(set(multi.tolist())) == 32


def test_rows_of_a_query_depend_only_on_seed_size_batch_and_index() -> None:
    whole = sample_indices(300, 37, seed=11, samples_per_query=3)
    order = SampleOrder(37, 11)
    # Asked for out of order (a dealt slice, a remote load generator), rows agree.
    for i in (299, 0, 150, 13, 12):
        np.testing.assert_array_equal(order.rows(i, 3), whole[3 * i : 3 * i + 3])
    np.testing.assert_array_equal(SampleOrder(37, 11).rows(200, 3), whole[600:603])
    np.testing.assert_array_equal(order.positions(5, 0), np.empty(0, np.int64))


def test_seeded_and_independent_of_the_arrival_stream() -> None:
    a = sample_indices(500, 1000, seed=9)
    np.testing.assert_array_equal(a, sample_indices(500, 1000, seed=9))
    assert not np.array_equal(a, sample_indices(500, 1000, seed=10))
    # The first cycle is the sample stream's first permutation, not the arrival
    # stream's: a schedule of any rate or scenario never moves the samples.
    np.testing.assert_array_equal(a, stream(9, SAMPLE_STREAM).permutation(1000)[:500])
    assert not np.array_equal(a, stream(9, ARRIVAL_STREAM).permutation(1000)[:500])
    slow = sch.poisson(100.0, n=1000, seed=9)
    fast = sch.poisson(200.0, n=1000, seed=9)
    np.testing.assert_allclose(fast.offsets_ns, slow.offsets_ns / 2, atol=1)
    np.testing.assert_array_equal(a, sample_indices(500, 1000, seed=9))


def test_real_runs_feed_queries_by_the_helper() -> None:
    x = np.arange(13 * 2, dtype=np.float32).reshape(13, 2)
    y = np.arange(13) * 10
    inputs, labels = feeders((x, y), (2,), 3, 5)
    assert labels is not None
    want = sample_indices(20, 13, seed=5, samples_per_query=3)
    for i in (19, 0, 7):
        rows = want[3 * i : 3 * i + 3]
        np.testing.assert_array_equal(inputs(i), x[rows])
        np.testing.assert_array_equal(labels(i), y[rows])
    fill, none = feeders(None, (2,), 2, 5)
    assert none is None and fill(0).shape == (2, 2) and fill(0).dtype == np.float32


@pytest.mark.parametrize("label_shape", [(), (2,)])
def test_a_span_of_labels_is_each_querys_labels_at_once(label_shape: tuple[int, ...]) -> None:
    """What a collector scores a shipped block with: one row per query, equal to the
    per-query labels, across cycle ends (13 rows, 3 per query) and in any call order."""
    x = np.zeros((13, 2), np.float32)
    y = np.arange(13 * int(np.prod(label_shape, dtype=np.int64))).reshape(13, *label_shape)
    _, labels = feeders((x, y), (2,), 3, 5)
    assert labels is not None
    for first, end in ((9, 30), (0, 4), (4, 5), (2, 2)):
        got = labels.span(first, end)
        want = [np.asarray(labels(i)).reshape(-1) for i in range(first, end)]
        assert got.shape == (end - first, 3 * int(np.prod(label_shape, dtype=np.int64)))
        np.testing.assert_array_equal(got, np.array(want).reshape(got.shape))


def test_a_block_of_inputs_is_each_querys_inputs_one_after_another() -> None:
    """What an agent's stream gathers ahead: queries' rows in query order on axis 0,
    across cycle ends, whatever was drawn before."""
    x = np.arange(13 * 2 * 2, dtype=np.float32).reshape(13, 2, 2)
    inputs, _ = feeders((x, np.arange(13)), (2, 2), 3, 5)
    for first, end in ((9, 30), (0, 4), (4, 5), (2, 2)):
        got = inputs.block(first, end)
        assert got.shape == (3 * (end - first), 2, 2)
        for k, i in enumerate(range(first, end)):
            np.testing.assert_array_equal(got[3 * k : 3 * k + 3], inputs(i))


@pytest.mark.parametrize("bad", [{"dataset_size": 0}, {"samples_per_query": 0}])
def test_misuse_is_config_error(bad: dict[str, int]) -> None:
    args = {"n_queries": 3, "dataset_size": 5, "seed": 1, "samples_per_query": 1, **bad}
    with pytest.raises(ConfigError):
        sample_indices(**args)
    with pytest.raises(ConfigError, match="seed"):
        SampleOrder(5, -1)


def test_synthetic_rows_of_a_large_input_are_fewer_and_the_same_stream() -> None:
    """A model without a data set gets FILL_ROWS rows from the seed's fill stream; an
    input so large that drawing them would take GBs (a manifest from the bus sets its
    shape) gets fewer: the first rows of the same stream, so server and agent agree."""
    import tracemalloc

    from mlscope import samples

    small, labels = samples.table(None, (28, 28), 3)
    assert small.shape == (samples.FILL_ROWS, 28, 28) and labels is None
    tracemalloc.start()
    try:
        big, _ = samples.table(None, (3_000_000,), 3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert 1 <= len(big) < samples.FILL_ROWS
    assert peak <= samples.FILL_MAX_BYTES * 1.6  # the draw and its float32 copy
    head = samples.stream(3, samples.FILL_STREAM).standard_normal((2, 3_000_000))
    np.testing.assert_array_equal(big[:2], head.astype(np.float32))


@pytest.mark.parametrize(
    ("values", "dtype", "want"),
    [
        ([7, -3, 0], np.int32, [7, -3, 0]),
        ([300, 7, 0], np.uint16, [300, 7, 0]),
        ([True, False, True], np.bool_, [1, 0, 1]),
        ([2**63 - 1, -(2**31), 5], np.int64, [-1, -(2**31), 5]),
        ([2**64 - 1, 2**31 - 1, 5], np.uint64, [-1, 2**31 - 1, 5]),
        ([1e10, np.nan, np.inf, -np.inf, 7.9, -3.0], np.float32, [-1, -1, -1, -1, 7, -3]),
        ([np.nan, 65504.0, 7.0], np.float16, [-1, 65504, 7]),
        ([1 + 2j, 3, 4], np.complex64, [-1, -1, -1]),
        ([b"7", b"8", b"9"], "S1", [-1, -1, -1]),
    ],
)
def test_a_predicted_class_is_an_int32_index_or_minus_one(
    values: list[object], dtype: Any, want: list[int]
) -> None:
    """Whatever a model's first output holds: a whole column and each row on its own
    (the served load generator scores one reply at a time) say the same."""
    outputs = np.array(values, dtype=dtype)[:, None]
    got = top1(outputs)
    assert got is not None and got.dtype == np.int32 and got.tolist() == want
    for row, expect in zip(outputs, want, strict=True):
        one = top1(row[None])
        assert one is not None and one.dtype == np.int32 and one.tolist() == [expect]
    assert top1(np.zeros((0, 3), np.float32)) is None and top1(np.float32(3)) is None
