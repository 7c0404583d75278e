"""Describe and plan: the Training Agent (services/planner/) turns a task description and a dataset into a plan —
method, base model, every setting with why, the estimate, warnings — for the user to edit, re-plan and approve
explicitly; an RFT plan's drafted evaluator is read, edited and tested on rows first. Or a small sweep of the
learning rate: its jobs run on the server, so the page finds them again by their names and names the winner when
they have finished.
"""
from __future__ import annotations

from dataclasses import replace

import streamlit as st

from dashboard import api, logic, logic_plan
from dashboard.logic import md_escape
from dashboard.logic_evaluators import results_frame
from services.planner.agent import SWEEPS, AgentPlan, TrainingAgent
from services.planner.rules import PlanningError
from trainyard import TrainyardError
from trainyard.client import TERMINAL
from trainyard.methods import METHODS
from trainyard.methods.spec import format_value
from trainyard.v1 import scheduler_pb2 as pb

PLAN = "agent_plan"  # session state: the AgentPlan shown
PLAN_VERSION = "agent_plan_version"  # session state: counts plans, so each one's edit inputs start from its values
EVALUATOR_TEST = "agent_evaluator_test"  # session state: (the source tested, the last "Test on 5 rows" answer)
APPROVED = "agent_approved_job"  # session state: the job created by "Approve and train"
JOB_ID = "job_id"  # session state: the job the Jobs page shows
AGENT_CHOOSES = "(the agent chooses)"
RULES_ONLY = "(none: rules only)"
REFRESH_S = 3.0


def editor_key() -> str:
    """The evaluator editor's widget key: one per plan, so a new plan's editor starts from its draft."""
    return f"agent_evaluator_{st.session_state.get(PLAN_VERSION, 0)}"

client = api.require_client()
st.title("Describe and plan")
st.caption("Describe what the model should do and pick your data: the Training Agent proposes the method, the base "
           "model and every setting by rules it shows you, prices the run, and creates nothing until you approve.")

datasets = client.list_datasets()
if not datasets:
    st.info("Upload a dataset first: the agent plans from your rows.")
    st.page_link("pages_datasets.py", label="Go to Datasets", icon=":material/upload:")
    st.stop()
by_id = {d.id: d for d in datasets}
models = [m.name for m in client.list_models()]

description = st.text_area("Describe the task", placeholder="e.g. Answer customer questions about our product the "
                           "way our support team does")
left, mid, right = st.columns(3)
dataset_id = left.selectbox("Dataset", list(by_id), format_func=lambda i: logic.dataset_label(by_id[i]))
base_model = mid.selectbox("Base model", [AGENT_CHOOSES, *models])
method = right.selectbox("Method", [AGENT_CHOOSES, "sft", "dpo", "rft"])
left, mid, right = st.columns(3)
price = left.number_input("Price per device-hour", min_value=0.0, value=None, format="%g", placeholder="optional",
                          help="Set it to see the cost of the run")
ready = [d.name for d in client.list_deployments() if d.status == pb.DEPLOYMENT_STATUS_READY]
drafter = mid.selectbox("Drafting model", [RULES_ONLY, *ready], help="One of your deployments, to draft the plan "
                        "in plain words and an RFT evaluator (used only when it scores its rows' own answers 1 in "
                        "the sandbox). The choices themselves are always the rules'.")
calibrate = right.checkbox("Measure the speed", help="When no finished job of this method on this model tells the "
                           "speed, run a short calibration job (6 steps) before showing the time")
plan_errors = st.container()
agent = TrainingAgent(client, device_hour_cost=price, calibrate=calibrate,
                      drafter=None if drafter == RULES_ONLY else drafter)


def make_plan(settings: dict | None = None, evaluator_source: str = "") -> None:
    """Ask the agent for a plan (settings: the user's own values, kept over the rules'; evaluator_source: the user's
    edited evaluator, kept over a new draft); errors under the inputs."""
    st.session_state.pop(EVALUATOR_TEST, None)
    st.session_state.pop(APPROVED, None)
    st.session_state[PLAN_VERSION] = st.session_state.get(PLAN_VERSION, 0) + 1
    try:
        with st.spinner("Planning..."):
            new = agent.plan(description, dataset_id, settings=settings,
                             base_model=None if base_model == AGENT_CHOOSES else base_model,
                             method=None if method == AGENT_CHOOSES else method)
            if evaluator_source and new.method == "rft":
                new.proposal.evaluator_source = evaluator_source
            st.session_state[PLAN] = new
    except PlanningError as exc:
        st.session_state.pop(PLAN, None)
        plan_errors.error(f"**No plan**: {md_escape(str(exc))}")
    except TrainyardError as exc:
        st.session_state.pop(PLAN, None)
        with plan_errors:
            api.show_error(exc)


if st.button("Plan", type="primary", icon=":material/auto_awesome:"):
    make_plan()


def sweeps_panel() -> None:
    """The account's sweeps (found from their jobs' names, so a closed browser loses nothing): a sweep's variants,
    and its winner with the reason once every variant has finished."""
    sweeps = agent.sweeps()
    if not sweeps:
        return
    st.subheader("Sweeps")
    name = st.selectbox("Sweep", list(sweeps))
    jobs = sweeps[name]
    result = agent.pick_winner(jobs) if all(j.status in TERMINAL for j in jobs) else None
    st.dataframe(logic_plan.sweep_frame(jobs, result), hide_index=True)
    if result is None:
        st.caption(f"{sum(j.status in TERMINAL for j in jobs)} of {len(jobs)} variants finished; the winner is "
                   "named when all have.")
    elif result.winner is not None:
        st.success(f"Winner: job **{result.winner.id}**. {md_escape(result.reason)}.")
        if st.button("Open the winner on the Jobs page", icon=":material/monitoring:"):
            st.session_state[JOB_ID] = result.winner.id
            st.switch_page("pages_jobs.py")
    else:
        st.warning(f"No winner: {md_escape(result.reason)}.")


def show_sweeps() -> None:
    """The sweeps panel, refreshing itself while a sweep is running (when the last variant ends, the next refresh
    names the winner)."""
    running = any(j.status not in TERMINAL for jobs in agent.sweeps().values() for j in jobs)
    st.fragment(sweeps_panel, run_every=REFRESH_S if running else None)()


plan: AgentPlan | None = st.session_state.get(PLAN)
if plan is None or plan.dataset_id not in by_id:
    show_sweeps()  # a sweep started earlier (maybe in a closed tab) is found again without a plan
    st.stop()

st.subheader("The plan")
for line in logic_plan.headline(plan):
    st.markdown(line)
if plan.summary:
    st.info(f"**In plain words** (drafted by {md_escape(plan.drafted_by)}): {md_escape(plan.summary)}")
for note in plan.drafting_notes:
    st.caption(f"Drafting model {md_escape(plan.drafted_by)}, {md_escape(note)}")
st.table(logic_plan.choices_frame(plan), hide_index=True)
# Each figure as wide as its text, wrapping to a second line: six equal columns cut "not measured yet" short.
with st.container(horizontal=True, gap="medium"):
    for name, value in logic_plan.estimate_metrics(plan, price):
        st.metric(name, value, width="content")
st.caption(logic_plan.estimate_note(plan))
for warning in plan.warnings:
    st.warning(md_escape(warning))

with st.expander("Edit the settings"):
    st.caption("Change any value, then re-plan: the agent keeps your values (\"you set it\") and prices the plan "
               "again; the server checks every value.")
    texts = {}
    names = logic_plan.editable(plan)
    for i in range(0, len(names), 4):
        for col, name in zip(st.columns(4), names[i:i + 4]):
            texts[name] = col.text_input(logic_plan.label(plan, name), value=format_value(plan.settings[name]),
                                         key=f"edit_{st.session_state.get(PLAN_VERSION, 0)}_{name}")
    edit_errors = st.container()
    if st.button("Re-plan", icon=":material/refresh:"):
        changed, problems = logic_plan.read_edits(plan, texts)
        if problems:
            edit_errors.error("**Not re-planned**: " + "; ".join(f"{md_escape(lbl)}: {md_escape(reason)}"
                                                                for lbl, reason in problems))
        else:
            user_set = {c.setting: c.value for c in plan.proposal.choices if c.why == "you set it"}
            make_plan({**user_set, **changed}, st.session_state.get(editor_key(), "") if plan.method == "rft" else "")
            st.rerun()

if plan.method == "rft":
    st.subheader("The drafted evaluator")
    st.caption("Read it and edit it: this reward function scores every completion during training. \"Test on 5 "
               "rows\" runs it in the server's sandbox on the first rows, each answered with its expected answer "
               "(a right evaluator gives 1.0).")
    # The editor's value is the plan's draft when the plan is made; what the user types stays in the widget (its key
    # is the plan's), and Test, Re-plan and Approve read it from there.
    source = st.text_area("Evaluator (reward_fn)", value=plan.proposal.evaluator_source, height=260,
                          key=editor_key())
    if st.button("Test on 5 rows", icon=":material/science:"):
        try:
            with st.spinner("Running the evaluator in the sandbox..."):
                st.session_state[EVALUATOR_TEST] = (source, agent.test_evaluator(plan, source))
        except TrainyardError as exc:
            api.show_error(exc)
    tested_source, tested = st.session_state.get(EVALUATOR_TEST) or ("", None)
    if tested is not None and tested_source == source:  # an answer about the source shown, not an earlier one
        s = tested.summary
        (st.success if s.num_errors == 0 else st.error)(
            f"{s.num_ok} of {s.num_rows} rows scored, {s.num_errors} errors, mean reward {s.reward_mean:.3g}.")
        st.dataframe(results_frame(tested), hide_index=True)

st.subheader("Approve")
left, right = st.columns(2)
# One job per plan: once approved, the button waits for a new plan (Plan or Re-plan) instead of queueing a copy.
if left.button("Approve and train", type="primary", icon=":material/check:",
               disabled=bool(st.session_state.get(APPROVED))):
    try:
        if plan.method == "rft":  # what the editor shows is what is uploaded
            plan = replace(plan, proposal=replace(plan.proposal, evaluator_source=source))
        st.session_state[APPROVED] = st.session_state[JOB_ID] = agent.approve(plan).id
        st.rerun()  # the button shows as used
    except TrainyardError as exc:
        api.show_error(exc, logic.field_labels(METHODS[plan.method]))
approved = st.session_state.get(APPROVED)
if approved:
    st.success(f"Approved: job **{approved}** is queued and starts when a worker is free.")
    if st.button("Watch it on the Jobs page", icon=":material/monitoring:"):
        st.switch_page("pages_jobs.py")

if plan.method != "rft":
    variants = right.number_input("Variants", min_value=min(SWEEPS), max_value=max(SWEEPS), value=3, step=1,
                                  help="Learning rates around the plan's: "
                                  + "; ".join(f"{n}: x {', '.join(f'{f:g}' for f in fs)}" for n, fs in SWEEPS.items()))
    if right.button(f"Run a sweep ({min(SWEEPS)}-{max(SWEEPS)} variants)", icon=":material/tune:"):
        try:
            started = agent.sweep(plan, SWEEPS[int(variants)], wait=False)
        except PlanningError as exc:
            st.error(f"**No sweep**: {md_escape(str(exc))}")
        except TrainyardError as exc:
            api.show_error(exc)
        else:
            st.success(f"Started a sweep of {len(started.jobs)} variants; they run on the server (closing this page "
                       "changes nothing) and the winner is named below when all have finished.")

show_sweeps()
