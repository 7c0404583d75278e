"""Fixtures for the rollout tests: the tiny model directory, a shared engine and LoRA adapters.

CPU only, float32, offline. The numerical reference is in rollout_reference.py.
"""

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from models import load_pretrained  # noqa: E402
from models.lora import LoraConfig, apply_lora, save_peft_adapter  # noqa: E402
from models.tiny import build_tiny_model  # noqa: E402
from services.rollout.engine import Engine  # noqa: E402

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matmuls are far too small for intra-op threads; on a shared 2-core box they only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def engine() -> Engine:
    return Engine(max_loaded_adapters=4)


@pytest.fixture(scope="session")
def prompt_ids(engine, tiny_model_dir) -> list[int]:
    return list(engine.base(str(tiny_model_dir)).tokenizer(PROMPT)["input_ids"])


def write_adapter(model_dir: Path, out_dir: Path, *, seed: int, b_scale: float) -> Path:
    """A PEFT adapter for the tiny model: A from the seed, B ~ N(0, b_scale) (b_scale 0: B is zeros, as peft
    initialises it, so the adapter must not change the outputs)."""
    model = load_pretrained(model_dir)
    cfg = LoraConfig(rank=4, alpha=8.0)
    params = apply_lora(model, cfg, "default", seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lora_B in params[1::2]:  # apply_lora returns [A, B] per wrapped layer
            lora_B.copy_(torch.randn(lora_B.shape, generator=generator) * b_scale)
    save_peft_adapter(model, cfg, out_dir, str(model_dir))
    return out_dir


@pytest.fixture(scope="session")
def adapter_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "zero": write_adapter(tiny_model_dir, root / "zero", seed=1, b_scale=0.0),
        "a": write_adapter(tiny_model_dir, root / "a", seed=2, b_scale=0.5),
        "b": write_adapter(tiny_model_dir, root / "b", seed=3, b_scale=0.5),
        "c": write_adapter(tiny_model_dir, root / "c", seed=4, b_scale=0.5),
    }
