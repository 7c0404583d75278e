"""Train: the expert launch of every method (trainyard.methods.METHODS): a base model and a dataset of the method's
formats, the method's settings, the plan, launch.

The inputs are generated from the method's declaration (trainyard/methods/: label, default, help with bounds); the
values are checked by the server, not here: on every change the page asks PlanJob, which runs CreateJob's checks,
and shows each field error under its input; the plan (split, tokens, steps, memory) shows only once the settings
pass and the data gives the job rows to train on. References get pickers of the account's own objects: the loop's
training datasets (in its training method's formats), the evaluator, the checkpoint to evaluate.
"""
from __future__ import annotations

import streamlit as st

from dashboard import api, logic
from trainyard import TrainyardError
from trainyard.client import format_name
from trainyard.methods import METHODS
from trainyard.methods.spec import Field, format_value

LAUNCHED = "launched_job"  # session state: id of the job launched from this page
JOB_ID = "job_id"  # session state: the job the Jobs page shows
DEFAULT_MODEL = "tiny-qwen3"
COLUMNS = 4
OTHER = "other (type a reference)"  # the evaluator picker's choice for a reference not listed (e.g. builtin:...)

client = api.require_client()
st.title("Train")
METHOD = METHODS[st.selectbox("Method", list(METHODS), format_func=lambda name: METHODS[name].title)]

models = client.list_models()
all_datasets = client.list_datasets()
datasets = [d for d in all_datasets if format_name(d.format) in METHOD.dataset_formats]
elsewhere = logic.other_formats_note(all_datasets, METHOD)
if not models:
    st.warning("No base models are available. An operator imports one with `trainyard models import`.")
    st.stop()
if not datasets:
    st.info(f"Upload a dataset in the {' or '.join(METHOD.dataset_formats)} format first."
            + (f" {elsewhere}" if elsewhere else ""))
    st.page_link("pages_datasets.py", label="Go to Datasets", icon=":material/upload:")
    st.stop()

models_by_name = {m.name: m for m in models}
datasets_by_id = {d.id: d for d in datasets}
names = list(models_by_name)
slots = {}  # input -> the place under it where its errors go
left, right = st.columns(2)
model_name = left.selectbox("Base model", names, index=names.index(DEFAULT_MODEL) if DEFAULT_MODEL in names else 0)
slots["spec.base_model"] = left.empty()
model = models_by_name[model_name]
left.caption(f"{model.architecture} · {model.num_parameters:,} parameters · {model.num_layers} layers · "
             f"context {model.max_position_embeddings}")
dataset_id = right.selectbox("Dataset", list(datasets_by_id),
                             format_func=lambda i: logic.dataset_label(datasets_by_id[i]),
                             help=f"Datasets in the {' or '.join(METHOD.dataset_formats)} format.")
slots["spec.dataset_id"] = right.empty()
if elsewhere:
    right.caption(elsewhere)
display_name = st.text_input("Job name", placeholder="optional, e.g. support-bot-v1")


def reference_input(container, f: Field, values: dict):
    """A picker of the account's own objects for a setting that names them; NotImplemented for other settings."""
    label, helptext = f.setting.label, f.describe()
    if f.name == "train_datasets":  # the loop's: in its training method's formats
        formats = METHODS[values.get("training_method") or "sft"].dataset_formats
        usable = {d.id: d for d in all_datasets if format_name(d.format) in formats}
        return tuple(container.multiselect(label, list(usable), format_func=lambda i: logic.dataset_label(usable[i]),
                                           help=f"{helptext} ({' or '.join(formats)} datasets)"))
    if f.name == "evaluator":
        refs = [f"{e.name}@{e.version}" for e in client.list_evaluators()]
        choice = container.selectbox(label, [*refs, OTHER], help=helptext + " (upload one on the Evaluators page)")
        if choice != OTHER:
            return choice
        return container.text_input("Evaluator reference", placeholder="name, name@N or builtin:first_number",
                                    help=helptext).strip() or None
    if f.name == "checkpoint_id":  # the base model's checkpoints; empty: the base model itself
        ckpts = {c.id: c for c in client.list_checkpoints() if c.base_model == model_name}
        return container.selectbox(label, ["", *ckpts], help=helptext,
                                   format_func=lambda i: logic.checkpoint_label(ckpts[i]) if i else
                                   f"none: {model_name} itself") or None
    return NotImplemented


def setting_input(container, f: Field, values: dict):
    """The input of one declared setting, prefilled with its default (max_seq_len: at most the model's context)."""
    picked = reference_input(container, f, values)
    if picked is not NotImplemented:
        return picked
    s, label, helptext = f.setting, f.setting.label, f.describe()
    default = min(f.default, model.max_position_embeddings) if f.name == "max_seq_len" else f.default
    if s.choices:
        return container.selectbox(label, s.choices, index=s.choices.index(default), help=helptext)
    if f.type is bool and default is None:  # unset: the method decides (e.g. dynamic sampling for dapo only)
        choice = container.selectbox(label, ("default", "on", "off"), help=helptext)
        return {"default": None, "on": True, "off": False}[choice]
    if f.type is bool:
        return container.checkbox(label, value=default, help=helptext)
    if f.is_list:
        text = container.text_input(label, value=format_value(default), help=helptext, placeholder="default")
        return logic.list_value(text)
    if f.type is str:  # e.g. an evaluator reference; empty: left unset
        return container.text_input(label, value=default or "", help=helptext).strip() or None
    if f.type is int:
        value = container.number_input(label, value=default, step=1, help=helptext, placeholder="unset")
        return None if value is None else int(value)  # None: left unset (max_steps), the method derives it
    if default is None:  # unset unless given (e.g. a clip range: the loss's own default)
        value = container.number_input(label, value=None, format="%g", help=helptext, placeholder="unset")
        return None if value is None else float(value)
    return float(container.number_input(label, value=float(default), step=logic.float_step(default), format="%g",
                                        help=helptext))


def setting_inputs(fields: list[Field], values: dict) -> None:
    for i in range(0, len(fields), COLUMNS):
        for col, f in zip(st.columns(COLUMNS), fields[i:i + COLUMNS]):
            values[f.name] = setting_input(col, f, values)
            slots[f.name] = col.empty()


st.subheader("Settings")
main, advanced = logic.form_groups(METHOD)
values: dict = {}
setting_inputs(main, values)
with st.expander("Advanced"):
    setting_inputs(advanced, values)


def show_field_errors(exc: TrainyardError) -> list:
    """Each violation under the input it concerns; returns those that no input shows."""
    placed, rest = logic.place_violations(exc.violations, METHOD, slots)
    for name, reasons in placed.items():
        slots[name].error("\n\n".join(logic.md_escape(r) for r in reasons))
    return rest


class _NothingToPlan(Exception):
    pass


st.subheader("Plan")
try:
    if not METHOD.trains:
        raise _NothingToPlan
    plan = client.plan_job(METHOD.name, model_name, dataset_id, **values)
except _NothingToPlan:
    st.caption(f"{METHOD.title}: nothing is trained, so there is no plan; the settings are checked at launch.")
except TrainyardError as exc:
    if exc.code == "INVALID_ARGUMENT":
        rest = show_field_errors(exc)
        st.warning("Fix the settings marked above to see the plan." if not rest else
                   "Fix these settings to see the plan: " + "; ".join(
                       f"{logic.md_escape(v.field)}: {logic.md_escape(v.reason)}" for v in rest))
    else:  # no plan, but the job can still be launched
        api.show_error(exc)
else:
    if plan.train_rows:
        st.markdown("\n".join(f"- {line}" for line in logic.plan_summary(plan, model, datasets_by_id[dataset_id])))
    else:  # nothing to train on: the warnings say why, and a plan of zero rows would only mislead
        st.error(f"No plan: none of the dataset's {plan.dataset_rows} rows can be trained on with these settings.")
    for warning in plan.warnings:
        st.warning(logic.md_escape(warning))

if st.button("Launch training", type="primary"):
    st.session_state.pop(LAUNCHED, None)
    try:
        job = client.create_job(METHOD.name, model_name, dataset_id, display_name.strip(), **values)
    except TrainyardError as exc:
        rest = show_field_errors(exc) if exc.code == "INVALID_ARGUMENT" else exc.violations
        if exc.code == "INVALID_ARGUMENT" and not rest:
            st.error("**The job was not launched**: fix the settings marked above.")
        else:  # the error once, with the violations no input shows
            api.show_error(TrainyardError(exc.code, exc.message, list(rest)), logic.field_labels(METHOD))
    else:
        st.session_state[LAUNCHED] = st.session_state[JOB_ID] = job.id

launched = st.session_state.get(LAUNCHED)
if launched:
    st.success(f"Launched job **{launched}**. It is queued and starts when a worker is free.")
    if st.button("Watch it on the Jobs page", icon=":material/monitoring:"):
        st.session_state[JOB_ID] = launched
        st.switch_page("pages_jobs.py")
