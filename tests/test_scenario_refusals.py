"""What a submission asks for that its scenario would not do: a flag or a scenario-file
value the scenario does not read (a piecewise run's length is its segments', not
``--duration``), and a peak search whose trials no rate could make VALID. Each is
refused before anything connects (usage, one line, exit 2), not run and reported
afterwards. No server: the bus is a stand-in nothing answers on."""

from __future__ import annotations

from pathlib import Path

import pytest

import cli.submit
from broker.scenario_kinds.peak import Peak
from mlscope import scenario_traits
from mlscope.contracts import ScenarioSpec
from mlscope.errors import ConfigError, ManifestError
from mlscope.manifest_files import load_manifest
from mlscope.validity import ValidityPolicy
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(30)

PIECEWISE = str(REPO / "manifests" / "scenarios" / "piecewise.yaml")
TARGET = ("digits_cnn", "--framework", "onnxruntime")


@pytest.fixture(autouse=True)
def _nowhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLSCOPE_NATS_URL", "nats://127.0.0.1:9")
    monkeypatch.setenv("MLSCOPE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("MLSCOPE_MANIFESTS", raising=False)


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one-line error of a refused command line (argparse's exit 2)."""
    with pytest.raises(SystemExit) as done:
        cli.submit.main([*TARGET, *argv])
    assert done.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("mlscope-submit: error: "), lines
    return lines[-1].removeprefix("mlscope-submit: error: ")


UNREAD = {
    "piecewise-duration": (
        ("--scenario-file", PIECEWISE, "--duration", "3"),
        "argument --duration: scenario 'piecewise' does not read it: its length is set by "
        "its segments' seconds",
    ),
    "piecewise-qps": (
        ("--scenario-file", PIECEWISE, "--qps", "50"),
        "argument --qps: scenario 'piecewise' does not read it: its own settings are "
        "loadgens, segments",
    ),
    "cold-start-duration": (
        ("--scenario", "cold-start", "--duration", "3"),
        "argument --duration: scenario 'cold-start' does not read it: its length is set "
        "by repetitions x warm_queries",
    ),
    "cold-start-max-queries": (
        ("--scenario", "cold-start", "--max-queries", "5"),
        "argument --max-queries: scenario 'cold-start' does not read it: each load is "
        "followed by warm_queries queries",
    ),
    "cold-start-latency-bound": (
        ("--scenario", "cold-start", "--latency-bound-ms", "20"),
        "argument --latency-bound-ms: scenario 'cold-start' does not read it: its verdict "
        "is whether every load happened and no query failed",
    ),
    "single-stream-concurrency": (
        ("--scenario", "single-stream", "--concurrency", "4"),
        "argument --concurrency: scenario 'single-stream' does not read it",
    ),
    "online-batch-sizes": (
        ("--scenario", "online", "--batch-sizes", "1,2"),
        "argument --batch-sizes: scenario 'online' does not read it",
    ),
    "batched-loadgens": (
        ("--scenario", "batched", "--loadgens", "2"),
        "argument --loadgens: scenario 'batched' does not read it",
    ),
    "online-peak-trials": (
        ("--scenario", "online", "--peak-trials", "3"),
        "argument --peak-trials: scenario 'online' does not read it",
    ),
}


@pytest.mark.parametrize("case", list(UNREAD))
def test_a_flag_the_scenario_does_not_read_is_refused(
    case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, message = UNREAD[case]
    assert usage_error(capsys, *argv).startswith(message)


def test_what_every_scenario_reads() -> None:
    """Common settings for all; duration for those whose length it sets; the own
    fields of each only where its traits name them."""
    for name in scenario_traits.names():
        t = scenario_traits.get(name)
        assert t.reads("seed") and t.reads("batch_size")
        # cold-start judges its loads and runs a fixed count of warm queries after each
        timed = name != "cold-start"
        for common in ("min_duration_s", "latency_bound_ms", "max_queries", "warmup_queries"):
            assert t.reads(common) == timed, (name, common)
        assert t.reads("duration_s") == (name not in {"piecewise", "replay", "cold-start"})
        assert t.reads("peak_trials") == (name == "peak")
        assert t.reads("loadgen_hosts") == t.reads("loadgens")


def test_a_scenario_file_value_the_scenario_does_not_read_is_the_files_error(
    tmp_path: Path,
) -> None:
    path = tmp_path / "sc.yaml"
    path.write_text("kind: scenario\nname: piecewise\nsegments: [[10, 10, 2]]\nduration_s: 3\n")
    with pytest.raises(ManifestError, match="does not read duration_s: its length") as err:
        load_manifest(path)
    assert err.value.file == str(path)
    path.write_text("kind: scenario\nname: cold-start\nrepetitions: 2\nlatency_bound_ms: 50\n")
    with pytest.raises(ManifestError, match="does not read latency_bound_ms: its verdict"):
        load_manifest(path)
    # A multi-stream file's concurrency is its samples per query: read, as batch_size.
    path.write_text("kind: scenario\nname: multi-stream\nqps: 10\nconcurrency: 4\n")
    load_manifest(path)


def test_a_file_value_the_scenario_named_by_flag_does_not_read_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--scenario`` overrides the file's scenario; a value the file set for its own
    scenario that the new one does not read is refused, not dropped."""
    path = tmp_path / "sc.yaml"
    path.write_text("kind: scenario\nname: online\nqps: 10\nduration_s: 1\n")
    message = usage_error(capsys, "--scenario-file", str(path), "--scenario", "batched")
    assert message.startswith(
        f"argument --scenario: {path} sets qps, which scenario 'batched' does not read"
    ), message


def test_a_peak_search_no_rate_can_make_valid_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """1 s trials under the default 10 s minimum are INVALID at every rate: the search
    could only end saying no rate met the bound, whatever the latency."""
    argv = ("--scenario", "peak", "--latency-bound-ms", "20", "--duration", "1")
    err = usage_error(capsys, *argv, "--peak-trials", "3")
    assert err == (
        "argument --duration: peak search: no trial could be VALID at any rate: each runs "
        "1 s, under the minimum run length of 10 s (a longer --duration, or a lower "
        "--min-duration)"
    )
    err = usage_error(
        capsys, "--scenario", "peak", "--latency-bound-ms", "20", "--max-queries", "50"
    )
    assert err.startswith("argument --max-queries: peak search: no trial could be VALID")
    assert usage_error(capsys, "--scenario", "peak").startswith("argument --latency-bound-ms:")
    # The job's own minimum makes 1 s trials possible: past every check, to the bus.
    code = cli.submit.main([*TARGET, *argv, "--min-duration", "1"])
    assert code == 1 and "no NATS server" in capsys.readouterr().err


def test_the_peak_rule_is_the_validity_rule() -> None:
    """Refused exactly where the verdict's size rules fail every trial: a trial as long
    as the minimum, or one whose query cap reaches the count it needs, is searched."""
    from broker.scenario_kinds.peak import trial_min_queries
    from broker.scenarios import refuse

    base = ValidityPolicy()
    peak = Peak(scenario_traits.get("peak"))

    def spec(**kw: object) -> ScenarioSpec:
        return ScenarioSpec.model_validate({"name": "peak", "latency_bound_ms": 5, **kw})

    with pytest.raises(ConfigError) as err:
        refuse(spec(duration_s=9.99), base)
    assert err.value.fields == {"field": "duration_s"}
    refuse(spec(duration_s=10), base)
    refuse(spec(duration_s=2, min_duration_s=2), base)
    need = trial_min_queries(spec(), base)
    assert need == 459  # p99 at 99% confidence, none over the bound
    peak.refuse(spec(max_queries=need), base)
    with pytest.raises(ConfigError, match=f"under the {need} a run needs"):
        peak.refuse(spec(max_queries=need - 1), base)
    assert trial_min_queries(spec(min_queries=2000), base) == 2000
    # A sweep ranked by throughput and a single run are not refused for their length.
    refuse(ScenarioSpec(name="batched", duration_s=1), base)
    refuse(ScenarioSpec(name="online", duration_s=1), base)
