"""Train: choose a base model and an SFT dataset, set the hyperparameters, approve the plan, launch a LoRA SFT job.

Values are checked by the server, not here, so what the user sees for a bad value is the server's own field error.
"""
from __future__ import annotations

import streamlit as st

from dashboard import api, logic
from trainyard import TrainyardError
from trainyard.client import LR_SCHEDULERS, format_name

LAUNCHED = "launched_job"  # session state: id of the job launched from this page
JOB_ID = "job_id"  # session state: the job the Jobs page shows
DEFAULT_MODEL = "tiny-qwen3"
# Request fields of the server's violations -> the labels of the inputs below.
FIELD_LABELS = {
    "spec.base_model": "Base model", "spec.dataset_id": "Dataset", "spec.sft.lora.rank": "LoRA rank",
    "spec.sft.lora.alpha": "LoRA alpha", "spec.sft.learning_rate": "Learning rate", "spec.sft.epochs": "Epochs",
    "spec.sft.max_steps": "Max steps", "spec.sft.batch_size": "Batch size",
    "spec.sft.checkpoint_every": "Checkpoint every", "spec.sft.eval_fraction": "Eval fraction",
    "spec.sft.warmup_steps": "Warmup steps", "spec.sft.lr_scheduler": "LR schedule",
    "spec.sft.gradient_accumulation_steps": "Gradient accumulation", "spec.sft.max_seq_len": "Max sequence length",
    "spec.sft.seed": "Seed",
}

client = api.require_client()
st.title("Train")

models = client.list_models()
datasets = [d for d in client.list_datasets() if format_name(d.format) in logic.SFT_FORMATS]
if not models:
    st.warning("No base models are available. An operator imports one with `trainyard models import`.")
    st.stop()
if not datasets:
    st.info("Upload a dataset in the sft_chat or sft_prompt_completion format first.")
    st.page_link("pages_datasets.py", label="Go to Datasets", icon=":material/upload:")
    st.stop()

models_by_name = {m.name: m for m in models}
datasets_by_id = {d.id: d for d in datasets}
names = list(models_by_name)
left, right = st.columns(2)
model_name = left.selectbox("Base model", names, index=names.index(DEFAULT_MODEL) if DEFAULT_MODEL in names else 0)
model = models_by_name[model_name]
left.caption(f"{model.architecture} · {model.num_parameters:,} parameters · {model.num_layers} layers · "
             f"context {model.max_position_embeddings}")
dataset_id = right.selectbox("Dataset", list(datasets_by_id),
                             format_func=lambda i: logic.dataset_label(datasets_by_id[i]))
display_name = st.text_input("Job name", placeholder="optional, e.g. support-bot-v1")

st.subheader("Hyperparameters")
d = logic.SftPlan()
cols = st.columns(4)
lora_rank = cols[0].number_input("LoRA rank", value=d.lora_rank, step=1, help="Adapter size (1-1024).")
lora_alpha = cols[1].number_input("LoRA alpha", value=d.lora_alpha, step=1.0, help="Adapter scale; usually 2 x rank.")
learning_rate = cols[2].number_input("Learning rate", value=d.learning_rate, step=1e-5, format="%.2e")
batch_size = cols[3].number_input("Batch size", value=d.batch_size, step=1, help="Sequences per micro-batch.")
cols = st.columns(4)
length = cols[0].radio("Train for", ["Epochs", "Max steps"])
if length == "Epochs":
    epochs, max_steps = cols[1].number_input("Epochs", value=d.epochs, step=1), 0
else:
    epochs, max_steps = d.epochs, cols[1].number_input("Max steps", value=100, step=10)
checkpoint_every = cols[2].number_input("Checkpoint every", value=d.checkpoint_every, step=10, help="Steps between "
                                        "checkpoints (and eval passes).")
eval_fraction = cols[3].number_input("Eval fraction", value=d.eval_fraction, step=0.05, format="%.2f",
                                     help="Share of rows held out for the eval loss; 0 turns eval off.")
with st.expander("Advanced"):
    cols = st.columns(5)
    warmup_steps = cols[0].number_input("Warmup steps", value=d.warmup_steps, step=1)
    lr_scheduler = cols[1].selectbox("LR schedule", list(LR_SCHEDULERS))
    accumulation = cols[2].number_input("Gradient accumulation", value=d.gradient_accumulation_steps, step=1)
    max_seq_len = cols[3].number_input("Max sequence length", value=min(d.max_seq_len, model.max_position_embeddings),
                                       step=128)
    seed = cols[4].number_input("Seed", value=d.seed, step=1)

plan = logic.SftPlan(
    lora_rank=int(lora_rank), lora_alpha=float(lora_alpha), learning_rate=float(learning_rate), epochs=int(epochs),
    max_steps=int(max_steps), batch_size=int(batch_size), gradient_accumulation_steps=int(accumulation),
    checkpoint_every=int(checkpoint_every), eval_fraction=float(eval_fraction), warmup_steps=int(warmup_steps),
    lr_scheduler=lr_scheduler, max_seq_len=int(max_seq_len), seed=int(seed))

st.subheader("Plan")
st.markdown("\n".join(f"- {line}" for line in plan.summary(model, datasets_by_id[dataset_id])))
if st.button("Launch training", type="primary"):
    st.session_state.pop(LAUNCHED, None)
    try:
        job = client.create_sft_job(model_name, dataset_id, display_name.strip(), **plan.job_kwargs())
    except TrainyardError as exc:
        api.show_error(exc, FIELD_LABELS)
    else:
        st.session_state[LAUNCHED] = st.session_state[JOB_ID] = job.id

launched = st.session_state.get(LAUNCHED)
if launched:
    st.success(f"Launched job **{launched}**. It is queued and starts when a worker is free.")
    if st.button("Watch it on the Jobs page", icon=":material/monitoring:"):
        st.session_state[JOB_ID] = launched
        st.switch_page("pages_jobs.py")
