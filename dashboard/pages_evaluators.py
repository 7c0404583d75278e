"""Evaluators: upload a reward function or environment (evaluator.py, or a .zip / .tar.gz package), list the versions,
edit one's source (test the edit on 5 rows of a dataset before saving it as the next version), and test one on N rows
of a dataset or on pasted rows, in the server's sandbox."""
from __future__ import annotations

import streamlit as st

from dashboard import api, logic, logic_evaluators as logic_ev
from dashboard.logic import md_escape
from trainyard import TrainyardError

LAST_TEST = "last_evaluator_test"  # session state: the EvaluatorTestResponse shown under the test button

EDITING = "editing_evaluator"  # session state: the evaluator id whose source the editor holds
EDITOR = "evaluator_editor"  # session state: the editor's text (None: the version is a package)
EDIT_TEST = "evaluator_editor_test"  # session state: the edited source's EvaluatorTestResponse
SAVED = "evaluator_editor_saved"  # session state: the message of a save, shown after the rerun it causes
SAVED_ID = "evaluator_editor_saved_id"  # session state: the version a save made, for the editor's selectbox


def show_test(resp) -> None:
    """A test's summary, per-row results and what the evaluator printed."""
    s = resp.summary
    cols = st.columns(4)
    cols[0].metric("Rows scored", f"{s.num_ok}/{s.num_rows}")
    cols[1].metric("Errors", s.num_errors)
    cols[2].metric("Mean reward", f"{s.reward_mean:.4g}")
    cols[3].metric("Time", f"{s.elapsed_s:.2f} s")
    st.dataframe(logic_ev.results_frame(resp), hide_index=True)
    if resp.output_tail:
        with st.expander("What the evaluator printed (last few KB)"):
            st.code(resp.output_tail)


client = api.require_client()
st.title("Evaluators")

st.subheader("Upload an evaluator")
st.caption("`evaluator.py` defining `reward_fn(completion: str, row: dict) -> float`, or `class Environment` with "
           "`reset(row) -> str` and `step(action) -> (observation, reward, done)`; or a .zip / .tar.gz holding it "
           "with the modules it imports. It runs sandboxed, with the standard library only. Uploading a name you "
           "have already adds its next version.")
file = st.file_uploader("Evaluator file", type=logic_ev.UPLOAD_TYPES)
name = st.text_input("Name", placeholder="e.g. exact-match")
if st.button("Check and upload", type="primary", disabled=file is None or not name.strip()):
    try:
        with st.spinner(f"Checking {file.name} in the sandbox..."):
            stored = client.upload_evaluator(file.getvalue(), name=name.strip(), filename=file.name)
        st.success(f"Stored **{md_escape(stored.name)}@{stored.version}** ({stored.kind}).")
    except TrainyardError as exc:
        api.show_error(exc)

st.divider()
st.subheader("Your evaluators")
evaluators = client.list_evaluators()
if not evaluators:
    st.info("No evaluators yet: upload an evaluator.py above.")
    st.stop()
st.dataframe(logic_ev.evaluators_frame(evaluators), hide_index=True)

st.subheader("Edit an evaluator")
st.caption("Change an evaluator's source, test the change on the first rows of a dataset in the sandbox, then save "
           "it as the evaluator's next version (the versions before it stay as they are).")
by_id = {e.id: e for e in evaluators}
if SAVED_ID in st.session_state:  # a save just made a new version: edit that one (set before the widget exists)
    st.session_state["edit_evaluator"] = st.session_state.pop(SAVED_ID)
edit_id = st.selectbox("Evaluator to edit", list(by_id), key="edit_evaluator",
                       format_func=lambda i: logic_ev.evaluator_label(by_id[i]))
if st.session_state.get(EDITING) != edit_id:  # a new choice loads its stored source into the editor
    st.session_state[EDITING] = edit_id
    st.session_state[EDITOR] = logic_ev.source_text(client.get_evaluator_source(edit_id))
    st.session_state.pop(EDIT_TEST, None)
if st.session_state[EDITOR] is None:
    st.info(f"{md_escape(by_id[edit_id].filename)} is a package of several files: edit them on your machine and "
            "upload the package above.")
else:
    code = st.text_area("Source (evaluator.py)", key=EDITOR, height=320)
    datasets = client.list_datasets()
    ds_by_id = {d.id: d for d in datasets}
    test_ds = st.selectbox("Dataset to test on", list(ds_by_id), key="edit_dataset",
                           format_func=lambda i: logic.dataset_label(ds_by_id[i]))
    if not datasets:
        st.caption("Upload a dataset on the Datasets page to test on its rows.")
    n = logic_ev.EDITOR_TEST_ROWS
    left, right = st.columns(2)
    if left.button(f"Test on {n} rows", key="edit_test", disabled=test_ds is None or not code.strip()):
        st.session_state.pop(EDIT_TEST, None)
        try:
            with st.spinner("Running the edited evaluator in the sandbox..."):
                st.session_state[EDIT_TEST] = client.test_evaluator("", dataset_id=test_ds, num_rows=n,
                                                                    content=code.encode())
        except TrainyardError as exc:
            api.show_error(exc)
    ev = by_id[edit_id]
    if right.button(f"Save as {ev.name}@{max(e.version for e in evaluators if e.name == ev.name) + 1}",
                    key="edit_save", type="primary", disabled=not code.strip()):
        try:
            with st.spinner("Checking the source in the sandbox..."):
                stored = client.upload_evaluator(code.encode(), name=ev.name, filename="evaluator.py")
            st.session_state[SAVED_ID] = stored.id
            st.session_state[SAVED] = f"Saved **{md_escape(stored.name)}@{stored.version}** ({stored.kind})."
            st.rerun()
        except TrainyardError as exc:
            api.show_error(exc)
    if st.session_state.get(SAVED):
        st.success(st.session_state.pop(SAVED))
    if st.session_state.get(EDIT_TEST) is not None:
        show_test(st.session_state[EDIT_TEST])

st.divider()
st.subheader("Test on sample rows")
picked = st.selectbox("Evaluator", list(by_id), format_func=lambda i: logic_ev.evaluator_label(by_id[i]))
source = st.radio("Rows from", ["A dataset", "Rows I paste"], horizontal=True)
rows, dataset_id, count = [], "", 0
if source == "A dataset":
    datasets = client.list_datasets()
    if not datasets:
        st.info("No datasets yet: upload one on the Datasets page, or paste rows.")
        st.stop()
    ds_by_id = {d.id: d for d in datasets}
    left, right = st.columns(2)
    dataset_id = left.selectbox("Dataset", list(ds_by_id), format_func=lambda i: logic.dataset_label(ds_by_id[i]))
    count = int(right.number_input("Rows", min_value=1, max_value=100, value=10, step=1))
    st.caption("Each row's completion is its `completion` field, or its last assistant message.")
else:
    pasted = st.text_area("Rows (JSONL)", placeholder='{"answer": "4", "completion": "4"}')
    rows, problems = logic_ev.parse_rows(pasted)
    for problem in problems:
        st.error(md_escape(problem))
    count = len(rows)
if st.button(f"Test on {count} rows", disabled=count == 0):
    st.session_state.pop(LAST_TEST, None)
    try:
        with st.spinner("Running the evaluator in the sandbox..."):
            st.session_state[LAST_TEST] = client.test_evaluator(picked, rows=rows, dataset_id=dataset_id,
                                                                num_rows=count if dataset_id else 0)
    except TrainyardError as exc:
        api.show_error(exc)

if st.session_state.get(LAST_TEST) is not None:
    show_test(st.session_state[LAST_TEST])
