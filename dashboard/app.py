"""The mlscope dashboard: ``mlscope dashboard`` runs ``streamlit run`` on this file.

Multipage through ``st.navigation``; each page is a script under ``views/`` (each can
also be run, and tested, on its own), at ``/<file name>``: ``/agents``, ``/results``...
Every page that shows one evaluation takes it from the address: ``/trace?eval=EV_ID``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import streamlit as st

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `streamlit run dashboard/app.py` from a checkout
    sys.path.insert(0, str(ROOT))

VIEWS = Path(__file__).resolve().parent / "views"
# Material icons ship with Streamlit's front end (emoji would need a system font).
# The first page is the default: Streamlit serves it at "/" and at no other path, so
# a page of its own (Overview) leaves /agents, /models... all reachable by address.
PAGES = (
    ("home.py", "Overview", ":material/home:"),
    ("agents.py", "Agents", ":material/dns:"),
    ("models.py", "Models", ":material/inventory_2:"),
    ("run.py", "Run", ":material/play_arrow:"),
    ("results.py", "Results", ":material/bar_chart:"),
    ("compare.py", "Compare", ":material/compare_arrows:"),
    ("trace.py", "Trace", ":material/timeline:"),
)

st.set_page_config(page_title="mlscope", layout="wide")
page = st.navigation([st.Page(VIEWS / f, title=t, icon=i) for f, t, i in PAGES])
page.run()
