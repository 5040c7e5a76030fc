"""What every dashboard page shares: settings, the database source, cached reads.

Pages render frames that :mod:`analysis` computes; nothing here computes statistics.
Reads are cached for a few seconds (a page re-runs its script on every click).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import anyio
import pandas as pd
import streamlit as st

from analysis.chart import Chart
from analysis.chartsvg import svg
from analysis.data import evaluations
from analysis.source import BusSource, DirectSource, open_source
from mlscope.catalog import Catalog, default_manifest_dirs
from mlscope.contracts import AgentDescription
from mlscope.errors import MLScopeError
from mlscope.settings import Settings

__all__ = [
    "agents",
    "catalog",
    "comparable",
    "deep_link",
    "eval_label",
    "evaluation_picker",
    "recent_evaluations",
    "settings",
    "show",
    "source",
    "stop_on_error",
]

TTL_S = 3
FIG_WIDTH = 760  # pixels: a figure stretched to a wide page is hard to read


def show(chart: Chart, *, width: int | Literal["stretch"] = FIG_WIDTH, on: Any = st) -> None:
    """Draw ``chart`` (an SVG image) on the page, or on ``on`` (a column)."""
    on.image(svg(chart), width=width)


@st.cache_resource
def settings() -> Settings:
    """The settings of the process (the same environment as every mlscope command)."""
    return Settings.from_env()


@st.cache_resource
def source() -> DirectSource | BusSource:
    return open_source(settings())


@st.cache_resource
def catalog() -> Catalog:
    return Catalog.load(default_manifest_dirs(settings().manifests_dir))


def stop_on_error(exc: MLScopeError) -> None:
    st.error(f"{type(exc).__name__}: {exc}")
    st.info(
        "Is the stack running? `mlscope up` (or `mlscope server` + `mlscope agent`), "
        "with the same MLSCOPE_NATS_URL / MLSCOPE_DATA_DIR as this dashboard."
    )
    st.stop()


@st.cache_data(ttl=TTL_S, show_spinner=False)
def agents() -> list[dict[str, Any]]:
    """The live registry, as plain dicts (cacheable)."""
    from mlscope.bus import connect
    from mlscope.registry import list_agents

    async def fetch() -> list[AgentDescription]:
        async with connect(settings(), name="mlscope dashboard") as bus:
            return await list_agents(bus)

    found = anyio.run(fetch, backend="asyncio")
    return [a.model_dump(mode="json", by_alias=True) for a in found]


@st.cache_data(ttl=TTL_S, show_spinner=False)
def recent_evaluations() -> pd.DataFrame:
    return evaluations(source())


def eval_label(row: Any) -> str:
    return (
        f"{row.evaluation_id} · {row.model}/{row.framework} · {row.scenario} "
        f"b={row.batch_size} · {pd.Timestamp(row.created_at):%m-%d %H:%M:%S}"
        + ("" if row.valid else " · INVALID")
    )


def deep_link() -> str | None:
    """The evaluation named in the page's address (``?eval=EV_ID``), if any."""
    got = st.query_params.get("eval")
    return str(got) if got else None


SHOWN_MAX_CHARS = 80
"""An address's value is shown at most this long (the rest elided): it may be anything."""


def shown(text: str) -> str:
    """``text`` from the page's address as a page may show it: quoted, cut short."""
    cut = text if len(text) <= SHOWN_MAX_CHARS else text[:SHOWN_MAX_CHARS] + "…"
    return repr(cut)


def comparable(ev: pd.DataFrame, anchor: str | None, *, limit: int = 12) -> list[str]:
    """``anchor`` (default: the newest run) and the newest runs sharing its model and
    scenario: the runs a person most likely wants side by side, not the whole history."""
    if ev.empty:
        return []
    rows = ev[ev["evaluation_id"] == anchor] if anchor else ev.head(1)
    if rows.empty:
        rows = ev.head(1)
    first = rows.iloc[0]
    same = ev[(ev["model"] == first["model"]) & (ev["scenario"] == first["scenario"])]
    ids = [str(first["evaluation_id"])]
    ids += [str(e) for e in same["evaluation_id"] if e != first["evaluation_id"]]
    return ids[:limit]


def evaluation_picker(
    label: str, *, key: str, multi: bool = False, link: bool = True, besides: Sequence[str] = ()
) -> list[str]:
    """A select box (or multiselect) of the stored evaluations, newest first.

    ``?eval=EV_ID`` in the address picks that evaluation (``link``); a multiselect
    starts with it and the runs comparable to it (:func:`comparable`; those in
    ``besides`` left out), and a select box writes its choice back to the address so
    that the page can be shared.
    """
    try:
        ev = recent_evaluations()
    except MLScopeError as exc:
        stop_on_error(exc)
        return []
    if ev.empty:
        st.info("No evaluations yet: run one on the Run page or with `mlscope-submit`.")
        st.stop()
    labels = {r.evaluation_id: eval_label(r) for r in ev.itertuples()}
    ids = list(labels)
    wanted = deep_link() if link else None
    if wanted is not None and wanted not in labels:
        st.warning(f"No evaluation {shown(wanted)} (from the address); showing the newest.")
        wanted = None
    if multi:
        picked = st.multiselect(
            label,
            ids,
            default=[e for e in comparable(ev, wanted) if e not in besides],
            format_func=labels.__getitem__,
            key=key,
        )
        return list(picked)
    index = ids.index(wanted) if wanted else 0
    one = st.selectbox(label, ids, index=index, format_func=labels.__getitem__, key=key)
    if link and one and one != wanted:
        st.query_params["eval"] = one
    return [one] if one else []
