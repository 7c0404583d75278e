"""Datasets: upload a JSONL file (checked as a whole; a file with any bad row is not stored), list and preview."""
from __future__ import annotations

import streamlit as st

from dashboard import api, logic
from dashboard.logic import md_escape
from trainyard import TrainyardError
from trainyard.client import format_name

LAST_UPLOAD = "last_upload"  # session state: the UploadOutcome shown under the uploader

client = api.require_client()
st.title("Datasets")

st.subheader("Upload a dataset")
st.caption("One JSON object per line. Chat rows: `{\"messages\": [{\"role\": \"user\", \"content\": ...}, "
           "{\"role\": \"assistant\", \"content\": ...}]}`; prompt/completion rows: `{\"prompt\": ..., "
           "\"completion\": ...}`. Every row is checked before anything is stored.")
file = st.file_uploader("JSONL file", type=["jsonl", "json"])
left, right = st.columns(2)
fmt = left.selectbox("Format", logic.FORMATS, help="auto detects the format from the rows; any other choice is "
                     "checked against every row.")
name = right.text_input("Name", placeholder="defaults to the file name")
if st.button("Validate and upload", type="primary", disabled=file is None):
    st.session_state.pop(LAST_UPLOAD, None)
    try:
        with st.spinner(f"Checking {file.name}..."):
            st.session_state[LAST_UPLOAD] = logic.upload_jsonl(client, file.getvalue(), file.name, fmt, name.strip())
    except TrainyardError as exc:
        api.show_error(exc)

outcome: logic.UploadOutcome | None = st.session_state.get(LAST_UPLOAD)
if outcome is not None and outcome.ok:
    ds = outcome.dataset
    if outcome.deduplicated:
        st.info(f"You had already uploaded this exact file as **{md_escape(ds.name)}**; nothing new was stored.")
    else:
        st.success(f"Stored **{md_escape(outcome.filename)}** as dataset **{md_escape(ds.name)}**.")
    cols = st.columns(3)
    cols[0].metric("Dataset id", ds.id)
    cols[1].metric("Format", format_name(ds.format))
    cols[2].metric("Rows", ds.num_rows)
    st.caption(f"The first {len(outcome.preview)} rows:")
    st.table(logic.preview_frame(outcome.preview))
elif outcome is not None:
    bad_rows = {row for row, _, _ in outcome.violations if row}
    if len(bad_rows) == 1:
        where = f"row {min(bad_rows)} of {outcome.num_rows} has a problem"
    else:
        where = f"{len(bad_rows)} of its {outcome.num_rows} rows have problems" if bad_rows else "the file has problems"
    st.error(f"**{md_escape(outcome.filename)} was not stored**: {where}. Fix what is listed below and upload the "
             "file again.")
    st.table(logic.violations_table(outcome), hide_index=True)
    if outcome.truncated:
        st.caption(f"Only the first {len(outcome.violations)} problems are listed.")

st.divider()
st.subheader("Your datasets")
datasets = client.list_datasets()
if not datasets:
    st.info("No datasets yet: upload a JSONL file above.")
    st.stop()
st.dataframe(logic.datasets_frame(datasets), hide_index=True)

by_id = {d.id: d for d in datasets}
ids = list(by_id)
just_uploaded = outcome.dataset.id if outcome is not None and outcome.ok else None
picked = st.selectbox("Preview", ids, index=ids.index(just_uploaded) if just_uploaded in by_id else 0,
                      format_func=lambda i: logic.dataset_label(by_id[i]))
left, right = st.columns(2)
first = left.number_input("From row", min_value=1, max_value=max(1, by_id[picked].num_rows), value=1, step=1)
count = right.number_input("Rows", min_value=1, max_value=100, value=10, step=1)
rows = client.preview_dataset(picked, offset=int(first) - 1, limit=int(count))
st.table(logic.preview_frame(rows, first_row=int(first)))
