"""The Results page's Regressions tab on stored runs of three framework versions, one of
which answered no query: the step it cannot judge is named with why, beside the step
it judged. Rows are written straight into a real chDB and read through
:class:`analysis.source.DirectSource`, in AppTest (as in ``test_dashboard_hostile``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import streamlit as st

import dashboard.common as common
from analysis.source import DirectSource
from broker.db import EVALUATION_COLUMNS, Database
from tests.test_dashboard_hostile import HONEST, fill, page, query_rows, row

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def dash(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Database]:
    """A chDB of this module's own (one engine path per process at a time), read by
    the pages through a DirectSource."""
    d = Database(f"chdb:///{tmp_path_factory.mktemp('regressions') / 'chdb'}")
    d.migrate()
    source = DirectSource(d)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "source", lambda: source)
        mp.setattr(common, "agents", list)
        st.cache_data.clear()
        try:
            yield d
        finally:
            d.close()


def at_version(ev: str, version: str, *, age_s: float) -> list[Any]:
    """An online run of digits_cnn on onnxruntime ``version``."""
    r = row(ev, "online", HONEST, age_s=age_s)
    r[EVALUATION_COLUMNS.index("framework_version")] = version
    return r


def test_a_step_with_a_run_that_answered_nothing_is_named(dash: Database) -> None:
    fill(
        dash,
        [
            at_version("ev-v19", "1.19", age_s=30),
            at_version("ev-v20", "1.20", age_s=20),
            at_version("ev-v21", "1.21", age_s=10),
        ],
        query_rows("ev-v19", 40) + query_rows("ev-v20", 40) + query_rows("ev-v21", 40, ok=False),
    )
    at = page("results.py", eval="ev-v21")
    infos = [str(i.value) for i in at.info]
    assert "Not compared, left out: 1.20 → 1.21 (ev-v21 answered no query)" in infos, infos
    judged = next(
        d.value for d in at.dataframe if "from_version" in getattr(d.value, "columns", ())
    )
    assert list(zip(judged["from_version"], judged["to_version"], strict=True)) == [
        ("1.19", "1.20")
    ]
    assert "skipped" not in judged.columns
