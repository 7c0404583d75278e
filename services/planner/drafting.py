"""Text the Training Agent may ask an LLM that Trainyard serves to draft: the RFT evaluator and a plan's summary in
plain words. The drafting model is any deployment of the account (or a base model), called through the SDK's
sampling (the rollout's Sample RPC), greedy.

The agent works without one, and nothing a drafting model writes is taken on trust: a drafted evaluator replaces the
rules' one only when it parses, defines reward_fn(completion, row), and, run in the server's sandbox (stored nowhere)
on the data set's first rows answered with their own ground truth, scores every one of them 1. Otherwise the rules'
evaluator stays and the plan says why the draft was not used. A model that cannot be reached leaves the plan as the
rules made it, with a note.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass

from trainyard import TrainyardError
from trainyard.client import Client

EVALUATOR_MAX_TOKENS = 768
SUMMARY_MAX_TOKENS = 160
SUMMARY_MAX_CHARS = 700
EXAMPLE_ROWS = 3
TEST_ROWS = 5
_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)

EVALUATOR_SYSTEM = ("You write Python reward functions for reinforcement fine-tuning. Answer with one Python code "
                    "block and nothing else.")
SUMMARY_SYSTEM = "You explain training plans to product teams in plain words."


@dataclass(frozen=True)
class DraftedEvaluator:
    source: str  # the drafting model's evaluator, or "" when it was not used
    reason: str  # why it was used, or why not


class Drafter:
    """Drafts text with model (a deployment's name, or a base model) through client.sample."""

    def __init__(self, client: Client, model: str):
        if not model.strip():
            raise ValueError("model: name the deployment (or base model) that drafts")
        self.client = client
        self.model = model.strip()

    def ask(self, messages: list[dict], max_tokens: int) -> str:
        """The model's greedy answer to a chat; TrainyardError when it cannot be reached."""
        resp = self.client.sample(self.model, messages=messages, temperature=0.0, max_tokens=max_tokens)
        return resp.sequences[0].text if resp.sequences else ""

    # -- the evaluator --------------------------------------------------------------------------------------------
    def evaluator(self, description: str, rows: list[dict], truth: str, rules_source: str) -> DraftedEvaluator:
        """A reward function drafted from the description and the rows, checked as the module docstring says."""
        try:
            answer = self.ask(evaluator_messages(description, rows, truth, rules_source), EVALUATOR_MAX_TOKENS)
        except TrainyardError as exc:
            return DraftedEvaluator("", f"{self.model} could not be reached ({exc.code}: {exc.message})")
        source, problem = check_evaluator_source(answer)
        if problem:
            return DraftedEvaluator("", f"{self.model}'s draft was not used: {problem}")
        tested = rows[:TEST_ROWS]
        try:
            result = score_own_answers(self.client, source, tested, truth)
        except TrainyardError as exc:
            return DraftedEvaluator("", f"{self.model}'s draft was not used: the sandbox refused it ({exc.message})")
        for r in result.results:
            if not r.ok:
                return DraftedEvaluator("", f"{self.model}'s draft was not used: it failed on row {r.row} "
                                            f"({r.error})")
            if r.reward < 1.0 - 1e-9:
                return DraftedEvaluator("", f"{self.model}'s draft was not used: it gave row {r.row}'s own "
                                            f"{truth!r} a reward of {r.reward:.3g}, not 1")
        return DraftedEvaluator(source, f"drafted by {self.model} from the description and the rows; it scored 1 "
                                        f"on the first {len(tested)} rows answered with their {truth!r} field")

    # -- the summary ----------------------------------------------------------------------------------------------
    def summary(self, rendered_plan: str) -> tuple[str, str]:
        """(the plan in a few plain sentences, "") or ("", why there is none)."""
        try:
            text = " ".join(self.ask(summary_messages(rendered_plan), SUMMARY_MAX_TOKENS).split())
        except TrainyardError as exc:
            return "", f"{self.model} could not be reached ({exc.code}: {exc.message})"
        if not text:
            return "", f"{self.model} answered with nothing"
        if len(text) > SUMMARY_MAX_CHARS:
            text = text[:SUMMARY_MAX_CHARS].rsplit(" ", 1)[0] + " ..."
        return text, ""


def score_own_answers(client: Client, source: str, rows: list[dict], truth: str):
    """The evaluator source run in the server's sandbox (stored nowhere) on rows, each answered with its own truth
    field: a right reward_fn scores 1 on every one (an EvaluatorTestResponse)."""
    return client.test_evaluator("", rows=rows, completions=[str(r.get(truth, "")) for r in rows],
                                 content=source.encode())


def evaluator_messages(description: str, rows: list[dict], truth: str, rules_source: str) -> list[dict]:
    """The chat that asks for an evaluator: the task, a few rows, the ground-truth field and the rules' draft."""
    examples = "\n".join(json.dumps(r, ensure_ascii=False) for r in rows[:EXAMPLE_ROWS])
    prompt = (f"Task: {description.strip()}\n\nRows of the training data (JSON), one per line:\n{examples}\n\n"
              f"The row's {truth!r} field holds the right answer. Write\n"
              f"def reward_fn(completion: str, row: dict) -> float\n"
              f"returning 1.0 for a completion that is right for the row and less for one that is not, using the "
              f"standard library only. Start from this one and improve it for the task:\n"
              f"```python\n{rules_source}```")
    return [{"role": "system", "content": EVALUATOR_SYSTEM}, {"role": "user", "content": prompt}]


def summary_messages(rendered_plan: str) -> list[dict]:
    """The chat that asks for a plan in plain words."""
    prompt = (f"This is a fine-tuning plan:\n\n{rendered_plan}\n\nIn at most three sentences, say what this run "
              "will do and what to watch for. No lists.")
    return [{"role": "system", "content": SUMMARY_SYSTEM}, {"role": "user", "content": prompt}]


def check_evaluator_source(answer: str) -> tuple[str, str]:
    """(source, "") when answer holds Python that defines reward_fn(completion, row), else ("", the problem). The
    code is the answer's first fenced block, or the whole answer when it has none."""
    block = _CODE_BLOCK.search(answer)
    source = (block.group(1) if block else answer).strip()
    if not source:
        return "", "its answer holds no code"
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return "", f"its code does not parse (line {exc.lineno}: {exc.msg})"
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "reward_fn"), None)
    if fn is None:
        return "", "its code defines no reward_fn at module level"
    params = fn.args.posonlyargs + fn.args.args
    if len(params) < 2 and fn.args.vararg is None:
        return "", f"its reward_fn takes {len(params)} argument(s), not (completion, row)"
    return source + "\n", ""
