"""Playground: sample from a deployment and, side by side, from its base model, with the same prompt and seed."""
from __future__ import annotations

import streamlit as st

from dashboard import api
from dashboard.logic import md_escape
from trainyard import TrainyardError
from trainyard.v1 import scheduler_pb2 as pb

DEPLOYMENT = "deployment"  # session state: the deployment shown (also set by the Jobs page after a deploy)
OUTPUTS = "playground_outputs"  # session state: {column title: SampleResponse | TrainyardError} of the last run

client = api.require_client()
st.title("Playground")

deployments = [d for d in client.list_deployments() if d.status == pb.DEPLOYMENT_STATUS_READY]
if not deployments:
    st.info("No deployments yet: deploy a succeeded job from the Jobs page.")
    st.page_link("pages_jobs.py", label="Go to Jobs", icon=":material/monitoring:")
    st.stop()
by_name = {d.name: d for d in deployments}
names = list(by_name)
current = st.session_state.get(DEPLOYMENT)
name = st.selectbox("Deployment", names, index=names.index(current) if current in by_name else 0,
                    format_func=lambda n: f"{n} · base {by_name[n].base_model} · job {by_name[n].job_id or '-'}")
st.session_state[DEPLOYMENT] = name
dep = by_name[name]
compare = st.toggle(f"Compare with the base model ({dep.base_model})", value=True)

mode = st.radio("Prompt as", ["Chat", "Raw text"], horizontal=True,
                help="Chat renders your message with the model's chat template; raw text is tokenized as is.")
system = st.text_input("System prompt", placeholder="optional") if mode == "Chat" else ""
prompt = st.text_area("Message" if mode == "Chat" else "Text", height=120)
cols = st.columns(3)
temperature = cols[0].slider("Temperature", 0.0, 2.0, 0.7, 0.05, help="0 always picks the most likely token.")
max_tokens = cols[1].number_input("Max tokens", min_value=1, max_value=4096, value=128, step=16)
seed = cols[2].number_input("Seed", value=0, step=1, help="The same seed and prompt give the same output.")

if st.button("Generate", type="primary", icon=":material/play_arrow:"):
    if not prompt.strip():
        st.warning("Write a prompt first.")
    else:
        request: dict = {"temperature": float(temperature), "max_tokens": int(max_tokens), "seed": int(seed)}
        if mode == "Chat":
            turns = [{"role": "system", "content": system}] if system.strip() else []
            request["messages"] = turns + [{"role": "user", "content": prompt}]
        else:
            request["prompt"] = prompt
        targets = ([(f"Base model · {dep.base_model}", dep.base_model)] if compare else []) + \
            [(f"Fine-tuned · {dep.name}", dep.name)]
        outputs = {}
        with st.spinner("Sampling..."):
            for title, model in targets:
                try:
                    outputs[title] = client.sample(model, **request)
                except TrainyardError as exc:
                    outputs[title] = exc
        st.session_state[OUTPUTS] = outputs

outputs = st.session_state.get(OUTPUTS)
if outputs:
    for col, (title, result) in zip(st.columns(len(outputs)), outputs.items()):
        with col:
            st.markdown(f"**{md_escape(title)}**")
            if isinstance(result, TrainyardError):
                api.show_error(result)
                continue
            seq = result.sequences[0]
            if seq.text:
                st.code(seq.text, language=None, wrap_lines=True)  # exactly as sampled, whitespace included
            else:
                st.caption("(empty output)")
            st.caption(f"{len(result.prompt_tokens)} prompt tokens · {len(seq.tokens)} generated · "
                       f"stopped by {seq.finish_reason or 'unknown'}")
