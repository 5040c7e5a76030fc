"""Compare: a baseline run against candidates, with bootstrap verdicts."""

from __future__ import annotations

import streamlit as st

from analysis import plots
from analysis.compare import SINGLE_RUN_NOTE, compare_runs, mismatches
from analysis.rows import latencies_ms
from dashboard.common import evaluation_picker, recent_evaluations, show, source
from mlscope.errors import MLScopeError

st.title("Compare runs")
base = evaluation_picker("Baseline", key="compare_base")
cands = evaluation_picker("Candidates", key="compare_cands", multi=True, besides=base)
cands = [c for c in cands if c not in base]
# A sweep's parent (batch sizes, a peak search) holds a summary, not queries: its runs
# are the ones to compare.
ev = recent_evaluations()
runs_of = dict(zip(ev["evaluation_id"], ev["runs"], strict=True))
for e in [*base, *cands]:
    if runs_of.get(e):
        st.info(f"{e} is a sweep of {len(runs_of[e])} runs, not a run: pick its runs.")
base = [e for e in base if not runs_of.get(e)]
cands = [e for e in cands if not runs_of.get(e)]
# A run that answered no query (every query failed, or it was cancelled first) has no
# latency to compare: it is left out, and named.
lat = latencies_ms(source(), [*base, *cands])
silent = [e for e in [*base, *cands] if e not in lat]
if silent:
    st.info(f"No answered queries, left out: {', '.join(silent)}")
base = [e for e in base if e in lat]
cands = [e for e in cands if e in lat]
if not base or not cands:
    st.info("Pick a baseline and at least one other evaluation.")
    st.stop()
conf = st.select_slider("Confidence", [0.9, 0.95, 0.99], value=0.95, key="compare_conf")
for cand in cands:
    st.subheader(f"{cand} vs {base[0]}")
    # The listing's rows: a run whose stored JSON cannot be read shows what its columns say.
    pair = ev[ev["evaluation_id"].isin([base[0], cand])]
    why = mismatches(pair, base[0])
    if why:
        st.warning("Not comparable: " + "; ".join(why))
    try:
        table = compare_runs(
            source(),
            base[0],
            cand,
            confidence=float(conf),
            check=False,
            runs=pair,
            latencies=lat,
        )
    except MLScopeError as exc:
        st.warning(f"{cand} vs {base[0]} cannot be compared: {exc}")
        continue
    for note in dict.fromkeys(table["note"]):
        if note:
            st.info(note)
    for row in table.itertuples():
        st.metric(
            f"{row.statistic} latency: {row.verdict}",
            f"{row.b:.3f} ms",
            delta=f"{row.rel:+.1%}",
            delta_color="inverse",
        )
    st.dataframe(table, hide_index=True)
    st.caption(SINGLE_RUN_NOTE)
st.subheader("Latency by percentile")
show(plots.latency_percentiles({e: lat[e] for e in [*base, *cands]}))
