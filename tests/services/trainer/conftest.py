"""Fixtures for the trainer tests: small JSONL datasets, recorded SFT runs, the in-process Training API platform.

CPU only, float32, offline.
"""

from pathlib import Path

import pytest
import torch
from trainer_helpers import PAIRS, RecordingRun, chat_row, write_jsonl


@pytest.fixture(autouse=True)
def _on_one_thread(one_thread):
    """Every test of the trainer's folder runs on one torch thread (tests/conftest.py's one_thread)."""


@pytest.fixture
def chat_dataset(tmp_path) -> Path:
    """Ten short chat rows."""
    return write_jsonl(tmp_path / "chat.jsonl", [chat_row(a, b) for a, b in PAIRS])


@pytest.fixture
def make_run(tmp_path):
    counter = iter(range(1000))

    def make(**kwargs) -> RecordingRun:
        return RecordingRun(tmp_path / f"saved-{next(counter)}", **kwargs)

    return make


@pytest.fixture
def deterministic():
    """Deterministic kernels for bitwise comparisons (with one_thread's fixed thread count)."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was_deterministic)


@pytest.fixture
def api_env(tmp_path, tiny_model_dir):
    """The Training API's platform in process: SQLite, a real blob store, accounts alice and bob, model "tiny"."""
    from api_helpers import ApiEnv

    env = ApiEnv(tmp_path / "api", tiny_model_dir)
    yield env
    env.close()
