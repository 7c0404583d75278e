"""Fixtures for the rollout tests: a shared engine and LoRA adapters on the tiny models (tests/conftest.py builds
them once per session).

CPU only, float32, offline. The numerical reference and the engine-driving helpers are in rollout_reference.py.
"""

from pathlib import Path

import pytest
from rollout_reference import SMALL_POOL_MB, write_adapter

from services.rollout.engine import Engine


PROMPT = "The quick brown fox"


@pytest.fixture(autouse=True)
def _on_one_thread(one_thread):
    """Every test of the rollout's folder runs on one torch thread (tests/conftest.py's one_thread)."""


@pytest.fixture(scope="session")
def engine() -> Engine:
    engine = Engine(max_loaded_adapters=4, kv_cache_mb=SMALL_POOL_MB)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def prompt_ids(engine, tiny_model_dir) -> list[int]:
    return list(engine.base(str(tiny_model_dir)).tokenizer(PROMPT)["input_ids"])


@pytest.fixture(scope="session")
def adapter_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "zero": write_adapter(tiny_model_dir, root / "zero", seed=1, b_scale=0.0),
        "a": write_adapter(tiny_model_dir, root / "a", seed=2, b_scale=0.5),
        "b": write_adapter(tiny_model_dir, root / "b", seed=3, b_scale=0.5),
        "c": write_adapter(tiny_model_dir, root / "c", seed=4, b_scale=0.5),
    }
