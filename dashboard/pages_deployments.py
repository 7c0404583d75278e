"""Deployments: what the rollout serves (status, base model, checkpoint; several LoRA adapters on one base are served
together), deploy a job's final checkpoint or any checkpoint, repoint or delete one, and for each a copyable snippet
for the OpenAI-compatible endpoint (Python and curl) with a "Try it" call made from here."""
from __future__ import annotations

import streamlit as st

from dashboard import api, logic_serve
from dashboard.logic import md_escape
from trainyard import TrainyardError
from trainyard.client import deployment_status_name, status_name
from trainyard.v1 import scheduler_pb2 as pb

TRIED = "deployment_tried"  # session state: {deployment id: the endpoint's answer text}
BADGES = {"ready": "green", "deploying": "blue", "failed": "red", "deleted": "gray"}

client = api.require_client()
conn: api.Connection = st.session_state[api.CONNECTION]
st.title("Deployments")
public_url = logic_serve.openai_url(conn.rollout_url)
internal_url = logic_serve.openai_internal_url(conn.rollout_url)
st.caption(f"Every deployment answers on the OpenAI-compatible endpoint **{md_escape(public_url)}** under its name, "
           "with your API key as the bearer token.")

# -- deploy ----------------------------------------------------------------------------------------------------------
st.subheader("Deploy")
checkpoints = client.list_checkpoints()
jobs = [j for j in client.list_jobs() if status_name(j.status) == "succeeded"]
source = st.radio("Deploy from", ["A finished job", "A checkpoint"], horizontal=True)
job_id = checkpoint_id = ""
if source == "A finished job":
    by_job = {j.id: j for j in jobs}
    job_id = st.selectbox("Job", list(by_job), format_func=lambda i: f"{by_job[i].spec.display_name or i} · "
                          f"{by_job[i].spec.base_model} · {i}") or ""
    if not jobs:
        st.caption("No finished jobs yet: train one on the Train page.")
else:
    by_ckpt = {c.id: c for c in checkpoints}
    checkpoint_id = st.selectbox("Checkpoint", list(by_ckpt),
                                 format_func=lambda i: logic_serve.checkpoint_label(by_ckpt[i])) or ""
    if not checkpoints:
        st.caption("No checkpoints yet: jobs write them as they train.")
name = st.text_input("Deployment name", placeholder="letters, digits, '-', '_' and '.'")
if st.button("Deploy", type="primary", icon=":material/rocket_launch:", disabled=not (job_id or checkpoint_id)):
    try:
        with st.spinner("Loading the weights into the rollout..."):
            dep = client.create_deployment(name.strip(), job_id=job_id, checkpoint_id=checkpoint_id)
        st.success(f"Deployment **{md_escape(dep.name)}** is {deployment_status_name(dep.status)}.")
    except TrainyardError as exc:
        api.show_error(exc, {"name": "Deployment name", "job_id": "Job", "checkpoint_id": "Checkpoint"})

# -- the list --------------------------------------------------------------------------------------------------------
st.divider()
st.subheader("Your deployments")
deployments = client.list_deployments()
if not deployments:
    st.info("No deployments yet: deploy a finished job or a checkpoint above.")
    st.stop()
st.dataframe(logic_serve.deployments_frame(deployments), hide_index=True)
for base, names in logic_serve.served_together(deployments, checkpoints).items():
    if len(names) > 1:
        st.markdown(f"**{md_escape(base)}** serves {len(names)} LoRA adapters at once (multi-LoRA: one copy of the "
                    f"base, requests for any of them batched together): {md_escape(', '.join(names))}")

tried: dict = st.session_state.setdefault(TRIED, {})
for dep in deployments:
    with st.container(border=True):
        status = deployment_status_name(dep.status)
        serves = f"checkpoint {dep.checkpoint_id}" if dep.checkpoint_id else f"lineage {dep.lineage}"
        st.markdown(f"#### {md_escape(dep.name)} :{BADGES.get(status, 'gray')}-badge[{status}]")
        st.caption(f"base {md_escape(dep.base_model)} · {md_escape(serves)}"
                   + (f" · job {dep.job_id}" if dep.job_id else ""))
        if dep.error:
            st.error(md_escape(dep.error))
        python_tab, curl_tab = st.tabs(["Python (OpenAI client)", "curl"])
        python_tab.code(logic_serve.openai_snippet(public_url, dep.name), language="python")
        curl_tab.code(logic_serve.curl_snippet(public_url, dep.name), language="bash")
        st.caption(f"Set {logic_serve.KEY_VAR} to your API key first; the copy button is at the snippet's corner.")

        ask, go = st.columns([4, 1], vertical_alignment="bottom")
        message = ask.text_input("Message to try", value="Hello!", key=f"try-msg-{dep.id}")
        if go.button("Try it", key=f"try-{dep.id}", icon=":material/send:",
                     disabled=dep.status != pb.DEPLOYMENT_STATUS_READY):
            tried.pop(dep.id, None)
            try:
                with st.spinner(f"Calling {internal_url}/chat/completions..."):
                    answer = logic_serve.try_endpoint(internal_url, conn.api_key, dep.name, message)
                tried[dep.id] = answer["choices"][0]["message"]["content"]
            except TrainyardError as exc:
                api.show_error(exc)
        if dep.id in tried:
            st.markdown("The endpoint answered:")
            st.code(tried[dep.id] or "(empty answer)", language=None, wrap_lines=True)

        others = [c for c in checkpoints if c.base_model == dep.base_model and c.id != dep.checkpoint_id
                  and c.kind == pb.CHECKPOINT_KIND_LORA_ADAPTER]
        left, right = st.columns([4, 1], vertical_alignment="bottom")
        if dep.checkpoint_id and others:
            labels = {c.id: logic_serve.checkpoint_label(c) for c in others}
            target = left.selectbox("Serve another checkpoint", list(labels), key=f"repoint-to-{dep.id}",
                                    format_func=labels.__getitem__)
            if right.button("Repoint", key=f"repoint-{dep.id}", disabled=dep.status != pb.DEPLOYMENT_STATUS_READY):
                try:
                    with st.spinner("Loading the other checkpoint..."):
                        client.repoint_deployment(dep.id, target)
                    st.rerun()
                except TrainyardError as exc:
                    api.show_error(exc)
        if st.button("Delete", key=f"delete-{dep.id}", icon=":material/delete:"):
            try:
                client.delete_deployment(dep.id)
                tried.pop(dep.id, None)
                st.rerun()
            except TrainyardError as exc:
                api.show_error(exc)
