"""The dashboard shows analysis's numbers, and the Run page sends what its form shows.

On a real stack of the module's own (nats-server, the server owning chDB, an onnxruntime
agent), in AppTest: the Results page of a batch-size sweep shows what
``mlscope report`` shows of it, the Compare page the report's intervals, and the Run page
disables, and never sends, what the chosen scenario does not read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pandas as pd
import pytest
import streamlit as st

from analysis.report import build
from analysis.report_render import to_json
from analysis.source import BusSource
from mlscope import scenario_traits
from mlscope.api import Client
from mlscope.contracts import JobRequest, ScenarioSpec
from mlscope.settings import Settings
from tests.conftest import child_env, running_stack
from tests.test_dashboard import page, run_form

pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class Runs:
    settings: Settings
    online: tuple[str, str]
    """Two online runs of digits_cnn at one rate."""
    sweep: str
    """A batch-size sweep of digits_cnn (1 and 8): its parent's id."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, zoo_dir: Path) -> Iterator[Runs]:
    """A stack of this module's own: its tests add evaluations, and the pages' defaults
    (the newest run) of the shared ``analysis_runs`` stay what other modules expect."""

    async def evaluate(settings: Settings) -> Runs:
        def job(spec: ScenarioSpec) -> JobRequest:
            return JobRequest(model="digits_cnn", framework="onnxruntime", scenario=spec)

        async with Client(settings) as client:
            online = [
                (await client.submit(job(ScenarioSpec(qps=150, duration_s=0.5, seed=s))))
                for s in (1, 2)
            ]
            sweep = ScenarioSpec(name="batched", batch_sizes=(1, 8), duration_s=0.3)
            parent = await client.submit(job(sweep))
        return Runs(
            settings, (online[0].evaluation_id, online[1].evaluation_id), parent.evaluation_id
        )

    with running_stack(tmp_path_factory.mktemp("numbers"), zoo_dir, ["onnxruntime"]) as s:
        yield anyio.run(evaluate, s.settings, backend="asyncio")


@pytest.fixture
def env(runs: Runs, monkeypatch: pytest.MonkeyPatch) -> Runs:
    """The dashboard reads its settings from the environment, like every command."""
    for k, v in runs.settings.as_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MLSCOPE_CLICKHOUSE_DSN", raising=False)
    st.cache_resource.clear()
    st.cache_data.clear()
    return runs


def report_table(runs: Runs, ids: list[str], caption: str) -> pd.DataFrame:
    """The table of ``mlscope report IDS`` whose caption starts with ``caption``."""
    report = to_json(build(BusSource(runs.settings), ids))
    rows = [t["rows"] for s in report["sections"] for t in s["tables"]]
    captions = [t["caption"] for s in report["sections"] for t in s["tables"]]
    return pd.DataFrame(
        next(r for r, c in zip(rows, captions, strict=True) if c.startswith(caption))
    )


def test_results_of_a_sweep_are_the_reports(env: Runs) -> None:
    """Picked alone, a sweep's parent shows its runs' throughput, as the report does."""
    sweep = env.sweep
    at = page("results.py", eval=sweep)
    at.multiselect(key="results_ids").set_value([sweep]).run()
    assert not at.exception, [e.value for e in at.exception]
    summ = at.dataframe[0].value
    assert len(summ) == 3 and set(summ["role"]) == {"sweep", "run"}
    best = at.dataframe[1].value
    expected = report_table(env, [sweep], "Maximum throughput")
    assert list(best["batch_sizes"].iloc[0]) == [1, 8]
    assert best["max_throughput_ips"].iloc[0] == pytest.approx(
        expected["max_throughput_ips"].iloc[0]
    )
    acc = next(d.value for d in at.dataframe if "online_latency_ms" in d.value.columns)
    expected = report_table(env, [sweep], "Accuracy")
    assert acc["max_throughput_ips"].iloc[0] == pytest.approx(
        expected["max_throughput_ips"].iloc[0]
    )
    assert acc["top1"].iloc[0] == pytest.approx(expected["top1"].iloc[0])


def test_compare_shows_the_reports_intervals(env: Runs) -> None:
    base, cand = env.online
    at = page("compare.py")
    at.selectbox(key="compare_base").select(base).run()
    at.multiselect(key="compare_cands").set_value([cand]).run()
    assert not at.exception, [e.value for e in at.exception]
    shown = at.dataframe[0].value
    expected = report_table(env, [base, cand], "Bootstrap 95% CIs")
    for col in ("a", "b", "diff", "ci_low", "ci_high"):
        assert shown[col].tolist() == pytest.approx(expected[col].tolist()), col
    assert shown["verdict"].tolist() == expected["verdict"].tolist()


# The form's boxes of the ScenarioSpec fields that some scenario does not read.
BOXES = {
    "qps": "run_qps",
    "duration_s": "run_duration",
    "concurrency": "run_concurrency",
    "peak_trials": "run_trials",
    "repetitions": "run_reps",
    "warm_queries": "run_warm",
    "loadgens": "run_loadgens",
    "latency_bound_ms": "run_bound",
    "min_duration_s": "run_min_duration",
    "min_queries": "run_min_q",
    "max_issue_lag_us": "run_max_lag",
    "max_queries": "run_max_q",
    "warmup_queries": "run_warmup",
}


def test_run_form_disables_what_the_scenario_does_not_read(env: Runs) -> None:
    at = run_form("online")
    for name in at.selectbox(key="run_scenario").options:
        at.selectbox(key="run_scenario").select(name).run()
        assert not at.exception, [e.value for e in at.exception]
        traits = scenario_traits.get(name)
        disabled = {f for f, key in BOXES.items() if at.number_input(key=key).disabled}
        assert disabled == {f for f in BOXES if not traits.reads(f)}, name
        sweep_box = at.text_input(key="run_sweep").disabled
        assert sweep_box == (not traits.reads("batch_sizes")), name


def test_run_page_does_not_send_a_disabled_value(env: Runs) -> None:
    """A value typed for one scenario stays in its box, disabled, after another is
    picked: the job carries the spec's default, not that value."""
    at = run_form("concurrency")
    at.number_input(key="run_concurrency").set_value(7).run()
    at.selectbox(key="run_scenario").select("online").run()
    assert at.number_input(key="run_concurrency").disabled
    at.number_input(key="run_duration").set_value(0.4).run()
    at.button(key="run_go").click().run(timeout=120)
    assert not at.exception, [e.value for e in at.exception]

    async def stored() -> dict[str, object]:
        async with Client(env.settings) as client:
            got = await client.stored(at.session_state["last_evaluation"])
            assert got is not None
            return got.scenario

    scenario = anyio.run(stored, backend="asyncio")
    assert scenario["name"] == "online" and scenario["duration_s"] == 0.4
    assert scenario["concurrency"] == ScenarioSpec().concurrency


def test_run_page_starts_from_a_sweeps_job(env: Runs) -> None:
    """Every box holds what the stored job ran, not just its model and scenario."""
    at = page("run.py", eval=env.sweep)
    assert at.selectbox(key="run_scenario").value == "batched"
    assert at.text_input(key="run_sweep").value == "1, 8"
    assert at.number_input(key="run_duration").value == 0.3
    assert "Settings from" in at.caption[0].value and not at.warning


def test_one_run_of_a_sweep_is_rerun_and_prefilled_as_that_run_alone(env: Runs) -> None:
    """A sweep's run (``<id>-<k>``) is reproduced by its own point, not the whole sweep:
    the Run page starts from it and ``mlscope rerun`` runs it (one definition:
    :func:`mlscope.reproduce.evaluation_job`)."""
    from cli.rerun_cmd import rerun

    run = f"{env.sweep}-1"  # batch size 8 of the sweep of 1 and 8
    at = page("run.py", eval=run)
    assert at.selectbox(key="run_scenario").value == "batched"
    assert at.number_input(key="run_batch").value == 8
    assert at.text_input(key="run_sweep").value == ""  # batch 8 alone, not the sweep
    assert at.number_input(key="run_duration").value == 0.3
    assert f"Settings from {run}" in at.caption[0].value and not at.warning

    again = anyio.run(lambda: rerun(env.settings, run, any_system=True), backend="asyncio")
    assert again.scenario["batch_size"] == 8 and not again.scenario["batch_sizes"]
    assert not again.points or [p["batch_size"] for p in again.points] == [8]


def test_run_page_does_not_start_from_an_mlperf_run(env: Runs, tmp_path: Path) -> None:
    """An MLPerf LoadGen run is no scenario of the form: said, and nothing prefilled
    (its target rate is not an online run's)."""
    conf = tmp_path / "user.conf"
    conf.write_text("*.Offline.min_duration = 300\n*.Offline.min_query_count = 1\n")
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "mlperf", "digits_cnn", "--framework", "onnxruntime",
         "--scenario", "Offline", "--target-qps", "20000", "--user-conf", str(conf),
         "--output", str(tmp_path / "logs"), "--json"],
        env=child_env(env.settings), capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    st.cache_data.clear()
    at = page("run.py", eval=json.loads(done.stdout)["evaluation_id"])
    assert "MLPerf LoadGen run" in at.warning[0].value
    assert at.number_input(key="run_qps").value == 100.0  # the form's default, not 20000
    assert not any("Settings from" in c.value for c in at.caption)


@pytest.mark.parametrize(
    ("scenario", "box", "text", "said"),
    [
        ("batched", "run_sweep", "1, two", "'two' is not a whole number"),
        ("piecewise", "run_segments", "50,200", "'50,200' is not three numbers"),
        ("replay", "run_arrivals", "0.01 abc", "'abc' is not a number"),
    ],
)
def test_run_page_refuses_a_list_it_cannot_read(
    env: Runs, scenario: str, box: str, text: str, said: str
) -> None:
    """A typo in a list box is said under it and nothing runs: never a traceback."""
    at = run_form(scenario)
    widget = at.text_input(key=box) if box == "run_sweep" else at.text_area(key=box)
    widget.set_value(text).run()
    assert not at.exception, [e.value for e in at.exception]
    assert said in at.error[0].value
    at.button(key="run_go").click().run(timeout=60)
    assert not at.exception, [e.value for e in at.exception]
    assert any(e.value.startswith("Not run: ") for e in at.error)
    assert "last_evaluation" not in at.session_state
