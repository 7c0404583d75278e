"""Trainyard dashboard: `streamlit run dashboard/app.py` (docker-compose.yml's dashboard service runs exactly this).

The entry point draws the sidebar connection (scheduler URL, rollout URL, API key; prefilled from TRAINYARD_URL,
TRAINYARD_ROLLOUT_URL and TRAINYARD_API_KEY) and routes to the pages, which talk to the platform only through the
Python SDK. A server error that a page does not handle itself is still shown as an error message, not a traceback.
"""
from __future__ import annotations

import streamlit as st

from dashboard import api
from trainyard import TrainyardError

st.set_page_config(page_title="Trainyard", page_icon=":material/train:", layout="wide")
page = st.navigation([
    st.Page("pages_datasets.py", title="Datasets", icon=":material/dataset:", url_path="datasets", default=True),
    st.Page("pages_train.py", title="Train", icon=":material/model_training:", url_path="train"),
    st.Page("pages_jobs.py", title="Jobs", icon=":material/monitoring:", url_path="jobs"),
    st.Page("pages_playground.py", title="Playground", icon=":material/chat:", url_path="playground"),
    st.Page("pages_evaluators.py", title="Evaluators", icon=":material/rule:", url_path="evaluators"),
])
api.sidebar_connection()
try:
    page.run()
except TrainyardError as exc:
    api.show_error(exc)
