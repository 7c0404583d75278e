"""Datasets: upload a JSONL file (checked as a whole; a file with any bad row is not stored, and its problems are
listed under the file), list, preview, count tokens under a base model, delete."""
from __future__ import annotations

import streamlit as st

from dashboard import api, logic
from dashboard.logic import md_escape
from trainyard import TrainyardError
from trainyard.client import format_name

LAST_UPLOAD = "last_upload"  # session state: the UploadOutcome shown under the uploader
CONFIRM_DELETE = "confirm_delete_dataset"  # session state: the dataset whose deletion awaits confirmation
DELETED = "deleted_dataset"  # session state: the name of the dataset just deleted, for the message
DEFAULT_MODEL = "tiny-qwen3"
DEFAULT_MAX_SEQ_LEN = 2048  # SFT's declared default (trainyard/methods/sft.py); the server checks the value


def show_outcome(outcome: logic.UploadOutcome) -> None:
    """What became of the last upload, right under the file: stored (with the mapping applied and the first rows),
    or the rows that kept it out."""
    if outcome.ok:
        ds = outcome.dataset
        if outcome.deduplicated:
            st.info(f"You had already uploaded this exact file as **{md_escape(ds.name)}**; nothing new was stored.")
        else:
            st.success(f"Stored **{md_escape(outcome.filename)}** as dataset **{md_escape(ds.name)}**.")
        if outcome.mapping:
            st.info(f"Mapped on upload: {md_escape(outcome.mapping)}.", icon=":material/swap_horiz:")
        with st.container(horizontal=True, gap="medium"):  # each as wide as its text: a third cuts the id short
            st.metric("Dataset id", ds.id, width="content")
            st.metric("Format", format_name(ds.format), width="content")
            st.metric("Rows", ds.num_rows, width="content")
        st.caption(f"The first {len(outcome.preview)} rows, as stored:")
        st.table(logic.preview_frame(outcome.preview))
        return
    bad_rows = {row for row, _, _ in outcome.violations if row}
    if len(bad_rows) == 1:
        where = f"row {min(bad_rows)} of {outcome.num_rows} has a problem"
    else:
        where = f"{len(bad_rows)} of its {outcome.num_rows} rows have problems" if bad_rows else "the file has problems"
    st.error(f"**{md_escape(outcome.filename)} was not stored**: {where}. Fix what is listed below and upload the "
             "file again.")
    if outcome.mapping:
        st.caption(f"Rows read as {md_escape(outcome.mapping.split(':')[0])}; rows and fields are the file's own.")
    st.table(logic.violations_table(outcome), hide_index=True)
    if outcome.truncated:
        st.caption(f"Only the first {len(outcome.violations)} problems are listed.")


client = api.require_client()
st.title("Datasets")

st.subheader("Upload a dataset")
st.caption("One JSON object per line. Chat rows: `{\"messages\": [{\"role\": \"user\", \"content\": ...}, "
           "{\"role\": \"assistant\", \"content\": ...}]}`; prompt/completion rows: `{\"prompt\": ..., "
           "\"completion\": ...}`; preference pairs: `{\"prompt\", \"chosen\", \"rejected\"}`; RFT prompts: "
           "`{\"prompt\": ..., \"answer\": ...}`. ShareGPT (`{\"conversations\": [{\"from\": \"human\", \"value\": "
           "...}]}`) and Alpaca (`{\"instruction\", \"input\", \"output\"}`) files are mapped onto chat and "
           "prompt/completion rows. Every row is checked before anything is stored.")
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
if outcome is not None:
    show_outcome(outcome)

st.divider()
st.subheader("Your datasets")
deleted = st.session_state.pop(DELETED, None)
if deleted:
    st.success(f"Deleted dataset **{md_escape(deleted)}**.")
datasets = client.list_datasets()
if not datasets:
    st.info("No datasets yet: upload a JSONL file above.")
    st.stop()
st.dataframe(logic.datasets_frame(datasets), hide_index=True)

by_id = {d.id: d for d in datasets}
ids = list(by_id)
just_uploaded = outcome.dataset.id if outcome is not None and outcome.ok else None
picked = st.selectbox("Dataset", ids, index=ids.index(just_uploaded) if just_uploaded in by_id else 0,
                      format_func=lambda i: logic.dataset_label(by_id[i]))
ds = by_id[picked]

st.markdown("#### Preview")
left, right = st.columns(2)
first = left.number_input("From row", min_value=1, max_value=max(1, ds.num_rows), value=1, step=1)
count = right.number_input("Rows", min_value=1, max_value=100, value=10, step=1)
rows = client.preview_dataset(picked, offset=int(first) - 1, limit=int(count))
st.table(logic.preview_frame(rows, first_row=int(first)))

st.markdown("#### Token statistics")
models = client.list_models()
if not models:
    st.info("No base models are available to count tokens with. An operator imports one with "
            "`trainyard models import`.")
else:
    names = [m.name for m in models]
    left, right = st.columns(2)
    model_name = left.selectbox("Base model", names,
                                index=names.index(DEFAULT_MODEL) if DEFAULT_MODEL in names else 0,
                                help="Tokens are counted with this model's tokenizer and chat template.")
    context = next(m.max_position_embeddings for m in models if m.name == model_name)
    max_seq_len = right.number_input("Max sequence length", min_value=1, step=1,
                                     value=min(DEFAULT_MAX_SEQ_LEN, context) if context else DEFAULT_MAX_SEQ_LEN,
                                     help="Rows longer than this are counted as truncated.")
    try:
        with st.spinner("Counting tokens..."):
            stats = client.token_stats(picked, model_name, int(max_seq_len))
    except TrainyardError as exc:
        api.show_error(exc)
    else:
        cols = st.columns(5)
        cols[0].metric("Rows", f"{stats.rows:,}")
        cols[1].metric("Mean tokens", f"{stats.mean_tokens:,.1f}")
        cols[2].metric("p95 tokens", f"{stats.p95_tokens:,}")
        cols[3].metric("Max tokens", f"{stats.max_tokens:,}")
        cols[4].metric("Over max_seq_len", f"{stats.over_max_seq_len:,}")
        summary, fit = logic.token_stats_lines(stats)
        st.caption(summary)
        (st.warning if stats.over_max_seq_len else st.caption)(fit)

st.markdown("#### Delete")
if st.session_state.get(CONFIRM_DELETE) != picked:
    if st.button("Delete this dataset", icon=":material/delete:"):
        st.session_state[CONFIRM_DELETE] = picked
        st.rerun()
else:
    st.warning(f"Delete **{md_escape(ds.name)}** ({ds.id}, {ds.num_rows} rows)? It disappears from your list and "
               "can no longer be trained on; finished jobs and their checkpoints stay.")
    yes, no = st.columns(2)
    if yes.button("Yes, delete it", type="primary"):
        st.session_state.pop(CONFIRM_DELETE, None)
        try:
            client.delete_dataset(picked)
        except TrainyardError as exc:
            api.show_error(exc)
        else:
            st.session_state[DELETED] = ds.name
            if just_uploaded == picked:
                st.session_state.pop(LAST_UPLOAD, None)
            st.rerun()
    if no.button("Cancel"):
        st.session_state.pop(CONFIRM_DELETE, None)
        st.rerun()
