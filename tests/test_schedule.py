"""Schedules: statistics, reproducibility, replay files, dealing and merging."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from mlscope import replay_file as rf
from mlscope import schedule as sch
from mlscope.errors import ConfigError


def test_poisson_mean_rate_and_exponential_gaps() -> None:
    s = sch.poisson(1000.0, n=200_000, seed=7)
    assert s.offsets_ns.dtype == np.int64
    assert np.all(np.diff(s.offsets_ns) >= 0) and s.offsets_ns[0] > 0
    rate = len(s) / s.duration_s
    assert rate == pytest.approx(1000.0, rel=0.01)  # 4.5 sigma at n=200k is ~1%
    gaps_s = np.diff(s.offsets_ns, prepend=0) / 1e9
    ks = sps.kstest(gaps_s, "expon", args=(0, 1 / 1000.0))
    assert ks.pvalue > 0.01


def test_poisson_duration_keeps_only_arrivals_inside_and_matches_n_prefix() -> None:
    by_time = sch.poisson(500.0, duration_s=20.0, seed=3)
    assert by_time.duration_s <= 20.0
    assert len(by_time) == pytest.approx(10_000, rel=0.05)
    by_count = sch.poisson(500.0, n=len(by_time) + 10, seed=3)
    np.testing.assert_array_equal(by_time.offsets_ns, by_count.offsets_ns[: len(by_time)])
    assert by_count.duration_s > 20.0


def test_same_seed_same_schedule_and_different_seed_differs() -> None:
    a = sch.poisson(100.0, duration_s=5, seed=42)
    b = sch.poisson(100.0, duration_s=5, seed=42)
    c = sch.poisson(100.0, duration_s=5, seed=43)
    np.testing.assert_array_equal(a.offsets_ns, b.offsets_ns)
    assert len(a) != len(c) or not np.array_equal(a.offsets_ns, c.offsets_ns)
    pa = sch.piecewise([(10, 100, 2), (100, 100, 1)], seed=5)
    pb = sch.piecewise([(10, 100, 2), (100, 100, 1)], seed=5)
    np.testing.assert_array_equal(pa.offsets_ns, pb.offsets_ns)


def test_rate_scales_one_pattern_and_leaves_samples_alone() -> None:
    slow = sch.poisson(100.0, n=1000, seed=9)
    fast = sch.poisson(200.0, n=1000, seed=9)
    np.testing.assert_allclose(fast.offsets_ns, slow.offsets_ns / 2, atol=1)


def test_constant_and_multi_stream_are_periodic() -> None:
    c = sch.constant(1000.0, duration_s=2.0)
    assert len(c) == 2000
    assert set(np.diff(c.offsets_ns).tolist()) == {1_000_000}
    assert c.offsets_ns[0] == 1_000_000 and c.duration_s == pytest.approx(2.0)
    m = sch.multi_stream(0.05, 8, 10)
    assert m.samples_per_query == 8 and len(m) == 10
    assert m.offsets_ns[-1] == 500_000_000


def test_piecewise_segment_counts() -> None:
    # ramp 0 -> 2000/s over 5 s (mass 5000), flat 1000/s for 3 s (3000), pause, burst
    segs = [(0.0, 2000.0, 5.0), (1000.0, 1000.0, 3.0), (0.0, 0.0, 1.0), (5000.0, 5000.0, 1.0)]
    s = sch.piecewise(segs, seed=11)
    t = s.offsets_ns / 1e9
    counts = np.histogram(t, bins=[0, 5, 8, 9, 10])[0]
    for got, want in zip(counts, [5000, 3000, 0, 5000], strict=True):
        assert abs(got - want) <= 4 * np.sqrt(max(want, 1))
    assert counts[2] == 0
    # inside the ramp the rate grows linearly: the second half holds 3/4 of the mass
    first, second = np.histogram(t, bins=[0, 2.5, 5])[0]
    assert second / (first + second) == pytest.approx(0.75, abs=0.03)
    # the flat segment's gaps are exponential with rate 1000
    flat = np.diff(s.offsets_ns[(t > 5.01) & (t < 7.99)]) / 1e9
    assert sps.kstest(flat, "expon", args=(0, 1e-3)).pvalue > 0.01


def test_piecewise_rejects_bad_segments() -> None:
    with pytest.raises(ConfigError):
        sch.piecewise([])
    with pytest.raises(ConfigError):
        sch.piecewise([(-1.0, 5.0, 1.0)])
    with pytest.raises(ConfigError):
        sch.piecewise([(1.0, 5.0, 0.0)])


def test_replay_round_trip(tmp_path: Path) -> None:
    s = sch.poisson(3000.0, n=5000, seed=1)
    path = tmp_path / "trace.txt"
    rf.write_replay(path, s)
    np.testing.assert_array_equal(rf.replay(path).offsets_ns, s.offsets_ns)


def test_replay_plain_with_comments_and_csv_columns(tmp_path: Path) -> None:
    plain = tmp_path / "gaps.txt"
    plain.write_text("# recorded trace\n0.5\n\n0.25  # burst\n1e-3\n")
    assert rf.replay(plain).offsets_ns.tolist() == [500_000_000, 750_000_000, 751_000_000]
    named = tmp_path / "gaps.csv"
    named.write_text("id,gap_s\n1,0.5\n2,0.5\n")
    assert rf.replay(named, column="gap_s").offsets_ns.tolist() == [5e8, 1e9]
    bare = tmp_path / "bare.csv"
    bare.write_text("a,0.1\nb,0.2\n")
    assert rf.replay(bare, column=1).offsets_ns.tolist() == [100_000_000, 300_000_000]


@pytest.mark.parametrize(
    ("content", "column", "line", "words"),
    [
        ("0.1\n0.2\nfast\n", None, 3, "not a number"),
        ("0.1\n-0.2\n", None, 2, ">= 0"),
        ("0.1\nnan\n", None, 2, "finite"),
        ("gap\n0.1\n", "other", 1, "no column"),
        ("x,0.1\ny\n", 1, 2, "no column"),
    ],
)
def test_replay_malformed_names_file_and_line(
    tmp_path: Path, content: str, column: str | int | None, line: int, words: str
) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        rf.replay(path, column=column)
    assert f"{path}:{line}:" in str(info.value) and words in str(info.value)
    assert info.value.fields["line"] == line and info.value.fields["file"] == str(path)


def test_replay_missing_file_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        rf.replay(tmp_path / "absent.txt")


@pytest.mark.parametrize("text", ["", "# only a comment\n\n"])
def test_replay_of_no_arrival_is_refused_naming_the_file(tmp_path: Path, text: str) -> None:
    """Refused where it is read (``mlscope-submit --schedule``), not after the job went
    to a server that then asks for the flag it was given."""
    path = tmp_path / "empty.txt"
    path.write_text(text)
    with pytest.raises(ConfigError, match="at least one arrival") as info:
        rf.replay(path)
    assert info.value.fields["file"] == str(path)


@pytest.mark.timeout(15)  # the old reader blocked in open() until a writer came
def test_replay_refuses_a_fifo_rather_than_wait_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "arrivals.txt"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"not a regular file \(a FIFO\)") as info:
        rf.replay(fifo)
    assert info.value.fields["file"] == str(fifo)


def test_replay_stops_at_the_first_arrival_a_run_cannot_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rf, "MAX_SCHEDULED_QUERIES", 3)
    path = tmp_path / "arrivals.txt"
    path.write_text("0.1\n# note\n0.1\n0.1\n0.1\nnever read\n")
    with pytest.raises(ConfigError, match="more than the 3 arrivals") as info:
        rf.replay(path)
    assert f"{path}:5:" in str(info.value) and info.value.fields["line"] == 5
    path.write_text("0.1\n0.1\n0.1\n")
    assert len(rf.replay(path)) == 3


@pytest.mark.parametrize("column", [None, 0])
def test_replay_refuses_a_file_past_its_byte_limit_before_parsing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, column: int | None
) -> None:
    monkeypatch.setattr(rf, "MAX_REPLAY_BYTES", 64)
    path = tmp_path / "arrivals.txt"
    path.write_text("0.001\n" * 10 + "not a number\n" * 10)
    with pytest.raises(ConfigError, match="at most 64 bytes") as info:
        rf.replay(path, column=column)
    assert info.value.fields["limit"] == 64
    path.write_text("0.001\n" * 10)
    assert len(rf.replay(path, column=column)) == 10


def test_replay_grows_its_gaps_past_one_chunk_and_names_csv_lines(tmp_path: Path) -> None:
    plain = tmp_path / "many.txt"
    plain.write_text("0.000001\n" * 70_000)
    offsets = rf.replay(plain).offsets_ns
    assert offsets.dtype == np.int64 and offsets.tolist() == list(range(1000, 70_001_000, 1000))
    quoted = tmp_path / "quoted.csv"
    quoted.write_text('note,gap\n"two\nlines",0.1\nx,fast\n')
    with pytest.raises(ConfigError, match=r"quoted\.csv:4: not a number"):
        rf.replay(quoted, column="gap")


def test_deal_merge_round_trip() -> None:
    s = sch.poisson(1000.0, n=10_001, seed=2)
    parts = sch.deal(s, 3)
    assert [len(p) for p in parts] == [3334, 3334, 3333]
    np.testing.assert_array_equal(parts[1].offsets_ns, s.offsets_ns[1::3])
    np.testing.assert_array_equal(parts[2].index, np.arange(2, 10_001, 3))
    back = sch.merge(parts[::-1])
    np.testing.assert_array_equal(back.offsets_ns, s.offsets_ns)
    lat = [p.offsets_ns * 2 for p in parts]
    np.testing.assert_array_equal(sch.merge_values(parts, lat), s.offsets_ns * 2)
    with pytest.raises(ConfigError):
        sch.merge(parts[:2])


@pytest.mark.parametrize("bad", [-1, 1.5, "7", True])
def test_bad_seed_is_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="seed"):
        sch.poisson(10.0, n=3, seed=bad)  # type: ignore[arg-type]


def test_bounds_are_exclusive() -> None:
    with pytest.raises(ConfigError):
        sch.poisson(10.0, seed=1)
    with pytest.raises(ConfigError):
        sch.poisson(10.0, n=5, duration_s=1.0)
    with pytest.raises(ConfigError):
        sch.constant(0.0, n=5)
