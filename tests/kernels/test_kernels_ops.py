"""kernels/ reference ops against explicit formulas and against transformers' own implementations."""
# Shapes: B batch, H query heads, K kv heads, T queries, S keys, D head_dim.

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from kernels import apply_rotary, rms_norm, rope_cos_sin, rope_inv_freq
from kernels.attention import attention


def naive_attention(q_BHTD, k_BKSD, v_BKSD, causal, q_offset):
    groups = q_BHTD.shape[1] // k_BKSD.shape[1]
    k_BHSD = k_BKSD.repeat_interleave(groups, dim=1)
    v_BHSD = v_BKSD.repeat_interleave(groups, dim=1)
    scores_BHTS = q_BHTD @ k_BHSD.transpose(-1, -2) / math.sqrt(q_BHTD.shape[-1])
    if causal:
        T, S = q_BHTD.shape[2], k_BKSD.shape[2]
        visible_TS = torch.arange(S)[None, :] <= torch.arange(q_offset, q_offset + T)[:, None]
        scores_BHTS = scores_BHTS.masked_fill(~visible_TS, float("-inf"))
    return scores_BHTS.softmax(-1) @ v_BHSD


@pytest.mark.parametrize(
    "T,S,q_offset,causal",
    [(7, 7, 0, True), (3, 8, 5, True), (1, 9, 8, True), (4, 10, 2, True), (5, 6, 0, False)],
    ids=["full", "chunk", "decode", "middle-chunk", "non-causal"],
)
def test_attention_matches_naive_gqa(T, S, q_offset, causal):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, T, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 3, S, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 3, S, 8, generator=gen, requires_grad=True)
    out = attention(q, k, v, causal=causal, q_offset=q_offset)
    ref = naive_attention(q, k, v, causal, q_offset)
    assert out.shape == (2, 6, T, 8)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, atol=1e-5, rtol=1e-5)


def test_rms_norm_is_bitwise_hf_in_bf16():
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    ref = Qwen3RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.normal_()
    assert torch.equal(rms_norm(x, ref.weight, 1e-6), ref(x))


@pytest.mark.parametrize(
    "config",
    [
        dict(rope_theta=10000.0),
        dict(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ],
    ids=["default", "llama3"],
)
def test_rope_frequencies_match_transformers(config):
    hf_config = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=4, max_position_embeddings=131072, **config
    )
    rope_type = hf_config.rope_parameters["rope_type"]
    if rope_type == "default":
        ref, _ = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(
            hf_config
        )
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    ours = rope_inv_freq(64, config["rope_theta"], config.get("rope_scaling"))
    assert torch.equal(ours, ref.float())


def test_apply_rotary_preserves_norm_and_is_relative():
    inv_freq = rope_inv_freq(16, 10000.0)
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 1, 1, 16)

    def score(pos_q, pos_k):
        cq, sq = rope_cos_sin(torch.tensor([[pos_q]]), inv_freq, torch.float32)
        ck, sk = rope_cos_sin(torch.tensor([[pos_k]]), inv_freq, torch.float32)
        rq, _ = apply_rotary(q, k, cq, sq)
        _, rk = apply_rotary(q, k, ck, sk)
        return (rq[:, :1] * rk).sum()

    # The attention score depends only on the distance between positions.
    torch.testing.assert_close(score(5, 2), score(13, 10), atol=1e-5, rtol=1e-5)
    cos, sin = rope_cos_sin(torch.tensor([[7]]), inv_freq, torch.float32)
    rq, _ = apply_rotary(q, k, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))


def test_unsupported_rope_type_is_a_clear_error():
    with pytest.raises(ValueError, match="Unsupported rope_scaling type 'yarn'.*default, llama3"):
        rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_swiglu_matches_autograd_bitwise():
    """kernels.activations.swiglu keeps only gate and up for backward and recomputes silu(gate): the same ops, so the
    same bits as autograd through F.silu(gate) * up, forward and backward (float32, CPU)."""
    from kernels.activations import swiglu

    gen = torch.Generator().manual_seed(0)
    gate, up, g = (torch.randn(5, 33, generator=gen) for _ in range(3))
    a = [t.clone().requires_grad_() for t in (gate, up)]
    b = [t.clone().requires_grad_() for t in (gate, up)]
    out_a, out_b = swiglu(*a), torch.nn.functional.silu(b[0]) * b[1]
    assert torch.equal(out_a, out_b)
    for x, y in zip(torch.autograd.grad(out_a, a, g), torch.autograd.grad(out_b, b, g)):
        assert torch.equal(x, y)
