"""Jobs: one job's status, progress, live loss chart and log; cancel it, or deploy it once it has succeeded.

The panel is a fragment that reruns every REFRESH_S seconds while the job is queued or running; when the job ends it
reruns the whole page once, which then shows the deploy form (succeeded) and stops refreshing.
"""
from __future__ import annotations

import re

import streamlit as st

from dashboard import api, logic
from dashboard.logic import md_escape
from trainyard import TrainyardError
from trainyard.client import TERMINAL, deployment_status_name, status_name
from trainyard.v1 import scheduler_pb2 as pb

JOB_ID = "job_id"  # session state: the job shown (also set by the Train page)
DEPLOYMENT = "deployment"  # session state: the deployment the Playground opens with
REFRESH_S = 2.0
LOG_LINES = 30
BADGE = {"queued": "gray", "running": "blue", "succeeded": "green", "failed": "red", "cancelled": "orange"}
SHOWN_METRICS = ("train/loss", "eval/loss", "train/lr", "train/grad_norm")

client = api.require_client()
st.title("Jobs")

jobs = client.list_jobs()
if not jobs:
    st.info("No jobs yet: launch one on the Train page.")
    st.page_link("pages_train.py", label="Go to Train", icon=":material/model_training:")
    st.stop()
by_id = {j.id: j for j in jobs}
ids = list(by_id)
current = st.session_state.get(JOB_ID)


def job_label(job_id: str) -> str:
    j = by_id[job_id]
    name = f"{j.spec.display_name} ({j.id})" if j.spec.display_name else j.id
    return f"{name} · {status_name(j.status)} · {j.spec.base_model} · {logic.when(j.created_at)}"


job_id = st.selectbox("Job", ids, index=ids.index(current) if current in by_id else 0, format_func=job_label)
st.session_state[JOB_ID] = job_id


def job_panel(job_id: str, live: bool) -> None:
    try:
        job = client.get_job(job_id)
        head, action = st.columns([5, 1], vertical_alignment="bottom")
        if job.status not in TERMINAL and not job.cancel_requested:
            if action.button("Cancel job", key=f"cancel-{job_id}", icon=":material/cancel:"):
                job = client.cancel_job(job_id)
        points = client.job_metrics(job_id)
    except TrainyardError as exc:
        api.show_error(exc)
        return
    status = status_name(job.status)
    head.markdown(f"### {md_escape(job.spec.display_name or job.id)} :{BADGE.get(status, 'gray')}-badge[{status}]")
    facts = [f"id {job.id}", f"base model {job.spec.base_model}", f"dataset {job.spec.dataset_id}",
             f"created {logic.when(job.created_at)}"]
    if job.started_at.seconds:
        facts.append(f"started {logic.when(job.started_at)}")
    if job.finished_at.seconds:
        facts.append(f"finished {logic.when(job.finished_at)}")
    if job.attempts > 1:
        facts.append(f"attempt {job.attempts} (a worker was lost; resumed from its last checkpoint)")
    st.caption(" · ".join(facts) + " (times in UTC)")
    if job.status == pb.JOB_STATUS_FAILED:
        st.error(f"**The job failed**: {md_escape(job.error)}")
    elif job.cancel_requested and job.status not in TERMINAL:
        st.info("Cancellation requested: the job stops after its current step.")

    if job.total_steps:
        st.progress(min(job.step / job.total_steps, 1.0), text=f"step {job.step} of {job.total_steps}")
    else:
        st.progress(0.0, text="waiting for a worker" if job.status == pb.JOB_STATUS_QUEUED else f"step {job.step}")
    shown = [k for k in SHOWN_METRICS if k in job.latest_metrics]
    for col, key in zip(st.columns(len(SHOWN_METRICS)), shown):
        col.metric(key, f"{job.latest_metrics[key]:.4g}")

    frame = logic.metrics_frame(points)
    if frame.empty:
        st.caption("The loss chart appears after the first training step.")
    else:
        st.altair_chart(logic.loss_chart(frame), width="stretch")

    try:
        logs = client.job_logs(job_id)[-LOG_LINES:]
    except TrainyardError as exc:
        st.caption(f"The log is unavailable: {exc.code}: {md_escape(exc.message)}")
        logs = []
    if logs:
        st.markdown("**Log** (UTC, most recent last)")
        st.code("\n".join(f"{e.time.ToDatetime():%H:%M:%S} {e.level.upper():<7} {e.message}" for e in logs),
                language=None, wrap_lines=True)

    if live and job.status in TERMINAL:
        st.rerun()  # the whole page, once: show the deploy form and stop refreshing


live = by_id[job_id].status not in TERMINAL
st.fragment(job_panel, run_every=REFRESH_S if live else None)(job_id, live)


def default_deployment_name(job: pb.Job, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", job.spec.display_name).strip("-._")[:100] or job.id
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    return name


job = by_id[job_id]
if job.status == pb.JOB_STATUS_SUCCEEDED:
    st.subheader("Deploy")
    deployments = client.list_deployments()
    with st.form(f"deploy-{job_id}"):
        st.caption("Serve the job's final adapter under a name, then try it in the Playground.")
        name = st.text_input("Deployment name", value=default_deployment_name(job, {d.name for d in deployments}))
        if st.form_submit_button("Deploy", type="primary", icon=":material/rocket_launch:"):
            try:
                with st.spinner("Loading the adapter on the rollout service..."):
                    dep = client.create_deployment(name.strip(), job_id=job_id)
            except TrainyardError as exc:
                api.show_error(exc)
            else:
                st.session_state[DEPLOYMENT] = dep.name
                st.success(f"Deployment **{md_escape(dep.name)}** is {deployment_status_name(dep.status)}.")
                deployments = client.list_deployments()
    mine = [d for d in deployments if d.job_id == job_id]
    for d in mine:
        about, action = st.columns([5, 1], vertical_alignment="center")
        problem = f" · {md_escape(d.error)}" if d.error else ""
        about.markdown(f"**{md_escape(d.name)}** · {deployment_status_name(d.status)} · created "
                       f"{logic.when(d.created_at)} (UTC){problem}")
        # A failed deployment keeps its name until it is deleted.
        if action.button("Delete", key=f"delete-{d.id}", icon=":material/delete:"):
            try:
                client.delete_deployment(d.id)
            except TrainyardError as exc:
                api.show_error(exc)
            else:
                st.rerun()
    if any(d.status == pb.DEPLOYMENT_STATUS_READY for d in mine):
        st.page_link("pages_playground.py", label="Try it in the Playground", icon=":material/chat:")
