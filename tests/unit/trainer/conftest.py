"""Fixtures for the trainer tests: the tiny model directory, small JSONL datasets and recording hooks.

CPU only, float32, offline.
"""

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from trainer_helpers import PAIRS, RecordingHooks, chat_row, write_jsonl  # noqa: E402

from models.tiny import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture
def chat_dataset(tmp_path) -> Path:
    """Ten short chat rows."""
    return write_jsonl(tmp_path / "chat.jsonl", [chat_row(a, b) for a, b in PAIRS])


@pytest.fixture
def make_hooks(tmp_path):
    counter = iter(range(1000))

    def make(**kwargs) -> RecordingHooks:
        return RecordingHooks(tmp_path / f"saved-{next(counter)}", **kwargs)

    return make


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model's ops are too small to gain from threads; on a busy machine they lose a lot to contention,
    and a fixed count keeps results reproducible."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
