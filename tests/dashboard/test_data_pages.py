"""The Datasets, Describe-and-plan and Train pages through Streamlit's AppTest, against the real service stack
(tests/conftest.py `stack`), with an account of this module's own."""
from __future__ import annotations


import pytest

from dashboard import logic
from tests.conftest import create_account
from tests.dashboard.test_apptest import assert_no_exception, button, number, open_app, text
from tests.integration.data import chat_rows, jsonl
from trainyard import Client

pytestmark = pytest.mark.integration

SHAREGPT = [{"conversations": [{"from": "human", "value": f"What is {i}+{i}?"},
                               {"from": "gpt", "value": str(2 * i)}]} for i in range(6)]


@pytest.fixture(scope="module")
def key(stack) -> str:
    return create_account(stack.env_for("scheduler"), "dashboard-data")


@pytest.fixture(scope="module")
def sdk(stack, key):
    with Client(url=stack.url("scheduler"), rollout_url=stack.url("rollout"), api_key=key) as c:
        yield c


@pytest.fixture(autouse=True)
def signed_in_env(monkeypatch, stack, key):
    monkeypatch.setenv("TRAINYARD_URL", stack.url("scheduler"))
    monkeypatch.setenv("TRAINYARD_ROLLOUT_URL", stack.url("rollout"))
    monkeypatch.setenv("TRAINYARD_API_KEY", key)


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
