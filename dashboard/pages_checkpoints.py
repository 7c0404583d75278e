"""Checkpoints: a training job's checkpoints with the train and held-out loss at each one's step, the best one marked
(the lowest held-out loss), a deploy button for any of them, and each one's lifecycle: how long it is kept (a TTL),
shared with every account or not, deleted.

The best checkpoint is the one the run's diagnosis points to as well (services/planner/diagnose.py: an overfitting
run names the step of its lowest held-out loss, and the checkpoint nearest it is the one worth deploying).
"""
from __future__ import annotations

import streamlit as st

from dashboard import api, logic, logic_jobs
from dashboard.logic import md_escape
from trainyard import TrainyardError
from trainyard.client import deployment_status_name, status_name
from trainyard.v1 import scheduler_pb2 as pb

JOB_ID = "job_id"  # session state: the job shown (shared with the Jobs page)
DEPLOYMENT = "deployment"  # session state: the deployment the Playground opens with
EVALUATE = "evaluate_checkpoint"  # session state: the checkpoint the Evaluations page's launch form opens with

client = api.require_client()
st.title("Checkpoints")

jobs = [j for j in client.list_jobs() if j.spec.method != pb.JOB_METHOD_EVAL]  # (a loop job trains too)
if not jobs:
    st.info("No training jobs yet: launch one on the Train page; its checkpoints are listed here.")
    st.page_link("pages_train.py", label="Go to Train", icon=":material/model_training:")
    st.stop()
by_id = {j.id: j for j in jobs}
ids = list(by_id)
current = st.session_state.get(JOB_ID)
job_id = st.selectbox("Job", ids, index=ids.index(current) if current in by_id else 0,
                      format_func=lambda i: f"{logic_jobs.job_name(by_id[i])} ({i}) · "
                                            f"{status_name(by_id[i].status)} · {by_id[i].spec.base_model}")
st.session_state[JOB_ID] = job_id
job = by_id[job_id]

checkpoints = client.list_checkpoints(job_id)
points = client.job_metrics(job_id)
if not checkpoints:
    st.info(f"Job {job_id} has no checkpoints yet (it is {status_name(job.status)}): a job writes one every "
            "checkpoint_every steps and at the end.")
    st.stop()

best = logic_jobs.best_checkpoint(checkpoints, points)
found = logic_jobs.diagnosis(job, points)
if best is not None:
    st.success(f"**Best checkpoint**: step {best.step} ({best.id}), with the lowest held-out loss, "
               f"{logic_jobs.checkpoint_metric(best, points, 'eval/loss'):.4f}.", icon=":material/star:")
else:
    st.caption("No checkpoint has a held-out loss (the job held out no rows), so none is marked best.")
if found is not None:
    for problem, message in zip(found.problems, found.messages):
        st.warning(f"**{problem.capitalize()}**: {md_escape(message)}", icon=":material/warning:")
    if found.best_eval_step is not None and best is not None and found.best_eval_step != best.step:
        near = logic_jobs.nearest_checkpoint(checkpoints, found.best_eval_step)
        st.caption(f"The held-out loss was lowest at step {found.best_eval_step}; the nearest checkpoint is at step "
                   f"{near.step}.")

st.dataframe(logic_jobs.checkpoints_frame(checkpoints, points), hide_index=True, width="stretch",
             column_config={"best": st.column_config.CheckboxColumn("best"),
                            "final": st.column_config.CheckboxColumn("final"),
                            "train loss": st.column_config.NumberColumn(format="%.4f"),
                            "eval loss": st.column_config.NumberColumn(format="%.4f")})

candidate = best or max(checkpoints, key=lambda c: c.step)
if st.button(f"Evaluate the checkpoint at step {candidate.step}", icon=":material/fact_check:",
             help="Open the Evaluations page with this checkpoint chosen (the best one, else the latest)."):
    st.session_state[EVALUATE] = candidate.id
    st.switch_page("pages_evaluations.py")

st.subheader("Deploy a checkpoint")
ordered = sorted(checkpoints, key=lambda c: c.step)
labels = {c.id: f"step {c.step} · {c.id}" + (" · best" if best is not None and c.id == best.id else "")
          + (" · final" if c.final else "") for c in ordered}
deployments = client.list_deployments()
with st.form(f"deploy-checkpoint-{job_id}"):
    default = best or ordered[-1]
    chosen = st.selectbox("Checkpoint", list(labels), index=list(labels).index(default.id),
                          format_func=labels.__getitem__)
    name = st.text_input("Deployment name",
                         value=logic_jobs.deployment_name(job, {d.name for d in deployments}, "-checkpoint"))
    if st.form_submit_button("Deploy", type="primary", icon=":material/rocket_launch:"):
        try:
            with st.spinner("Loading the checkpoint on the rollout service..."):
                dep = client.create_deployment(name.strip(), checkpoint_id=chosen)
        except TrainyardError as exc:
            api.show_error(exc)
        else:
            st.session_state[DEPLOYMENT] = dep.name
            step = next(c.step for c in checkpoints if c.id == chosen)
            st.success(f"Deployment **{md_escape(dep.name)}** (the checkpoint at step {step}) is "
                       f"{deployment_status_name(dep.status)}.")
            deployments = client.list_deployments()

served = {c.id: c for c in checkpoints}
mine = [d for d in deployments if d.checkpoint_id in served]
if mine:
    st.markdown("**Deployments of this job's checkpoints**")
    for d in mine:
        st.markdown(f"- **{md_escape(d.name)}** · step {served[d.checkpoint_id].step} · "
                    f"{deployment_status_name(d.status)} · created {logic.when(d.created_at)} (UTC)")
    if any(d.status == pb.DEPLOYMENT_STATUS_READY for d in mine):
        st.page_link("pages_playground.py", label="Try it in the Playground", icon=":material/chat:")

# -- lifecycle -------------------------------------------------------------------------------------------------------
st.subheader("Keep, share or delete a checkpoint")
with st.container(border=True):
    target = st.selectbox("Checkpoint to manage", list(labels), index=list(labels).index(candidate.id),
                          format_func=labels.__getitem__, key=f"manage-{job_id}")
    ck = served[target]
    st.caption(f"Expires {logic.when(ck.expires_at) + ' (UTC)' if ck.HasField('expires_at') else 'never'} · "
               + ("shared: every account may read it" if ck.public else "private to your account"))
    keep, share, remove = st.columns(3, vertical_alignment="bottom")
    days = keep.number_input("Keep for (days)", min_value=0, value=0, step=1, key=f"ttl-days-{target}",
                             help="From now; 0 keeps it until you delete it. Expired, it is unreadable, then removed.")
    if keep.button("Set", key=f"ttl-{target}", icon=":material/schedule:"):
        try:
            client.set_checkpoint_ttl(target, int(days) * 86400 if days else None)
            st.rerun()
        except TrainyardError as exc:
            api.show_error(exc, {"ttl_seconds": "Keep for (days)"})
    if share.button("Stop sharing" if ck.public else "Share with every account", key=f"share-{target}",
                    icon=":material/lock:" if ck.public else ":material/public:",
                    help="Shared, any account may download it, load it as a training state or sample from it."):
        try:
            client.publish_checkpoint(target, not ck.public)
            st.rerun()
        except TrainyardError as exc:
            api.show_error(exc)
    sure = remove.checkbox("Yes, delete its files", key=f"sure-{target}")
    if remove.button("Delete", key=f"delete-{target}", icon=":material/delete:", disabled=not sure):
        try:
            client.delete_checkpoint(target)
            st.rerun()
        except TrainyardError as exc:  # e.g. a deployment serves it
            api.show_error(exc)
