"""Dashboard pages on hostile stored rows, each beside honest ones, and the Python API
misused at its edge.

The rows are written straight into a real chDB (the server owns its database, so a row
it would never write can only be put there directly) and every page reads them through
:class:`analysis.source.DirectSource`, in AppTest. A page must render the honest run and
never show an exception; the API refuses a misused call with a ConfigError naming the
argument, before it touches the bus.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

import dashboard.common as common
from analysis.source import DirectSource
from broker.db import EVALUATION_COLUMNS, QUERY_COLUMNS, Database
from mlscope.api import Client
from mlscope.errors import ConfigError, MLScopeError
from mlscope.settings import Settings

VIEWS = Path(__file__).resolve().parent.parent / "dashboard" / "views"
pytestmark = pytest.mark.timeout(180)

HONEST = {"scenario": {"batch_size": 1}, "throughput_ips": 100.0, "requested_qps": 100.0}


def row(ev: str, scenario: str, summary: Any, *, age_s: float = 0) -> list[Any]:
    """An evaluations row of digits_cnn (a model in the catalog, so the Run page takes it)."""
    text = summary if isinstance(summary, str) else json.dumps(summary)
    created = datetime.fromtimestamp(time.time() - age_s, UTC)
    return [
        ev, "job-" + ev, "", created, "digits_cnn", "1.0.0", "onnxruntime", "1.20",
        "agent-x", "host", "cpu", scenario, "none", "completed", 1, 0, 0, "{}", text,
    ]  # fmt: skip


def query_rows(ev: str, n: int, *, ok: bool = True) -> list[list[Any]]:
    rows = []
    for i in range(n):
        s = i * 1_000_000
        done = s + 2_000_000 + i * 1000
        rows.append(
            [ev, i, 1, s, s + 10, done, s + 20, s + 30, s + 40, s + 50,
             int(ok), "" if ok else "boom", 0, 0, 0 if ok else 2, 0, s + 5]
        )  # fmt: skip
    return rows


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Database]:
    """One chDB for the module (chDB opens one data directory per process), read by
    every page through a DirectSource."""
    d = Database(f"chdb:///{tmp_path_factory.mktemp('hostile') / 'chdb'}")
    d.migrate()
    source = DirectSource(d)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "source", lambda: source)
        mp.setattr(common, "agents", list)
        try:
            yield d
        finally:
            d.close()


@pytest.fixture
def dash(db: Database) -> Database:
    """The module's database, emptied: each test writes its own rows."""
    for table in ("evaluations", "queries"):
        db.command(f"TRUNCATE TABLE {table}")
    st.cache_data.clear()
    return db


def fill(db: Database, rows: list[list[Any]], queries: list[list[Any]] | None = None) -> None:
    db.insert("evaluations", list(zip(*rows, strict=True)), EVALUATION_COLUMNS)
    if queries:
        db.insert("queries", list(zip(*queries, strict=True)), QUERY_COLUMNS)


def page(name: str, **query: str) -> AppTest:
    at = AppTest.from_file(str(VIEWS / name), default_timeout=120)
    at.query_params.update(query)
    at.run()
    assert not at.exception, [str(e.value)[:300] for e in at.exception]
    return at


def shown_text(at: AppTest) -> str:
    parts = [*at.markdown, *at.info, *at.caption, *at.warning, *at.subheader, *at.title]
    return "\n".join(str(p.value) for p in parts)


# ---------------------------------------------------------------- Results, Run, Overview

HOSTILE = {
    "throughput_string": ("batched", {"scenario": {"batch_size": 2}, "throughput_ips": "fast"}),
    "throughput_mapping": ("batched", {"scenario": {"batch_size": 2}, "throughput_ips": {"a": 1}}),
    "rate_string": ("online", {"scenario": {"batch_size": 1}, "requested_qps": "x"}),
    "peak_ghost_points": (
        "peak",
        {"points": [{"evaluation_id": "ev-ghost"}, {"evaluation_id": "ev-ghost2"}]},
    ),
    "peak_mapping_point": ("peak", {"points": [{"evaluation_id": {"x": 1}}]}),
    "huge_batch": ("batched", {"scenario": {"batch_size": 10**30}, "throughput_ips": 5.0}),
    "nested_deep": ("online", "[" * 100_000 + "]" * 100_000),
}


def hostile_beside_honest(db: Database, case: str) -> None:
    scenario, summary = HOSTILE[case]
    honest = {**HONEST, "scenario": {"batch_size": 4}} if scenario == "batched" else HONEST
    fill(
        db,
        [row("ev-honest", scenario, honest, age_s=10), row("ev-bad", scenario, summary)],
        # The hostile run's queries were lost (its stored figures are then what the pages
        # read); the unreadable one keeps them, so that Compare has latencies to compare.
        query_rows("ev-honest", 40) + (query_rows("ev-bad", 40) if case == "nested_deep" else []),
    )


@pytest.mark.parametrize("case", list(HOSTILE))
def test_results_renders_the_honest_run_beside_a_hostile_one(dash: Database, case: str) -> None:
    hostile_beside_honest(dash, case)
    at = page("results.py", eval="ev-bad")
    assert {"ev-honest", "ev-bad"} <= set(at.dataframe[0].value["evaluation_id"])


def test_peak_points_naming_missing_runs_are_named(dash: Database) -> None:
    hostile_beside_honest(dash, "peak_ghost_points")
    at = page("results.py", eval="ev-bad")
    assert "not stored, left out: ev-ghost, ev-ghost2" in shown_text(at)


def test_run_page_starts_from_a_run_whose_rate_is_not_a_number(dash: Database) -> None:
    hostile_beside_honest(dash, "rate_string")
    at = page("run.py", eval="ev-bad")
    assert at.selectbox(key="run_model").value == "digits_cnn"
    assert at.number_input(key="run_qps").value == 100.0  # the default, not "x"


def test_overview_lists_a_run_with_a_huge_batch_size(dash: Database) -> None:
    hostile_beside_honest(dash, "huge_batch")
    at = page("home.py")
    table = at.dataframe[0].value
    assert set(table["evaluation"]) == {"ev-honest", "ev-bad"}
    assert set(table["batch"]) == {1, 4}  # 10**30 is no batch size: the default


# ---------------------------------------------------------------- Compare


def test_compare_leaves_out_a_run_that_answered_nothing(dash: Database) -> None:
    """Honest data: a comparable run whose every query failed is named and left out."""
    fill(
        dash,
        [
            row("ev-old", "online", HONEST, age_s=20),
            row("ev-failed", "online", {**HONEST, "errors": 40}, age_s=10),
            row("ev-new", "online", HONEST),
        ],
        query_rows("ev-old", 40) + query_rows("ev-new", 40) + query_rows("ev-failed", 40, ok=False),
    )
    at = page("compare.py")  # the defaults: the newest run against the runs like it
    assert "No answered queries, left out: ev-failed" in shown_text(at)
    assert at.subheader[0].value == "ev-old vs ev-new"
    assert len(at.metric) == 2


def test_compare_reads_a_run_whose_summary_cannot_be_read(dash: Database) -> None:
    hostile_beside_honest(dash, "nested_deep")
    at = page("compare.py", eval="ev-bad")
    assert "ev-honest vs ev-bad" in [s.value for s in at.subheader]
    assert len(at.metric) == 2


# ---------------------------------------------------------------- the API's edge


def misuse(call: str) -> ConfigError:
    """Call ``call`` on a Client that is not connected: the arguments are refused first."""
    client = Client(Settings(nats_url="nats://127.0.0.1:1"))
    calls: dict[str, Any] = {
        "cancel_int": lambda: client.cancel(123),  # type: ignore[arg-type]
        "cancel_long": lambda: client.cancel("j" * 100_000),
        "cancel_reason": lambda: client.cancel("job-1", reason=5),  # type: ignore[arg-type]
        "submit_mapping": lambda: client.submit({"model": "noop"}),  # type: ignore[arg-type]
        "evaluations_string": lambda: client.evaluations("ev-1"),
        "queries_int": lambda: client.queries(7),  # type: ignore[arg-type]
    }

    async def go() -> None:
        await calls[call]()

    with pytest.raises(ConfigError) as info:
        anyio.run(go, backend="asyncio")
    return info.value


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        ("cancel_int", "job_id"),
        ("cancel_long", "job_id"),
        ("cancel_reason", "reason"),
        ("submit_mapping", "job"),
        ("evaluations_string", "ids"),
        ("queries_int", "evaluation_id"),
    ],
)
def test_api_misuse_is_a_config_error_naming_the_argument(call: str, argument: str) -> None:
    err = misuse(call)
    assert isinstance(err, MLScopeError) and isinstance(err, ValueError)
    assert err.fields["argument"] == argument
    assert argument in str(err)


@pytest.mark.parametrize("view", ["results.py", "run.py"])
def test_an_address_naming_no_evaluation_is_shown_cut_short(dash: Database, view: str) -> None:
    """``?eval=`` is whatever the address holds: a page names it in its warning, quoted
    and cut short, not echoed whole (200 KB here)."""
    fill(dash, [row("ev-honest", "online", HONEST)], query_rows("ev-honest", 40))
    huge = "x" * 200_000
    at = page(view, eval=huge)
    warned = [str(w.value) for w in at.warning if "No evaluation" in str(w.value)]
    assert warned, shown_text(at)[:500]
    assert all(len(w) < 300 and "…" in w for w in warned), [len(w) for w in warned]
