"""TestEvaluator's rows: given in the request (JSON objects, with completions) or read from one of the account's
datasets; then the evaluator store runs them in the sandbox (services/evaluators/store.py)."""
from __future__ import annotations

import json
from collections.abc import Sequence

from services.common.errors import InvalidArgument, Violation
from services.common.evaluator_refs import parse_ref
from services.evaluators.store import EvaluationReport, EvaluatorStore
from services.scheduler.datasets import DatasetStore

DEFAULT_TEST_ROWS = 10


def completion_of(row: dict) -> str:
    """A dataset row's own completion: its "completion", else the last assistant message of its "messages"."""
    if isinstance(row.get("completion"), str):
        return row["completion"]
    for message in reversed(row.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "assistant" and isinstance(message.get("content"), str):
            return message["content"]
    return ""


class EvaluatorCore:
    def __init__(self, store: EvaluatorStore, datasets: DatasetStore, max_rows: int):
        self.store = store
        self.datasets = datasets
        self.max_rows = max_rows

    def test(self, account_id: str, ref: str, rows: Sequence[str], completions: Sequence[str], dataset_id: str,
             num_rows: int, content: bytes = b"") -> EvaluationReport:
        """A stored evaluator (ref) or an unsaved one (content: its source or package) on the rows."""
        if content and ref:
            raise InvalidArgument("give a stored evaluator or content, not both", field="content")
        if not content:
            parse_ref(ref)
        if rows and dataset_id:
            raise InvalidArgument("give rows or a dataset, not both", field="dataset_id")
        if dataset_id:
            if not 0 <= num_rows <= self.max_rows:
                raise InvalidArgument(f"must be between 1 and {self.max_rows} (0 = {DEFAULT_TEST_ROWS}), got "
                                      f"{num_rows}", field="num_rows")
            if not content:
                self.store.get(account_id, ref)  # an unknown evaluator is reported before the dataset is read
            _, parsed = self.datasets.preview(account_id, dataset_id, 0, num_rows or DEFAULT_TEST_ROWS)
        else:
            if not rows:
                raise InvalidArgument("give rows (JSON objects) or a dataset_id", field="rows")
            if len(rows) > self.max_rows:
                raise InvalidArgument(f"{len(rows)} rows; at most {self.max_rows} per test", field="rows")
            parsed = _parse_rows(rows)
        if len(completions) > len(parsed):
            raise InvalidArgument(f"{len(completions)} completions for {len(parsed)} rows", field="completions")
        items = [(completions[i] if i < len(completions) else completion_of(row), row) for i, row in enumerate(parsed)]
        return self.store.test_content(content, items) if content else self.store.test(account_id, ref, items)


def _parse_rows(rows: Sequence[str]) -> list[dict]:
    parsed, problems = [], []
    for i, text in enumerate(rows, 1):
        try:
            row = json.loads(text)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
            problems.append(Violation(field="rows", reason=f"not JSON: {exc}", row=i))
            continue
        if not isinstance(row, dict):
            problems.append(Violation(field="rows", reason=f"a JSON {type(row).__name__}, not an object", row=i))
            continue
        parsed.append(row)
    if problems:
        raise InvalidArgument(violations=problems)
    return parsed
