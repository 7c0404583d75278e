"""Fixtures for the models/ tests: tiny random Hugging Face reference models (the tiny model directories of every
family come from tests/conftest.py).

Everything runs offline on CPU in float32; transformers is the named numerical reference throughout.
"""

import pytest
import torch
import transformers

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

# Small but exercising every switch: GQA, head_dim != hidden/heads, biases, llama3 rope scaling, tied embeddings.
_COMMON = dict(
    vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
)
HF_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        **_COMMON, head_dim=24, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON, tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=False),
}
HF_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
}


def make_hf_model(family: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A transformers *ForCausalLM with every parameter perturbed (HF initialises norms to 1 and biases to 0,
    which would hide mistakes in those paths)."""
    torch.manual_seed(seed)
    model = HF_CLASSES[family](HF_CONFIGS[family]()).float()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


@pytest.fixture(scope="session")
def hf_model_dirs(tmp_path_factory):
    """family -> directory written by transformers' save_pretrained (plus the in-memory model)."""
    dirs = {}
    for family in HF_CLASSES:
        model = make_hf_model(family)
        path = tmp_path_factory.mktemp(f"hf_{family}")
        model.save_pretrained(path)
        dirs[family] = (path, model)
    return dirs
