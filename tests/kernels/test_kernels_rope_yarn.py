"""YaRN rope scaling (kernels/rope.py) against transformers' own rope functions, the named reference.

Tolerance: none. Frequencies, attention factors, cos/sin and the interleaved rotation are compared bitwise
(torch.equal / ==), because we run the same float32 arithmetic in the same order.
"""
# Shapes: B batch, H heads, T tokens, D rotated head dim, F = D // 2 frequencies.

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds

from kernels.rope import (
    apply_rotary_interleaved,
    rope_cos_sin,
    rope_frequencies,
    rope_inv_freq,
    yarn_mscale,
)

YARN_CASES = {
    # The published DeepSeek-V3 rope_scaling (head dim = qk_rope_head_dim = 64).
    "deepseek-v3": {
        "dim": 64, "theta": 10000,
        "scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
    # Kimi K2: beta_fast == beta_slow, so the ramp has zero width before the 0.001 guard.
    "kimi-k2": {
        "dim": 64, "theta": 50000.0,
        "scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                 "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
    # Qwen-style: no mscale fields, so the attention factor is 0.1 ln(factor) + 1.
    "qwen-style": {
        "dim": 128, "theta": 1000000.0,
        "scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    },
    # mscale != mscale_all_dim: a non-trivial attention factor ratio; no truncation of the correction range.
    "mscale-ratio-untruncated": {
        "dim": 32, "theta": 10000.0,
        "scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 16,
                 "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
    },
    "explicit-attention-factor": {
        "dim": 16, "theta": 10000.0,
        "scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                 "attention_factor": 0.75},
    },
}


def _hf_config(case: dict) -> transformers.LlamaConfig:
    params = {**case["scaling"], "rope_theta": case["theta"]}
    params.setdefault("rope_type", params.get("type"))
    return transformers.LlamaConfig(
        hidden_size=case["dim"] * 2, num_attention_heads=2, head_dim=case["dim"], max_position_embeddings=8192,
        rope_parameters=params,
    )


@pytest.mark.parametrize("name", list(YARN_CASES))
def test_yarn_frequencies_and_attention_factor_match_transformers(name):
    case = YARN_CASES[name]
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](_hf_config(case), "cpu")
    inv_freq, factor = rope_frequencies(case["dim"], case["theta"], case["scaling"])
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (case["dim"] // 2,)
    assert torch.equal(inv_freq, ref_inv_freq)
    assert factor == ref_factor
    print(f"{name}: attention factor {factor!r}, inv_freq bitwise equal")


def test_cos_sin_match_deepseek_rotary_embedding():
    """DeepseekV3RotaryEmbedding multiplies cos/sin by the attention factor in float32 before the cast."""
    scaling = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 64, "beta_fast": 32,
               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5}
    config = transformers.DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, qk_rope_head_dim=16, max_position_embeddings=2560,
        rope_scaling=scaling,
    )
    rotary = hf_ds.DeepseekV3RotaryEmbedding(config)
    positions_BT = torch.tensor([[0, 1, 5, 63, 64, 1000, 2559]])
    inv_freq, factor = rope_frequencies(16, 10000.0, scaling)
    assert factor != 1.0
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, dtype=dtype)
        ref_cos, ref_sin = rotary(x, positions_BT)
        cos, sin = rope_cos_sin(positions_BT, inv_freq, dtype, attention_factor=factor)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)


def test_interleaved_rotation_is_bitwise_transformers():
    gen = torch.Generator().manual_seed(0)
    q_BHTD = torch.randn(2, 4, 5, 8, generator=gen)
    k_B1TD = torch.randn(2, 1, 5, 8, generator=gen)
    inv_freq, factor = rope_frequencies(8, 10000.0, YARN_CASES["deepseek-v3"]["scaling"])
    cos, sin = rope_cos_sin(torch.arange(3, 8).expand(2, 5), inv_freq, torch.float32, factor)
    ours = apply_rotary_interleaved(q_BHTD, k_B1TD, cos, sin)
    ref = hf_ds.apply_rotary_pos_emb_interleave(q_BHTD, k_B1TD, cos, sin)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])


@pytest.mark.parametrize("scale,mscale", [(1.0, 1.0), (0.5, 1.0), (40, 1.0), (32.0, 0.707)])
def test_yarn_mscale_matches_transformers(scale, mscale):
    assert yarn_mscale(scale, mscale) == hf_ds.yarn_get_mscale(scale, mscale)


def test_yarn_errors_are_clear():
    with pytest.raises(ValueError, match="Unsupported rope_scaling type 'yarn'.*use rope_frequencies"):
        rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})
    with pytest.raises(ValueError, match="Unsupported rope_scaling type 'dynamic'.*default, llama3, yarn"):
        rope_frequencies(64, 10000.0, {"rope_type": "dynamic", "factor": 4.0})
    with pytest.raises(ValueError, match="missing the field 'original_max_position_embeddings'"):
        rope_frequencies(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="numeric 'factor'"):
        rope_frequencies(64, 10000.0, {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 8})


def test_default_and_llama3_are_unchanged_by_the_new_entry_point():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 32}
    for scaling in (None, llama3):
        inv_freq, factor = rope_frequencies(24, 500000.0, scaling)
        assert torch.equal(inv_freq, rope_inv_freq(24, 500000.0, scaling)) and factor == 1.0
