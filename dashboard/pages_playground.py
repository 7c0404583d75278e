"""Playground: one chat sent to several models side by side with the same settings: a deployment (the tuned model),
its base model, and any checkpoint of the same base. Each column keeps its own conversation (its own answers are
its history); Reset clears them. Max tokens is bounded by the model's context less the longest conversation."""
from __future__ import annotations

import streamlit as st

from dashboard import api, logic_serve
from dashboard.logic import md_escape
from dashboard.logic_serve import Conversation, Turn
from trainyard import TrainyardError
from trainyard.v1 import scheduler_pb2 as pb

DEPLOYMENT = "deployment"  # session state: the deployment shown (also set by the Jobs page after a deploy)
CHATS = "playground_chats"  # session state: {column key: Conversation}
ERRORS = "playground_errors"  # session state: {column key: TrainyardError} of the last send
MAX_TOKENS = "playground_max_tokens"  # the Max tokens input's key: kept while its bound moves with the chats
NO_CHECKPOINT = ""

client = api.require_client()
st.title("Playground")

deployments = client.list_deployments()
ready = [d for d in deployments if d.status == pb.DEPLOYMENT_STATUS_READY]
if not ready:
    st.info("No deployments yet: deploy a succeeded job from the Jobs page.")
    st.page_link("pages_jobs.py", label="Go to Jobs", icon=":material/monitoring:")
    st.stop()
by_name = {d.name: d for d in ready}
names = list(by_name)
current = st.session_state.get(DEPLOYMENT)
name = st.selectbox("Deployment", names, index=names.index(current) if current in by_name else 0,
                    format_func=lambda n: f"{n} · base {by_name[n].base_model} · job {by_name[n].job_id or '-'}")
st.session_state[DEPLOYMENT] = name
dep = by_name[name]

left, right = st.columns(2, vertical_alignment="bottom")
compare = left.toggle(f"Compare with the base model ({dep.base_model})", value=True)
checkpoints = {c.id: c for c in client.list_checkpoints()
               if c.base_model == dep.base_model and c.kind == pb.CHECKPOINT_KIND_LORA_ADAPTER
               and c.id != dep.checkpoint_id}
picked = right.selectbox("Compare with a checkpoint", [NO_CHECKPOINT, *checkpoints],
                         format_func=lambda i: logic_serve.checkpoint_label(checkpoints[i]) if i else "(none)")

# (column key, title, the model name Sample takes)
columns = [(f"base:{dep.base_model}", f"Base model · {dep.base_model}", dep.base_model)] if compare else []
columns.append((f"deployment:{dep.id}", f"Fine-tuned · {dep.name}", dep.name))
if picked:
    # The rollout samples deployments and base models: a checkpoint is tried through a deployment that serves it.
    serving = next((d for d in ready if d.checkpoint_id == picked), None)
    if serving is not None:
        columns.append((f"checkpoint:{picked}", f"Checkpoint · step {checkpoints[picked].step} · {serving.name}",
                        serving.name))
    else:
        st.caption(f"No deployment serves {picked} yet; deploying it adds it next to {md_escape(dep.name)} on the "
                   "same base (multi-LoRA).")
        if st.button(f"Deploy {picked} to compare it", icon=":material/rocket_launch:"):
            try:
                with st.spinner("Loading the checkpoint into the rollout..."):
                    client.create_deployment(f"playground-{picked}", checkpoint_id=picked)
                st.rerun()
            except TrainyardError as exc:
                api.show_error(exc)

chats: dict[str, Conversation] = st.session_state.setdefault(CHATS, {})
errors: dict[str, TrainyardError] = st.session_state.setdefault(ERRORS, {})
conversations = [chats.setdefault(key, Conversation()) for key, _, _ in columns]
max_positions = client.get_model(dep.base_model).max_position_embeddings
bound = logic_serve.max_tokens_bound(max_positions, conversations)

system = st.text_input("System prompt", placeholder="optional; the same for every column")
cols = st.columns(4)
temperature = cols[0].slider("Temperature", 0.0, 2.0, 0.7, 0.05, help="0 always picks the most likely token.")
top_p = cols[1].slider("Top p", 0.05, 1.0, 1.0, 0.05, help="Sample only from the most likely tokens whose "
                       "probabilities add up to this.")
# The value lives in session state only (no value= as well, which Streamlit warns about): 128 at first, and the most
# that still fits once the conversations have grown past it.
st.session_state[MAX_TOKENS] = min(st.session_state.get(MAX_TOKENS, 128), bound)
max_tokens = cols[2].number_input("Max tokens", min_value=1, max_value=bound, step=16, key=MAX_TOKENS,
                                  help=f"At most {bound}: the model's context ({max_positions} tokens) less the "
                                       "longest conversation so far.")
# A column's max_tokens that did not fit its conversation is said under the input it concerns, not in the column.
too_long = {key: e for key, e in errors.items() if any(v.field == "params.max_tokens" for v in e.violations)}
titles = {key: title for key, title, _ in columns}
for key, exc in too_long.items():
    reasons = "; ".join(v.reason for v in exc.violations if v.field == "params.max_tokens")
    cols[2].error(f"{md_escape(titles.get(key, key))}: {md_escape(reasons)}")
seed = cols[3].number_input("Seed", value=0, step=1, help="The same seed and conversation give the same answer.")
message = st.text_area("Message", height=100, placeholder="One message, sent to every column")
send, reset = st.columns([1, 4])
if send.button("Send to all", type="primary", icon=":material/send:"):
    if not message.strip():
        st.warning("Write a message first.")
    else:
        with st.spinner("Sampling..."):
            for (key, _, model), chat in zip(columns, conversations):
                errors.pop(key, None)
                try:
                    result = client.sample(model, messages=logic_serve.request_messages(chat, system, message),
                                           temperature=float(temperature), top_p=float(top_p),
                                           max_tokens=int(max_tokens), seed=int(seed))
                except TrainyardError as exc:
                    errors[key] = exc
                    continue
                seq = result.sequences[0]
                chat.messages += [{"role": "user", "content": message},
                                  {"role": "assistant", "content": seq.text}]
                chat.turns.append(Turn(seq.text, len(result.prompt_tokens), len(seq.tokens), seq.finish_reason))
        st.rerun()  # the bound on Max tokens follows the conversations' new length
if reset.button("Reset conversations", icon=":material/restart_alt:"):
    chats.clear()
    errors.clear()
    st.rerun()

for col, (key, title, _), chat in zip(st.columns(len(columns)), columns, conversations):
    with col:
        st.markdown(f"**{md_escape(title)}**")
        turns = iter(chat.turns)
        for m in chat.messages:
            with st.chat_message(m["role"]):
                if m["role"] == "user":
                    st.markdown(md_escape(m["content"]))
                    continue
                turn = next(turns)
                if turn.text:
                    st.code(turn.text, language=None, wrap_lines=True)  # exactly as sampled, whitespace included
                else:
                    st.caption("(empty output)")
                st.caption(f"{turn.prompt_tokens} prompt tokens · {turn.generated_tokens} generated · "
                           f"stopped by {turn.finish_reason or 'unknown'}")
        if key in errors and key not in too_long:
            api.show_error(errors[key], {"messages": "Message"})
