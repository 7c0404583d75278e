"""The Datasets, Describe-and-plan and Train pages through Streamlit's AppTest, against the real service stack
(tests/conftest.py `stack`), with an account of this module's own."""
from __future__ import annotations


import pytest

from dashboard import logic
from tests.dashboard.apptest import assert_no_exception, button, number, open_app, text
from tests.integration.data import chat_rows, jsonl
from trainyard.v1 import scheduler_pb2 as pb
from streamlit.testing.v1 import AppTest


pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("signed_in_env")]
ACCOUNT = "dashboard-data"

SHAREGPT = [{"conversations": [{"from": "human", "value": f"What is {i}+{i}?"},
                               {"from": "gpt", "value": str(2 * i)}]} for i in range(6)]


def selectbox(at, label: str):
    return next(s for s in at.selectbox if s.label == label)


def offered(widget) -> list[str]:
    """The dataset ids a picker offers (its options are shown as labels ending in the id)."""
    return [o.rsplit(" · ", 1)[-1] for o in widget.options]


# -- datasets -----------------------------------------------------------------------------------------------------
def test_upload_jsonl_maps_sharegpt_and_says_so(sdk):
    outcome = logic.upload_jsonl(sdk, jsonl(SHAREGPT), "share.jsonl", preview_rows=2)
    assert outcome.ok and outcome.mapping.startswith("sharegpt -> sft_chat")
    assert outcome.preview[0] == {"messages": [{"role": "user", "content": "What is 0+0?"},
                                               {"role": "assistant", "content": "0"}]}
    bad = logic.upload_jsonl(sdk, jsonl([*SHAREGPT[:2], {"conversations": [{"from": "bot", "value": "x"}]}]),
                             "bad-share.jsonl")
    assert not bad.ok and bad.mapping.startswith("sharegpt")
    assert bad.violations == [(3, "conversations[0].from",
                               "unknown speaker 'bot' (expected one of: human, gpt, system)")]


def test_datasets_page_maps_alpaca_counts_tokens_and_deletes_after_confirmation(sdk):
    rows = [{"instruction": "Add the numbers.", "input": f"{i} {i}", "output": str(2 * i)} for i in range(5)]
    at = open_app()
    at.file_uploader[0].set_value(("alpaca.jsonl", jsonl(rows), "application/octet-stream")).run()
    button(at, "Validate and upload").click().run()
    assert_no_exception(at)
    assert "Stored alpaca.jsonl as dataset alpaca" in text(at.success)
    assert "Mapped on upload: alpaca -> sft_prompt_completion" in text(at.info)
    ds = next(d for d in sdk.list_datasets() if d.name == "alpaca")
    assert at.table[0].value["prompt"].iloc[0] == "Add the numbers.\n\n0 0"
    assert selectbox(at, "Dataset").value == ds.id

    # Token statistics: GetTokenStats' numbers, and the rows over a max_seq_len below the longest.
    stats = sdk.token_stats(ds.id, "tiny-qwen3", 2048)
    shown = {m.label: m.value for m in at.metric}
    assert (shown["Rows"], shown["Max tokens"], shown["Over max_seq_len"]) == ("5", str(stats.max_tokens), "0")
    assert "Every row fits in max_seq_len = 2,048 tokens" in text(at.caption)
    number(at, "Max sequence length").set_value(stats.max_tokens - 1).run()
    over = sdk.token_stats(ds.id, "tiny-qwen3", stats.max_tokens - 1).over_max_seq_len
    assert over >= 1 and {m.label: m.value for m in at.metric}["Over max_seq_len"] == str(over)
    assert "longer than max_seq_len" in text(at.warning)

    # A file with a bad row: the problems are listed once, under the file, with the file's own rows and fields.
    broken = jsonl(rows[:2]) + b'{"instruction": "x"}\n'
    at.file_uploader[0].set_value(("broken.jsonl", broken, "application/octet-stream")).run()
    button(at, "Validate and upload").click().run()
    assert_no_exception(at)
    assert text(at.error).count("broken.jsonl was not stored: row 3 of 3 has a problem") == 1
    problems = at.table[0].value
    assert list(problems["row"]) == [3] and list(problems["field"]) == ["output"]

    # Delete asks first; Cancel keeps the dataset, Yes deletes it.
    selectbox(at, "Dataset").set_value(ds.id).run()
    button(at, "Delete this dataset").click().run()
    assert f"Delete alpaca ({ds.id}" in text(at.warning)
    button(at, "Cancel").click().run()
    assert ds.id in {d.id for d in sdk.list_datasets()}
    button(at, "Delete this dataset").click().run()
    button(at, "Yes, delete it").click().run()
    assert_no_exception(at)
    assert "Deleted dataset alpaca" in text(at.success)
    assert ds.id not in {d.id for d in sdk.list_datasets()}


# -- train ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prefs(sdk):
    ds, _ = sdk.upload_dataset(jsonl([{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a)}
                                      for a in range(8)]), name="prefs")
    return ds


@pytest.fixture(scope="module")
def chats(sdk):
    ds, _ = sdk.upload_dataset(jsonl(chat_rows(12)), name="chats")
    return ds


def test_train_page_names_datasets_of_other_formats_and_plans_dpo(sdk, prefs, chats):
    at = open_app("pages_train.py")
    assert chats.id in offered(selectbox(at, "Dataset")) and prefs.id not in offered(selectbox(at, "Dataset"))
    assert "Not listed for this method: 1 dpo dataset (prefs): choose Direct preference optimization" in \
        text(at.caption)
    selectbox(at, "Method").set_value("dpo").run()
    assert_no_exception(at)
    assert offered(selectbox(at, "Dataset")) == [prefs.id]
    number(at, "Max steps").set_value(12).run()
    plan = text(at.markdown)
    assert "by DPO (beta" in plan and "Length: 12 steps of" in plan and "pairs each" in plan


def test_train_page_shows_no_plan_when_no_row_can_be_trained(sdk):
    long = [{"prompt": " ".join(["word"] * 60), "completion": "yes"} for _ in range(4)]
    ds, _ = sdk.upload_dataset(jsonl(long), name="long-prompts")
    at = open_app("pages_train.py")
    selectbox(at, "Dataset").set_value(ds.id).run()
    assert "Fine-tune" in text(at.markdown)
    number(at, "Max sequence length").set_value(16).run()
    assert_no_exception(at)
    assert "No plan: none of the dataset's 4 rows can be trained on" in text(at.error)
    assert "Fine-tune" not in text(at.markdown) and "steps of 0" not in text(at.markdown)
    assert "raise max_seq_len" in text(at.warning)


def test_train_page_picks_references_among_the_accounts_objects(sdk, prefs, chats):
    sdk.upload_dataset(jsonl([{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(6)]), name="sums")
    sdk.upload_evaluator(b"def reward_fn(completion, row):\n    return float(completion.strip() == row['answer'])\n",
                         "exact")
    at = open_app("pages_train.py")
    selectbox(at, "Method").set_value("loop").run()
    assert_no_exception(at)
    training = next(m for m in at.multiselect if m.label == "Training datasets")
    assert chats.id in offered(training) and prefs.id not in offered(training)
    selectbox(at, "Training method").set_value("dpo").run()
    training = next(m for m in at.multiselect if m.label == "Training datasets")
    assert offered(training) == [prefs.id]
    assert "exact@1" in selectbox(at, "Evaluator").options

    selectbox(at, "Method").set_value("rft").run()
    selectbox(at, "Evaluator").set_value("other (type a reference)").run()
    next(t for t in at.text_input if t.label == "Evaluator reference").set_value("builtin:nope").run()
    assert_no_exception(at)
    assert "no built-in evaluator 'builtin:nope'" in text(at.error)
    selectbox(at, "Evaluator").set_value("exact@1").run()
    assert not [e for e in at.error if "evaluator" in str(e.value)]


# -- describe and plan (the Training Agent) --------------------------------------------------------------------------
def plan_page(dataset_id: str, description: str = "Answer questions the way our team does", **choices) -> AppTest:
    at = open_app("pages_plan.py")
    assert at.title[0].value == "Describe and plan"
    next(t for t in at.text_area if t.label == "Describe the task").set_value(description)
    selectbox(at, "Dataset").set_value(dataset_id)
    for label, value in choices.items():
        selectbox(at, label).set_value(value)
    button(at, "Plan").click().run()
    assert_no_exception(at)
    return at


def settings_table(at) -> dict[str, tuple[str, str]]:
    frame = next(t.value for t in at.table if "why" in t.value.columns)
    return {row["setting"]: (row["value"], row["why"]) for _, row in frame.iterrows()}


def test_plan_page_plans_edits_replans_and_approves(sdk, chats):
    at = plan_page(chats.id, description="")
    assert "No plan: describe the task" in text(at.error)

    at = plan_page(chats.id)
    md = text(at.markdown)
    assert "Method: Supervised fine-tuning (LoRA)" in md and "Base model: tiny-qwen3" in md
    table = settings_table(at)
    assert table["LoRA rank"][0] == "8" and "rank 8 (8 under 500 rows" in table["LoRA rank"][1]
    expected = sdk.plan_job("sft", "tiny-qwen3", chats.id, **at.session_state["agent_plan"].settings)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Steps"] == f"{expected.total_steps:,}" and metrics["Time"] == "not measured yet"
    assert metrics["Cost"] == "no price set"

    # A value that is not one of the declared type, or out of its bounds, is refused before re-planning.
    next(t for t in at.text_input if t.label == "Learning rate").set_value("fast")
    button(at, "Re-plan").click().run()
    assert "Not re-planned: Learning rate: not a number: 'fast'" in text(at.error)
    next(t for t in at.text_input if t.label == "Learning rate").set_value("-1")
    button(at, "Re-plan").click().run()
    assert "Learning rate: must be > 0 and < 1, got -1" in text(at.error)
    next(t for t in at.text_input if t.label == "Learning rate").set_value("0.002")
    next(t for t in at.text_input if t.label == "Max steps").set_value("5")
    button(at, "Re-plan").click().run()
    assert_no_exception(at)
    table = settings_table(at)
    assert table["Max steps"] == ("5", "you set it") and table["Learning rate"] == ("0.002", "you set it")
    assert {m.label: m.value for m in at.metric}["Steps"] == "5"

    button(at, "Approve and train").click().run()
    assert_no_exception(at)
    job_id = at.session_state["agent_approved_job"]
    assert f"Approved: job {job_id}" in text(at.success)
    job = sdk.get_job(job_id)
    assert (job.spec.sft.max_steps, job.spec.sft.lora.rank) == (5, 8)
    assert job.spec.sft.learning_rate == pytest.approx(0.002)
    sdk.wait_job(job_id, timeout_s=300)


def test_plan_page_drafts_an_rft_evaluator_tests_it_and_approves_the_edit(sdk):
    ds, _ = sdk.upload_dataset(jsonl([{"prompt": f"What is {a}+{a}?", "answer": 2 * a} for a in range(8)]),
                               name="doubles")
    at = plan_page(ds.id, description="Solve the sums")
    assert "Method: Reinforcement fine-tuning" in text(at.markdown)
    editor = next(t for t in at.text_area if t.label == "Evaluator (reward_fn)")
    assert "def reward_fn(completion: str, row: dict) -> float:" in editor.value and 'row["answer"]' in editor.value
    button(at, "Test on 5 rows").click().run()
    assert_no_exception(at)
    assert "5 of 5 rows scored, 0 errors, mean reward 1" in text(at.success)

    drafted = editor.value
    signature = "def reward_fn(completion: str, row: dict) -> float:\n"
    editor.set_value(drafted.replace(signature, signature + "    raise ValueError('edited')\n")).run()
    button(at, "Test on 5 rows").click().run()
    assert "errors" in text(at.error) and "ValueError: edited" in " ".join(at.dataframe[0].value["error"])
    # An edit survives a re-plan (the agent's new draft does not overwrite it).
    edited = drafted.replace(signature, signature + "    # checked by the support team\n")
    editor.set_value(edited).run()
    next(t for t in at.text_input if t.label == "Steps").set_value("3")
    button(at, "Re-plan").click().run()
    editor = next(t for t in at.text_area if t.label == "Evaluator (reward_fn)")
    assert editor.value == edited and settings_table(at)["Steps"] == ("3", "you set it")
    button(at, "Approve and train").click().run()
    assert_no_exception(at)
    job = sdk.get_job(at.session_state["agent_approved_job"])
    # Testing stored nothing: the approved source is the evaluator's first version.
    name, version = job.spec.rft.evaluator.split("@")
    assert sdk.get_evaluator(job.spec.rft.evaluator).name == name and version == "1"
    assert sdk.get_evaluator_source(job.spec.rft.evaluator).content.decode() == edited
    # One job per plan: the button waits for a new plan.
    assert button(at, "Approve and train").disabled
    sdk.cancel_job(job.id)


def test_plan_page_drafts_with_a_deployment_the_user_picks(sdk, chats):
    """The drafting model is one of the account's ready deployments; the plan says what its texts became (the
    tiny model writes no usable evaluator: the rules' draft stays, with the reason)."""
    job = sdk.create_job("sft", "tiny-qwen3", chats.id, "drafting-helper", max_steps=2, eval_fraction=0.0,
                         checkpoint_every=2)
    assert sdk.wait_job(job.id, timeout_s=300).status == pb.JOB_STATUS_SUCCEEDED
    sdk.create_deployment("page-drafter", job_id=job.id)
    ds, _ = sdk.upload_dataset(jsonl([{"prompt": f"What is {a}+{a}?", "answer": 2 * a} for a in range(8)]),
                               name="doubles-drafted")
    rules_only = plan_page(ds.id, description="Solve the sums")
    assert selectbox(rules_only, "Drafting model").options == ["(none: rules only)", "page-drafter"]
    assert not [c for c in rules_only.caption if str(c.value).startswith("Drafting model")]

    at = plan_page(ds.id, description="Solve the sums", **{"Drafting model": "page-drafter"})
    captions = text(at.caption)
    assert "Drafting model page-drafter, evaluator: the rules' draft is shown (page-drafter's draft was not used: " \
        in captions
    assert "In plain words (drafted by page-drafter)" in text(at.info) or "page-drafter, summary: none (" in captions
    editor = next(t for t in at.text_area if t.label == "Evaluator (reward_fn)")
    assert editor.value == next(t for t in rules_only.text_area if t.label == "Evaluator (reward_fn)").value


def test_a_sweep_runs_on_the_server_and_the_page_finds_it_and_its_winner_again(sdk, chats):
    at = plan_page(chats.id, description="Add numbers")
    next(t for t in at.text_input if t.label == "Max steps").set_value("3")
    next(t for t in at.text_input if t.label == "Eval every").set_value("3")
    button(at, "Re-plan").click().run()
    number(at, "Variants").set_value(2)
    button(at, "Run a sweep").click().run()
    assert_no_exception(at)
    assert "Started a sweep of 2 variants" in text(at.success)
    jobs = [j for j in sdk.list_jobs() if j.spec.display_name.startswith("agent-sft-add-numbers-s")]
    assert len(jobs) == 2
    for job in jobs:
        sdk.wait_job(job.id, timeout_s=300)

    again = open_app("pages_plan.py")  # a new browser session: no plan, the sweep is found from the jobs' names
    assert_no_exception(again)
    assert "Sweeps" in [h.value for h in again.subheader]
    frame = again.dataframe[0].value
    assert set(frame["job"]) == {j.id for j in jobs} and list(frame["status"]) == ["succeeded"] * 2
    assert "has the lowest final held-out loss" in text(again.success)
    assert list(frame["winner"]).count("yes") == 1
    button(again, "Open the winner on the Jobs page").click().run()
    assert_no_exception(again)
    assert again.title[0].value == "Jobs" and again.session_state["job_id"] in {j.id for j in jobs}
