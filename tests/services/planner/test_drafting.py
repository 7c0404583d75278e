"""What the agent accepts from a drafting model before testing it in the sandbox (drafting.check_evaluator_source),
and the requests it sends."""
from __future__ import annotations

import pytest

from services.planner import drafting

GOOD = "def reward_fn(completion, row):\n    return 1.0\n"


@pytest.mark.parametrize("answer", [
    f"Here it is:\n```python\n{GOOD}```\nIt rewards everything.",
    f"```py\n{GOOD}```",
    f"```\n{GOOD}```",
    GOOD,  # no fence: the whole answer
])
def test_the_first_code_block_or_the_whole_answer_is_the_source(answer):
    assert drafting.check_evaluator_source(answer) == (GOOD, "")


@pytest.mark.parametrize("answer, problem", [
    ("", "its answer holds no code"),
    ("```python\n```", "its answer holds no code"),
    ("retion.0 = completion, row) words", "its code does not parse (line 1: "),
    ("def score(completion, row):\n    return 1.0\n", "its code defines no reward_fn at module level"),
    ("class A:\n    def reward_fn(self, completion, row):\n        return 1.0\n",
     "its code defines no reward_fn at module level"),
    ("def reward_fn(completion):\n    return 1.0\n", "its reward_fn takes 1 argument(s), not (completion, row)"),
])
def test_an_answer_that_is_no_evaluator_is_refused_with_the_reason(answer, problem):
    source, got = drafting.check_evaluator_source(answer)
    assert source == "" and got.startswith(problem)


def test_varargs_reward_fn_is_accepted():
    assert drafting.check_evaluator_source("def reward_fn(*args):\n    return 0.0\n")[1] == ""


def test_the_evaluator_request_shows_the_task_rows_truth_field_and_the_rules_draft():
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(5)]
    system, user = drafting.evaluator_messages("  Add numbers. ", rows, "answer", GOOD)
    assert system["role"] == "system" and user["role"] == "user"
    text = user["content"]
    assert text.startswith("Task: Add numbers.\n")
    assert '{"prompt": "q2", "answer": "2"}' in text and '"q3"' not in text  # the first EXAMPLE_ROWS rows only
    assert "The row's 'answer' field holds the right answer" in text and f"```python\n{GOOD}```" in text


def test_a_drafter_needs_a_model_name():
    with pytest.raises(ValueError, match="model: name the deployment"):
        drafting.Drafter(None, "  ")
