"""Evaluations: evaluation jobs (method "eval": a checkpoint or a base model sampled on an rft dataset's rows and
scored by an evaluator) with their results, each row's results, and a form to launch one.

The per-row table is the evaluation's results file (docs/evaluation.md: its output checkpoint holds results.jsonl),
downloaded through the SDK, which verifies every file against its sha256.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd
import streamlit as st

from dashboard import api, logic, logic_jobs
from dashboard.logic import md_escape
from trainyard import TrainyardError
from trainyard.client import TERMINAL, format_name, status_name
from trainyard.methods import METHODS
from trainyard.v1 import scheduler_pb2 as pb

EVAL_ID = "evaluation_id"  # session state: the evaluation shown
EVALUATE = "evaluate_checkpoint"  # session state: the checkpoint the launch form opens with (the Checkpoints page's)
REFRESH_S = 2.0
METHOD = METHODS["eval"]
OWN_INPUTS = ("evaluator", "checkpoint_id")  # settings with an input of their own (chosen from lists) in the form
SCORES = (("eval/pass@1", "pass@1"), ("eval/pass@k", "pass@k"), ("eval/reward_mean", "reward mean"),
          ("eval/errors", "evaluator errors"))

client = api.require_client()
conn = st.session_state[api.CONNECTION]
st.title("Evaluations")


@st.cache_data(max_entries=64, show_spinner=False)
def _results(url: str, rollout_url: str, api_key: str, checkpoint_id: str) -> pd.DataFrame:
    """An evaluation's per-row results (its results checkpoint never changes; the key is part of the cache key)."""
    with tempfile.TemporaryDirectory() as tmp:
        dest = api.get_client(url, rollout_url, api_key).download_checkpoint(checkpoint_id, Path(tmp) / "r")
        return logic_jobs.results_frame(dest / logic_jobs.RESULTS_FILE)


evaluations = [j for j in client.list_jobs() if j.spec.method == pb.JOB_METHOD_EVAL]
if evaluations:
    st.dataframe(logic_jobs.evaluations_frame(evaluations), hide_index=True, width="stretch",
                 column_config={k: st.column_config.NumberColumn(format="%.3f")
                                for k in ("pass@1", "pass@k", "reward mean")})
    by_id = {j.id: j for j in evaluations}
    ids = list(by_id)
    current = st.session_state.get(EVAL_ID)
    eval_id = st.selectbox("Evaluation", ids, index=ids.index(current) if current in by_id else 0,
                           format_func=lambda i: f"{logic_jobs.job_name(by_id[i])} ({i}) · "
                                                 f"{status_name(by_id[i].status)}")
    st.session_state[EVAL_ID] = eval_id

    def evaluation_panel(eval_id: str, live: bool) -> None:
        try:
            job = client.get_job(eval_id)
        except TrainyardError as exc:
            api.show_error(exc)
            return
        cfg = logic_jobs.eval_settings(job)
        status = status_name(job.status)
        st.markdown(f"### {md_escape(logic_jobs.job_name(job))} · {status}")
        what = f"checkpoint {cfg['checkpoint_id']}" if cfg.get("checkpoint_id") else \
            f"the base model {job.spec.base_model}"
        st.caption(f"{what} · evaluator {cfg.get('evaluator', '')} · dataset {job.spec.dataset_id} · "
                   f"{cfg.get('samples_per_row')} samples per row · temperature {cfg.get('temperature')}")
        if job.status == pb.JOB_STATUS_FAILED:
            st.error(f"**The evaluation failed**: {md_escape(job.error)}")
        elif job.status not in TERMINAL:
            st.progress(min(job.step / job.total_steps, 1.0) if job.total_steps else 0.0,
                        text=f"{job.step} of {job.total_steps} rows" if job.total_steps else status)
        shown = [(key, label) for key, label in SCORES if key in job.latest_metrics]
        for col, (key, label) in zip(st.columns(len(shown)) if shown else [], shown):
            col.metric(label, f"{job.latest_metrics[key]:.3f}" if key != "eval/errors"
                       else f"{job.latest_metrics[key]:.0f}")
        if job.status == pb.JOB_STATUS_SUCCEEDED and job.output_checkpoint_id:
            try:
                rows = _results(conn.url, conn.rollout_url, conn.api_key, job.output_checkpoint_id)
            except TrainyardError as exc:
                api.show_error(exc)
            else:
                st.markdown(f"**Per-row results** ({len(rows)} rows; the file is checkpoint "
                            f"{job.output_checkpoint_id})")
                st.dataframe(rows, hide_index=True, width="stretch",
                             column_config={"reward mean": st.column_config.NumberColumn(format="%.3f")})
        if live and job.status in TERMINAL:
            st.rerun()

    live = by_id[eval_id].status not in TERMINAL
    st.fragment(evaluation_panel, run_every=REFRESH_S if live else None)(eval_id, live)
else:
    st.info("No evaluations yet: launch one below.")

# -- launch -------------------------------------------------------------------------------------------------------
st.subheader("Launch an evaluation")
evaluators = client.list_evaluators()
datasets = [d for d in client.list_datasets() if format_name(d.format) in METHOD.dataset_formats]
checkpoints = [c for c in client.list_checkpoints()
               if c.kind in (pb.CHECKPOINT_KIND_LORA_ADAPTER, pb.CHECKPOINT_KIND_FULL)]
models = [m.name for m in client.list_models()]
BASE = ""  # the checkpoint choice that evaluates a base model itself
ckpt_by_id = {c.id: c for c in sorted(checkpoints, key=lambda c: (c.job_id, c.step))}
options = [*ckpt_by_id, BASE]
wanted = st.session_state.get(EVALUATE)
choice = st.selectbox("Checkpoint", options, index=options.index(wanted) if wanted in options else 0,
                      format_func=lambda i: f"{ckpt_by_id[i].job_id} · step {ckpt_by_id[i].step} · {i}"
                      + (" · final" if ckpt_by_id[i].final else "") if i else "none: a base model itself")
if choice:
    base_model = ckpt_by_id[choice].base_model
    st.caption(f"Base model {base_model} (the checkpoint's).")
else:
    base_model = st.selectbox("Base model", models)
if not evaluators:
    st.info("Upload an evaluator first (the Evaluators page): it scores each completion.")
    st.stop()
if not datasets:
    st.info(f"Upload a dataset in the {' or '.join(METHOD.dataset_formats)} format first: its rows are the prompts.")
    st.stop()

with st.form("launch-evaluation"):
    left, right = st.columns(2)
    refs = [f"{e.name}@{e.version}" for e in evaluators]
    evaluator = left.selectbox("Evaluator", refs)  # newest version of each name first
    ds_by_id = {d.id: d for d in datasets}
    dataset_id = right.selectbox("Dataset", list(ds_by_id), format_func=lambda i: logic.dataset_label(ds_by_id[i]))
    name = st.text_input("Evaluation name", placeholder="optional")
    fields = [f for f in METHOD.fields() if f.name not in OWN_INPUTS]
    values, slots = {}, {}
    for i in range(0, len(fields), 4):
        for col, f in zip(st.columns(4), fields[i:i + 4]):
            values[f.name] = api.setting_input(col, f, f.default, key=f"eval-{f.name}")
            slots[f.name] = col.empty()
    if st.form_submit_button("Launch evaluation", type="primary", icon=":material/play_arrow:"):
        try:
            job = client.create_job("eval", base_model, dataset_id, name.strip(), evaluator=evaluator,
                                    checkpoint_id=choice or None, **values)
        except TrainyardError as exc:
            api.show_error_at_inputs(exc, METHOD, slots, "The evaluation was not launched")
        else:
            st.session_state[EVAL_ID] = job.id
            st.rerun()
