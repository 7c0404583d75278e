"""Rewards of an RFT job: a callable (completions, rows) -> list[Score], one Score per completion.

A Score's value is the reward, or None with an error (the evaluator raised, returned a non-number, ran out of time):
the loop logs each error to the job's log (row index and message) and counts the sample as reward 0, so one bad row
never ends a job. Uploaded evaluators run in a sandboxed subprocess (services/evaluators/); the built-in ones here are
plain Python, for tests, benchmarks and the arithmetic examples. Both give the sandbox's Score. Torch-free: the scheduler checks evaluator names
against services/common/methods/rft.py's BUILTINS, the names of these.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from services.common.methods.rft import BUILTIN_PREFIX
from services.common.methods.rft import BUILTINS as BUILTIN_NAMES
from services.evaluators.sandbox import Score

NUMBER = re.compile(r"-?\d+")


Reward = Callable[[Sequence[str], Sequence[dict]], list[Score]]


def from_function(fn: Callable[[str, dict], float]) -> Reward:
    """A reward from reward_fn(completion, row) -> float, each row scored alone: an exception or a non-finite /
    non-numeric return becomes that row's error."""
    def reward(completions: Sequence[str], rows: Sequence[dict]) -> list[Score]:
        out = []
        for completion, row in zip(completions, rows):
            try:
                value = fn(completion, row)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
                        or value in (float("inf"), float("-inf")):
                    out.append(Score(None, f"the reward is not a finite number: {value!r}"))
                else:
                    out.append(Score(float(value)))
            except Exception as exc:  # noqa: BLE001 - a user's reward error is the row's, never the job's
                out.append(Score(None, f"{type(exc).__name__}: {exc}"))
        return out
    return reward


def first_number_matches(completion: str, row: dict) -> float:
    """1.0 when the completion's first integer equals row['answer'] (the arithmetic task), else 0.0."""
    match = NUMBER.search(completion)
    return 1.0 if match is not None and int(match.group()) == int(row["answer"]) else 0.0


def exact_match(completion: str, row: dict) -> float:
    """1.0 when the completion, stripped, equals str(row['answer']) stripped, else 0.0."""
    return 1.0 if completion.strip() == str(row["answer"]).strip() else 0.0


def digit_share(completion: str, row: dict) -> float:
    """The share of the completion's characters that are digits (0.0 for an empty one): a graded reward that a
    random-weight model can climb, for smoke tests of the loop."""
    return sum(c.isdigit() for c in completion) / len(completion) if completion else 0.0


BUILTINS: dict[str, Callable[[str, dict], float]] = {
    BUILTIN_PREFIX + "first_number": first_number_matches,
    BUILTIN_PREFIX + "exact_match": exact_match,
    BUILTIN_PREFIX + "digit_share": digit_share,
}
assert tuple(BUILTINS) == BUILTIN_NAMES


def builtin(ref: str) -> Reward:
    return from_function(BUILTINS[ref])
