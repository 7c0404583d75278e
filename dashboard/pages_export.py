"""Export: download a checkpoint as a PEFT adapter (its files as a .zip) or merged into its base model (a Hugging Face
model directory the server builds with ExportMergedModel, as a .zip); the dashboard itself never loads weights."""
from __future__ import annotations

import streamlit as st

from dashboard import api, logic_serve
from dashboard.logic import md_escape
from trainyard import TrainyardError
from trainyard.v1 import scheduler_pb2 as pb

READY = "export_ready"  # session state: {(checkpoint id, "adapter" | "merged"): zip bytes} prepared for download

client = api.require_client()
st.title("Export")
checkpoints = client.list_checkpoints()
if not checkpoints:
    st.info("No checkpoints yet: a job writes them as it trains (see the Jobs page).")
    st.stop()
by_id = {c.id: c for c in checkpoints}
finals = [c.id for c in checkpoints if c.final]
picked = st.selectbox("Checkpoint", list(by_id), index=list(by_id).index(finals[-1]) if finals else 0,
                      format_func=lambda i: logic_serve.checkpoint_label(by_id[i]))
ckpt = by_id[picked]
lora = ckpt.kind == pb.CHECKPOINT_KIND_LORA_ADAPTER
size = sum(f.size_bytes for f in ckpt.files)
st.caption(f"base model {md_escape(ckpt.base_model)} · {len(ckpt.files)} files · {size / 2**20:,.2f} MiB · "
           + ("LoRA adapter" if lora else "whole model (full-parameter)"))
ready: dict = st.session_state.setdefault(READY, {})


def prepare(kind: str, build, label: str) -> None:
    """A button that builds the .zip (once per checkpoint and kind), then the download button for it."""
    key = (ckpt.id, kind)
    if key not in ready and st.button(label, key=f"prepare-{kind}"):
        try:
            with st.spinner("Preparing the archive..."):
                ready.clear()  # one archive held at a time: it lives in this server's memory
                ready[key] = build(client, ckpt.id)
        except TrainyardError as exc:
            api.show_error(exc)
    if key in ready:
        st.download_button(f"Download {ckpt.id}-{kind}.zip", ready[key], file_name=f"{ckpt.id}-{kind}.zip",
                           mime="application/zip", key=f"download-{kind}", icon=":material/download:")
        st.caption(f"{len(ready[key]) / 2**20:,.2f} MiB compressed")


adapter_col, merged_col = st.columns(2)
with adapter_col:
    st.subheader("PEFT adapter" if lora else "Model files")
    st.caption("adapter_config.json and adapter_model.safetensors, as peft's save_pretrained writes them: load with "
               "PeftModel.from_pretrained(base, dir), or deploy elsewhere." if lora else
               "The checkpoint is a whole Hugging Face model directory already.")
    prepare("adapter" if lora else "model", logic_serve.adapter_zip, "Prepare the .zip")
with merged_col:
    st.subheader("Merged Hugging Face weights")
    if lora:
        st.caption("The adapter merged into the base model (W + B·A·alpha/r) by the server, with the base's "
                   "tokenizer: load with AutoModelForCausalLM.from_pretrained(dir), no peft needed.")
        prepare("merged", logic_serve.merged_zip, "Merge and prepare the .zip")
    else:
        st.caption("Nothing to merge: the files on the left are the whole model.")
