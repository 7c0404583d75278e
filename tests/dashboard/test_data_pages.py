"""The Datasets, Describe-and-plan and Train pages through Streamlit's AppTest, against the real service stack
(tests/conftest.py `stack`), with an account of this module's own."""
from __future__ import annotations

import json

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
