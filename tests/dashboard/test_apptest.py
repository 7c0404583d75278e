"""The dashboard's pages through Streamlit's AppTest, against the real service stack (tests/conftest.py `stack`).

Each test module signs in with an account of its own, so what a page lists is exactly what the module created.
"""
from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import logic
from tests.dashboard.apptest import assert_no_exception, button, number, open_app, text
from tests.conftest import create_account
from tests.integration.data import chat_rows, jsonl
from trainyard.client import status_name
from trainyard.localstack import free_port
from trainyard.methods import METHODS

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("signed_in_env")]
ACCOUNT = "dashboard-apptest"

SHORT_JOB = dict(max_steps=4, batch_size=2, checkpoint_every=2, eval_fraction=0.2, learning_rate=3e-3)
BAD_FILE = jsonl(chat_rows(2)) + b'{"messages": 3}\n{"prompt": "only a prompt"}\n'


@pytest.fixture(scope="module")
def dataset(sdk):
    ds, _ = sdk.upload_dataset(jsonl(chat_rows(12)), name="addition")
    return ds


@pytest.fixture(scope="module")
def finished_job(sdk, dataset):
    job = sdk.create_sft_job("tiny-qwen3", dataset.id, "short-run", **SHORT_JOB)
    job = sdk.wait_job(job.id, timeout_s=300)
    assert status_name(job.status) == "succeeded", job.error
    return job


def column_of(at: AppTest, label: str):
    """The form column holding the input with this label (its field errors go under it, in the same column)."""
    return next(c for c in at.columns if any(w.label == label for w in (*c.number_input, *c.selectbox,
                                                                           *c.text_input)))


def chart_data(at: AppTest) -> pd.DataFrame:
    chart = at.get("vega_lite_chart")
    assert len(chart) == 1, "expected one loss chart"
    return pa.ipc.open_stream(chart[0].proto.datasets[0].data.data).read_pandas()


# -- sidebar ------------------------------------------------------------------------------------------------------
def test_sidebar_signs_in_or_says_what_is_wrong(stack, key):
    at = open_app()
    assert "Signed in as dashboard-apptest" in text(at.sidebar.success)

    at.sidebar.text_input(key="conn_api_key").set_value("ty_not-a-real-key").run()
    assert_no_exception(at)
    assert "not accepted" in text(at.sidebar.error)
    assert "Not signed in" in text(at.main.info)

    at.sidebar.text_input(key="conn_api_key").set_value("").run()
    assert "Enter your API key" in text(at.sidebar.warning)

    at.sidebar.text_input(key="conn_api_key").set_value(key)
    at.sidebar.text_input(key="conn_url").set_value(f"127.0.0.1:{free_port()}").run()
    assert_no_exception(at)
    assert "Cannot reach the scheduler" in text(at.sidebar.error)

    at.sidebar.text_input(key="conn_url").set_value(stack.url("scheduler")).run()
    assert "Signed in as" in text(at.sidebar.success)


def test_pages_of_a_new_account_say_what_to_do_first(stack, monkeypatch):
    monkeypatch.setenv("TRAINYARD_API_KEY", create_account(stack.env_for("scheduler"), "dashboard-newcomer"))
    expected = {None: "No datasets yet", "pages_train.py": "Upload a dataset", "pages_jobs.py": "No jobs yet",
                "pages_playground.py": "No deployments yet", "pages_plan.py": "Upload a dataset first"}
    for page, message in expected.items():
        at = open_app(page)
        assert message in text(at.main.info), page


# -- datasets -----------------------------------------------------------------------------------------------------
def test_upload_jsonl_stores_valid_files_only(sdk):
    before = {d.id for d in sdk.list_datasets()}
    bad = logic.upload_jsonl(sdk, BAD_FILE, "bad.jsonl")
    assert not bad.ok and bad.num_rows == 4
    assert [(row, field) for row, field, _ in bad.violations] == [(3, "messages"), (4, "")]
    declared = logic.upload_jsonl(sdk, jsonl(chat_rows(2)), "chat.jsonl", fmt="dpo")
    assert not declared.ok and {row for row, _, _ in declared.violations} == {1, 2}
    assert {d.id for d in sdk.list_datasets()} == before, "a rejected file must store nothing"

    rows = chat_rows(7)
    good = logic.upload_jsonl(sdk, jsonl(rows), "seven.jsonl", fmt="sft_chat", name="seven", preview_rows=3)
    assert good.ok and not good.deduplicated
    assert (good.dataset.name, good.dataset.filename, good.dataset.num_rows) == ("seven", "seven.jsonl", 7)
    assert good.preview == rows[:3]
    again = logic.upload_jsonl(sdk, jsonl(rows), "copy.jsonl")
    assert again.deduplicated and again.dataset.id == good.dataset.id


def test_datasets_page_uploads_rejects_lists_and_previews(sdk):
    at = open_app()
    assert at.title[0].value == "Datasets"
    rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(6)]
    at.file_uploader[0].set_value(("sums.jsonl", jsonl(rows), "application/octet-stream")).run()
    button(at, "Validate and upload").click().run()
    assert_no_exception(at)
    assert "Stored sums.jsonl as dataset sums" in text(at.success)
    ds = next(d for d in sdk.list_datasets() if d.name == "sums")
    assert [m.value for m in at.metric][:3] == [ds.id, "sft_prompt_completion", "6"]
    preview = at.table[0].value
    assert list(preview["prompt"]) == [r["prompt"] for r in rows[:5]]

    before = len(sdk.list_datasets())
    at.file_uploader[0].set_value(("broken.jsonl", BAD_FILE, "application/octet-stream")).run()
    button(at, "Validate and upload").click().run()
    assert_no_exception(at)
    assert "broken.jsonl was not stored: 2 of its 4 rows have problems" in text(at.error)
    problems = at.table[0].value
    assert list(problems["row"]) == [3, 4] and list(problems["field"]) == ["messages", ""]
    assert "expected a list of messages" in problems["reason"][0] and "looks like rft" in problems["reason"][1]
    assert len(sdk.list_datasets()) == before

    listed = at.dataframe[0].value
    assert ds.id in set(listed["id"])
    preview_box = next(s for s in at.selectbox if s.label == "Dataset")
    preview_box.set_value(ds.id).run()
    number(at, "From row").set_value(5).run()
    shown = at.table[-1].value
    assert list(shown.index) == [5, 6] and list(shown["completion"]) == ["8", "10"]


# -- train ----------------------------------------------------------------------------------------------------------
def test_train_page_shows_field_errors_then_launches(sdk, dataset):
    at = open_app("pages_train.py")
    assert at.title[0].value == "Train"
    assert next(s for s in at.selectbox if s.label == "Base model").value == "tiny-qwen3"
    next(s for s in at.selectbox if s.label == "Dataset").set_value(dataset.id).run()
    plan = text(at.markdown)
    expected = sdk.plan_job("sft", "tiny-qwen3", dataset.id)  # the page's plan is PlanJob's answer
    assert "Fine-tune tiny-qwen3" in plan and "LoRA adapter of rank 32 (alpha 32)" in plan
    assert f"{expected.train_rows} rows for training and {expected.eval_rows} held out" in plan
    assert f"{expected.trainable_parameters:,} trainable parameters" in plan and "Memory: about" in plan
    jobs_before = len(sdk.list_jobs())

    number(at, "Learning rate").set_value(-1.0)
    number(at, "LoRA rank").set_value(0).run()
    assert_no_exception(at)
    # PlanJob runs on every change: each error shows under its input, and there is no plan until they are fixed.
    assert "must be between 1 and 1024, got 0" in text(column_of(at, "LoRA rank").error)
    assert "must be > 0 and < 1, got -1" in text(column_of(at, "Learning rate").error)
    assert not text(column_of(at, "Batch size").error)
    assert "Fix the settings marked above" in text(at.warning) and "Fine-tune" not in text(at.markdown)
    button(at, "Launch training").click().run()
    assert_no_exception(at)
    # Each error once: under its input, with one line saying the job was not launched (no second copy in a table).
    assert "The job was not launched: fix the settings marked above" in text(at.error)
    assert text(at.error).count("must be between 1 and 1024, got 0") == 1 and not at.table
    assert len(sdk.list_jobs()) == jobs_before

    number(at, "Learning rate").set_value(2e-3)
    number(at, "LoRA rank").set_value(8).run()
    number(at, "Max steps").set_value(3)
    number(at, "Batch size").set_value(2)
    next(t for t in at.text_input if t.label == "Job name").set_value("from-the-dashboard").run()
    assert not text(column_of(at, "LoRA rank").error)
    assert "Length: 3 steps of 2 sequences each" in text(at.markdown)
    assert "only 3 optimizer steps" in text(at.warning)
    button(at, "Launch training").click().run()
    assert_no_exception(at)
    job_id = at.session_state["launched_job"]
    assert f"Launched job {job_id}" in text(at.success)
    job = sdk.get_job(job_id)
    assert job.spec.display_name == "from-the-dashboard" and job.spec.dataset_id == dataset.id
    assert (job.spec.sft.lora.rank, job.spec.sft.max_steps, job.spec.sft.batch_size) == (8, 3, 2)
    assert job.spec.sft.learning_rate == pytest.approx(2e-3)

    button(at, "Watch it").click().run()
    assert_no_exception(at)
    assert at.title[0].value == "Jobs"
    assert next(s for s in at.selectbox if s.label == "Job").value == job_id
    sdk.wait_job(job_id, timeout_s=300)


def test_train_page_offers_every_method_with_its_settings(sdk, dataset):
    """Every declared method opens on the Train page without an error: its settings as inputs (strings as text,
    flags as checkboxes), and a plan where the method trains something."""
    sdk.upload_dataset(jsonl([{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(4) for b in range(4)]),
                       name="sums")
    sdk.upload_dataset(jsonl([{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a)} for a in range(8)]),
                       name="prefs")
    for name, method in METHODS.items():
        at = open_app("pages_train.py")
        next(s for s in at.selectbox if s.label == "Method").set_value(name).run()
        assert_no_exception(at)
        labels = {w.label for w in (*at.number_input, *at.selectbox, *at.text_input, *at.checkbox, *at.multiselect)}
        missing = {f.setting.label for f in method.fields()} - labels
        assert not missing, (name, missing)


# -- jobs -----------------------------------------------------------------------------------------------------------
def test_jobs_page_follows_and_cancels_a_running_job(sdk, dataset):
    job = sdk.create_sft_job("tiny-qwen3", dataset.id, "long-run", max_steps=5000, batch_size=1,
                             checkpoint_every=5000)
    at = open_app("pages_jobs.py", job_id=job.id)
    assert status_name(sdk.get_job(job.id).status) in ("queued", "running")
    md = text(at.markdown)
    assert ":gray-badge[queued]" in md or ":blue-badge[running]" in md
    button(at, "Cancel job").click().run()
    assert_no_exception(at)
    assert sdk.get_job(job.id).cancel_requested
    done = sdk.wait_job(job.id, timeout_s=120)
    assert status_name(done.status) == "cancelled"
    at.run()
    assert ":orange-badge[cancelled]" in text(at.markdown)
    assert not [b for b in at.button if b.label in ("Cancel job", "Deploy")]


# -- deploy and playground -----------------------------------------------------------------------------------------
def test_deploy_from_jobs_page_then_compare_in_playground(sdk, finished_job):
    at = open_app("pages_jobs.py", job_id=finished_job.id)
    name_input = next(t for t in at.text_input if t.label == "Deployment name")
    assert name_input.value == "short-run"
    name_input.set_value("bad name!")
    button(at, "Deploy").click().run()
    assert_no_exception(at)
    assert "INVALID_ARGUMENT" in text(at.error) and list(at.table[0].value["field"]) == ["name"]

    next(t for t in at.text_input if t.label == "Deployment name").set_value("adder")
    button(at, "Deploy").click().run()
    assert_no_exception(at)
    assert "Deployment adder is ready" in text(at.success)
    assert "adder" in [d.name for d in sdk.list_deployments() if d.job_id == finished_job.id]

    next(t for t in at.text_input if t.label == "Deployment name").set_value("adder")
    button(at, "Deploy").click().run()
    assert "ALREADY_EXISTS" in text(at.error)

    at.switch_page("pages_playground.py").run()
    assert_no_exception(at)
    assert next(s for s in at.selectbox if s.label == "Deployment").value == "adder"
    at.text_area[0].set_value("What is 3 plus 3?")
    number(at, "Max tokens").set_value(8)
    next(s for s in at.slider if s.label == "Temperature").set_value(0.0).run()
    button(at, "Send to all").click().run()
    assert_no_exception(at)
    assert not at.error, text(at.error)
    assert "Base model · tiny-qwen3" in text(at.markdown) and "Fine-tuned · adder" in text(at.markdown)
    outputs = [c.value for c in at.code]
    messages = [{"role": "user", "content": "What is 3 plus 3?"}]
    expected = [sdk.sample(m, messages=messages, temperature=0.0, top_p=1.0, max_tokens=8, seed=0).sequences[0].text
                for m in ("tiny-qwen3", "adder")]
    assert outputs == [t for t in expected if t], "the page shows exactly what was sampled"
    assert all("generated" in c for c in at.caption.values if "prompt tokens" in c)

    adder = next(d for d in sdk.list_deployments() if d.name == "adder")
    at.switch_page("pages_jobs.py").run()
    at.button(key=f"delete-{adder.id}").click().run()
    assert_no_exception(at)
    assert "adder" not in [d.name for d in sdk.list_deployments()]
    assert "adder ·" not in text(at.markdown)


def test_unreachable_rollout_is_a_message_not_a_traceback(stack, sdk, finished_job):
    sdk.create_deployment("kept", job_id=finished_job.id)
    at = open_app("pages_playground.py", deployment="kept")
    at.sidebar.text_input(key="conn_rollout_url").set_value(f"127.0.0.1:{free_port()}").run()
    assert "Signed in as" in text(at.sidebar.success), "the scheduler is still reachable"
    at.text_area[0].set_value("hello")
    button(at, "Send to all").click().run()
    assert_no_exception(at)
    errors = [e.value for e in at.error]
    assert len(errors) == 2 and all("UNAVAILABLE" in e for e in errors), errors


def test_train_form_is_generated_from_the_declaration(dataset):
    """One input per declared setting, with its label, its default and its help (bounds included)."""
    at = open_app("pages_train.py")
    widgets = {w.label: w for w in (*at.number_input, *at.selectbox, *at.text_input)}
    method = METHODS["sft"]
    for f in method.fields():
        w = widgets[f.setting.label]
        assert w.help == f.describe()
        assert w.value == (", ".join(f.default) if f.is_list else f.default), f.name
    main, advanced = logic.form_groups(method)
    assert {f.name for f in advanced} >= {"seed", "lr_scheduler", "target_modules"} and main[0].name == "lora_rank"


def test_preview_frame_and_form_helpers_are_readable():
    frame = logic.preview_frame([{"messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": "hello"}], "meta": {"a": 1}}], 3)
    assert frame.loc[3, "messages"] == "user: hi | assistant: hello" and json.loads(frame.loc[3, "meta"]) == {"a": 1}
    labels = logic.field_labels(METHODS["sft"])
    assert labels["spec.sft.lora.rank"] == "LoRA rank" and labels["spec.sft.learning_rate"] == "Learning rate"
    assert labels["spec.dataset_id"] == "Dataset" and len(labels) == len(METHODS["sft"].fields()) + 2
    assert (logic.float_step(1e-4), logic.float_step(32.0), logic.float_step(0.0)) == (1e-5, 1.0, 0.01)
    assert logic.list_value(" q_proj, v_proj ,") == ("q_proj", "v_proj") and logic.list_value("") == ()
