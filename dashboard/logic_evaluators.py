"""What the Evaluators page computes, without Streamlit: tables of evaluators and of a test's per-row results, and the
rows a user pastes (JSONL) for "Test on N rows"."""
from __future__ import annotations

import json

import pandas as pd

from dashboard.logic import when
from trainyard.v1 import scheduler_pb2 as pb

UPLOAD_TYPES = ["py", "zip", "gz", "tgz"]
EDITOR_TEST_ROWS = 5  # "Test on 5 rows" of the editor
_ARCHIVE_MAGIC = (b"PK\x03\x04", b"\x1f\x8b")  # .zip, .tar.gz


def evaluators_frame(evaluators: list[pb.Evaluator]) -> pd.DataFrame:
    return pd.DataFrame([{"name": e.name, "version": e.version, "kind": e.kind, "id": e.id, "file": e.filename,
                          "size (KB)": round(e.size_bytes / 1024, 1), "created (UTC)": when(e.created_at)}
                         for e in evaluators])


def evaluator_label(e: pb.Evaluator) -> str:
    return f"{e.name}@{e.version} · {e.kind}"


def parse_rows(text: str) -> tuple[list[dict], list[str]]:
    """JSONL rows (a row's own "completion" is the completion tested) and the problems, each naming its line."""
    rows, problems = [], []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            problems.append(f"line {lineno}: not JSON ({exc})")
            continue
        if not isinstance(row, dict):
            problems.append(f"line {lineno}: a JSON {type(row).__name__}, not an object")
            continue
        rows.append(row)
    return rows, problems


def results_frame(resp: pb.EvaluatorTestResponse) -> pd.DataFrame:
    """One line per tested row: its completion and reward, or the error that replaced the reward."""
    return pd.DataFrame([{"row": r.row, "completion": r.completion, "reward": r.reward if r.ok else None,
                          "error": r.error} for r in resp.results])


def source_text(source: pb.EvaluatorSource) -> str | None:
    """evaluator.py's text for the editor; None for a package (.zip / .tar.gz), which is edited as files."""
    if source.content.startswith(_ARCHIVE_MAGIC):
        return None
    try:
        return source.content.decode()
    except UnicodeDecodeError:
        return None
