"""Jobs: every job of the account in a table (status, progress, duration, ETA), then one job's panel: its warnings
(overfitting, divergence, no learning), progress, live charts of every metric it has (other runs overlaid, smoothed),
log; cancel, resume, clone it, or deploy it once it has succeeded.

The panel is a fragment that reruns every REFRESH_S seconds while the job is queued or running; when the job ends it
reruns the whole page once, which then shows the deploy form (succeeded) and stops refreshing.
"""
from __future__ import annotations

from datetime import datetime, timezone

import streamlit as st

from dashboard import api, logic, logic_jobs
from dashboard.logic import md_escape
from trainyard import TrainyardError
from trainyard.client import TERMINAL, deployment_status_name, status_name
from trainyard.methods import METHODS
from trainyard.v1 import scheduler_pb2 as pb

JOB_ID = "job_id"  # session state: the job shown (also set by the Train page)
DEPLOYMENT = "deployment"  # session state: the deployment the Playground opens with
NOTICE = "jobs_notice"  # session state: what the last action did, shown once after the rerun it causes
REFRESH_S = 2.0
LOG_LINES = 30
BADGE = {"queued": "gray", "running": "blue", "succeeded": "green", "failed": "red", "cancelled": "orange"}
SHOWN_METRICS = ("train/loss", "eval/loss", "reward/mean", "train/lr", "train/grad_norm")

client = api.require_client()
conn = st.session_state[api.CONNECTION]
st.title("Jobs")


@st.cache_data(max_entries=512, show_spinner=False)
def _points(url: str, rollout_url: str, api_key: str, job_id: str, version: tuple) -> list[bytes]:
    """A job's metric points, cached while the job is unchanged (version: status, step, attempts, finish time); the
    key is part of the cache key, so no account reads another's cached points."""
    return [p.SerializeToString() for p in api.get_client(url, rollout_url, api_key).job_metrics(job_id)]


def points_of(job: pb.Job) -> list[pb.MetricPoint]:
    version = (job.status, job.step, job.attempts, job.finished_at.seconds)
    return [pb.MetricPoint.FromString(b) for b in _points(conn.url, conn.rollout_url, conn.api_key, job.id, version)]


jobs = client.list_jobs()
if not jobs:
    st.info("No jobs yet: launch one on the Train page.")
    st.page_link("pages_train.py", label="Go to Train", icon=":material/model_training:")
    st.stop()
by_id = {j.id: j for j in jobs}
ids = list(by_id)
now = datetime.now(timezone.utc)
# Metrics for the table: a running job's ETA, a finished training job's diagnosis.
read = {j.id: points_of(j) for j in jobs
        if j.status == pb.JOB_STATUS_RUNNING or (j.status in TERMINAL and logic_jobs.method_of(j).name in
                                                 logic_jobs.DIAGNOSED)}
st.dataframe(logic_jobs.jobs_frame(jobs, read, now), hide_index=True, width="stretch", column_config={
    "progress": st.column_config.ProgressColumn("progress", min_value=0.0, max_value=1.0, format="percent")})

notice = st.session_state.pop(NOTICE, None)
if notice:
    st.success(notice)


def job_label(job_id: str) -> str:
    j = by_id[job_id]
    name = f"{j.spec.display_name} ({j.id})" if j.spec.display_name else j.id
    return f"{name} · {status_name(j.status)} · {j.spec.base_model} · {logic.when(j.created_at)}"


current = st.session_state.get(JOB_ID)
pick, others = st.columns(2)
job_id = pick.selectbox("Job", ids, index=ids.index(current) if current in by_id else 0, format_func=job_label)
st.session_state[JOB_ID] = job_id
compare = others.multiselect("Compare with", [i for i in ids if i != job_id], format_func=job_label,
                             help="Other runs drawn on the same charts.")
smoothing = st.slider("Smoothing", 0.0, 0.99, 0.0, 0.01,
                      help="Exponential moving average of each curve (0: the values as logged); the raw values "
                           "stay faint behind the smoothed line.")


def run_label(job: pb.Job) -> str:
    return f"{logic_jobs.job_name(job)} ({job.id})" if job.spec.display_name else job.id


def job_panel(job_id: str, live: bool) -> None:
    try:
        job = client.get_job(job_id)
        head, action = st.columns([5, 1], vertical_alignment="bottom")
        if job.status not in TERMINAL and not job.cancel_requested:
            if action.button("Cancel job", key=f"cancel-{job_id}", icon=":material/cancel:"):
                job = client.cancel_job(job_id)
        points = client.job_metrics(job_id)
        runs = {run_label(job): points} | {run_label(by_id[o]): points_of(client.get_job(o)) for o in compare}
    except TrainyardError as exc:
        api.show_error(exc)
        return
    found = logic_jobs.diagnosis(job, points)
    status = status_name(job.status)
    warned = found is not None and bool(found.problems)
    badge = f":orange-badge[{status} with warnings]" if warned else f":{BADGE.get(status, 'gray')}-badge[{status}]"
    head.markdown(f"### {md_escape(logic_jobs.job_name(job))} {badge}")
    if warned:
        for problem, message in zip(found.problems, found.messages):
            st.warning(f"**{problem.capitalize()}**: {md_escape(message)}", icon=":material/warning:")
    facts = [f"id {job.id}", f"method {logic_jobs.method_of(job).name}", f"base model {job.spec.base_model}",
             f"dataset {job.spec.dataset_id}", f"created {logic.when(job.created_at)}"]
    if job.started_at.seconds:
        facts.append(f"started {logic.when(job.started_at)}")
    if job.finished_at.seconds:
        facts.append(f"finished {logic.when(job.finished_at)}")
    ran = logic_jobs.duration_text(logic_jobs.duration_s(job, datetime.now(timezone.utc)))
    if ran:
        facts.append(f"ran {ran}")
    if job.attempts > 1:
        facts.append(f"attempt {job.attempts} (resumed from its last checkpoint)")
    st.caption(" · ".join(facts) + " (times in UTC)")
    if job.status == pb.JOB_STATUS_FAILED:
        st.error(f"**The job failed**: {md_escape(job.error)}")
    elif job.cancel_requested and job.status not in TERMINAL:
        st.info("Cancellation requested: the job stops after its current step.")

    if job.total_steps:
        text = f"step {job.step} of {job.total_steps}"
        eta, rate = logic_jobs.eta_s(job, points), logic_jobs.seconds_per_step(points)
        if eta is not None:
            text += f" · ETA {logic_jobs.duration_text(eta)} at {rate:.2f} s/step"
        st.progress(min(job.step / job.total_steps, 1.0), text=text)
    else:
        st.progress(0.0, text="waiting for a worker" if job.status == pb.JOB_STATUS_QUEUED else f"step {job.step}")
    shown = [k for k in SHOWN_METRICS if k in job.latest_metrics]
    for col, key in zip(st.columns(len(shown)) if shown else [], shown):
        col.metric(key, f"{job.latest_metrics[key]:.4g}")

    frame = logic_jobs.overlay_frame(runs)
    if frame.empty:
        st.caption("The charts appear after the first training step.")
    else:
        charts = logic_jobs.charts_for(logic_jobs.smooth(frame, smoothing))
        for i in range(0, len(charts), 2):
            for col, (title, part) in zip(st.columns(2), charts[i:i + 2]):
                col.markdown(f"**{title}**")
                col.altair_chart(logic_jobs.metric_chart(part, title, smoothing > 0), width="stretch")

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
job = by_id[job_id]

# -- resume and clone ---------------------------------------------------------------------------------------------
if job.status in (pb.JOB_STATUS_FAILED, pb.JOB_STATUS_CANCELLED):
    if st.button("Resume from the last checkpoint", icon=":material/play_arrow:", key=f"resume-{job_id}",
                 help="Queue this job again (same id): it continues from its latest checkpoint."):
        try:
            resumed = client.resume_job(job_id)
        except TrainyardError as exc:
            api.show_error(exc)
        else:
            st.session_state[NOTICE] = f"Job {resumed.id} is {status_name(resumed.status)} again."
            st.rerun()

with st.expander("Clone this job", icon=":material/content_copy:"):
    spec = logic_jobs.clone_spec(job)
    method = METHODS[spec.method]
    with st.form(f"clone-{job_id}"):
        st.caption(f"A new {method.title.lower()} job on {job.spec.base_model} and dataset {job.spec.dataset_id}, "
                   "with this job's settings; change any of them first.")
        taken = {j.spec.display_name for j in jobs}
        clone_name = st.text_input("Name of the clone",
                                   value=logic_jobs.unique_name(f"{logic_jobs.job_name(job)}-clone", taken))
        main, advanced = logic.form_groups(method)
        edits, slots = {}, {}
        for group in (main, advanced):
            for i in range(0, len(group), 4):
                for col, f in zip(st.columns(4), group[i:i + 4]):
                    edits[f.name] = api.setting_input(col, f, spec.settings.get(f.name, f.default),
                                                      key=f"clone-{job_id}-{f.name}")
                    slots[f.name] = col.empty()
        if st.form_submit_button("Create the clone", icon=":material/content_copy:"):
            args, kwargs = spec.create_args(clone_name.strip(), **edits)
            try:
                cloned = client.create_job(*args, **kwargs)
            except TrainyardError as exc:
                api.show_error_at_inputs(exc, method, slots, "The clone was not created")
            else:
                st.session_state[JOB_ID] = cloned.id
                st.session_state[NOTICE] = f"Created job {cloned.id}, a clone of {job.id}."
                st.rerun()


# -- deploy ---------------------------------------------------------------------------------------------------------
if job.status == pb.JOB_STATUS_SUCCEEDED and logic_jobs.method_of(job).trains:
    st.subheader("Deploy")
    deployments = client.list_deployments()
    with st.form(f"deploy-{job_id}"):
        st.caption("Serve the job's final adapter under a name, then try it in the Playground. To deploy an earlier "
                   "checkpoint (say the best one), use the Checkpoints page.")
        name = st.text_input("Deployment name", value=logic_jobs.deployment_name(job, {d.name for d in deployments}))
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
if job.spec.method == pb.JOB_METHOD_EVAL:
    st.session_state["evaluation_id"] = job.id  # the Evaluations page opens on it
    st.page_link("pages_evaluations.py", label="This evaluation's results", icon=":material/fact_check:")
else:
    st.page_link("pages_checkpoints.py", label="This job's checkpoints", icon=":material/save:")
