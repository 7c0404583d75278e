"""Attention takes its head counts from the projections' shapes: a tensor-parallel shard (q/k/v, or MLA's q_b/kv_b,
holding half the heads, o_proj the matching input columns) runs the same code.

Models: the tiny model of every family (tests/conftest.py), float32, CPU. Reference: the unsharded layer's per-head
attention outputs (o_proj's input) restricted to the shard's heads, times the shard's o_proj columns; tolerance
1e-6 absolute. The two halves' outputs also sum to the unsharded layer's (row-parallel o_proj), within 1e-5.
"""
# Shapes: B batch, T tokens, D hidden, X a projection's input width.

import copy

import pytest
import torch
from torch import nn

from kernels import rope_cos_sin
from models import KVCache, load_pretrained
from models.common.blocks import Attention

FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v3")


def _rows(linear: nn.Linear, rows: slice) -> nn.Linear:
    out = nn.Linear(linear.in_features, rows.stop - rows.start, bias=linear.bias is not None)
    out.weight = nn.Parameter(linear.weight[rows].detach().clone())
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias[rows].detach().clone())
    return out


def _columns(linear: nn.Linear, columns: slice, keep_bias: bool) -> nn.Linear:
    out = nn.Linear(columns.stop - columns.start, linear.out_features, bias=keep_bias and linear.bias is not None)
    out.weight = nn.Parameter(linear.weight[:, columns].detach().clone())
    if out.bias is not None:
        out.bias = nn.Parameter(linear.bias.detach().clone())
    return out


def _heads(per_head: int, shard: int) -> slice:
    return slice(shard * per_head, (shard + 1) * per_head)


def shard_attention(attn: nn.Module, args, shard: int) -> nn.Module:
    """Half of attn's heads (shard 0 or 1); the o_proj bias stays on shard 0, added once after the reduce."""
    out = copy.deepcopy(attn)
    H = args.num_heads // 2
    if isinstance(attn, Attention):
        K, Dh = args.num_kv_heads // 2, args.head_dim
        out.q_proj = _rows(attn.q_proj, _heads(H * Dh, shard))
        out.k_proj = _rows(attn.k_proj, _heads(K * Dh, shard))
        out.v_proj = _rows(attn.v_proj, _heads(K * Dh, shard))
        out.o_proj = _columns(attn.o_proj, _heads(H * Dh, shard), keep_bias=shard == 0)
    else:  # MLA: the latent projections are shared; q_b (or q) and kv_b hold per-head rows
        q_name = "q_proj" if args.q_lora_rank is None else "q_b_proj"
        setattr(out, q_name, _rows(getattr(attn, q_name), _heads(H * args.qk_head_dim, shard)))
        out.kv_b_proj = _rows(attn.kv_b_proj, _heads(H * (args.qk_nope_head_dim + args.v_head_dim), shard))
        out.o_proj = _columns(attn.o_proj, _heads(H * args.v_head_dim, shard), keep_bias=shard == 0)
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, family_dirs):
    return load_pretrained(family_dirs[request.param])


def _inputs(model, T: int = 9):
    x_BTD = torch.randn(2, T, model.args.hidden_size, generator=torch.Generator().manual_seed(0))
    inv_freq, factor = model.spec.rope(model.args)
    cos, sin = rope_cos_sin(torch.arange(T).expand(2, T), inv_freq, torch.float32, factor)
    return x_BTD, cos, sin


@torch.no_grad()
def test_a_half_head_shard_equals_the_reference_on_its_heads(model):
    x_BTD, cos, sin = _inputs(model)
    for layer_idx, layer in model.model.layers.items():
        attn = layer.self_attn
        captured = {}
        hook = attn.o_proj.register_forward_pre_hook(lambda m, inp, store=captured: store.__setitem__("o_in", inp[0]))
        full_BTD = attn(x_BTD, cos, sin, None)
        hook.remove()
        o_in_BTX = captured["o_in"]
        shards = [shard_attention(attn, model.args, s) for s in (0, 1)]
        assert shards[0].o_proj.in_features * 2 == attn.o_proj.in_features
        outs = []
        for s, shard in enumerate(shards):
            out_BTD = shard(x_BTD, cos, sin, None)
            columns = _heads(o_in_BTX.shape[-1] // 2, s)
            ref_BTD = torch.nn.functional.linear(o_in_BTX[..., columns], shard.o_proj.weight, shard.o_proj.bias)
            torch.testing.assert_close(out_BTD, ref_BTD, atol=1e-6, rtol=0, msg=f"layer {layer_idx} shard {s}")
            outs.append(out_BTD)
        torch.testing.assert_close(outs[0] + outs[1], full_BTD, atol=1e-5, rtol=0)


@torch.no_grad()
def test_a_model_of_half_head_shards_runs_with_and_without_a_cache(model):
    """Every layer sharded: the whole forward runs (no head count from the config), and a prefill + decode through
    a cache of the shard's kv heads gives the no-cache forward's logits (1e-5)."""
    sharded = copy.deepcopy(model)
    for layer in sharded.model.layers.values():
        layer.self_attn = shard_attention(layer.self_attn, model.args, 0)
    ids_BT = torch.randint(3, 1000, (2, 10), generator=torch.Generator().manual_seed(1))
    full_BTV = sharded(ids_BT)
    assert full_BTV.shape == (2, 10, model.args.vocab_size) and torch.isfinite(full_BTV).all()
    base = KVCache.allocate(model.args, 2, 10, torch.float32, "cpu")
    k_dim, v_dim = base.k_LBKSD.shape[-1], base.v_LBKSD.shape[-1]
    L, B, K, S = base.k_LBKSD.shape[:4]
    cache = KVCache(torch.zeros(L, B, K // 2, S, k_dim), torch.zeros(L, B, K // 2, S, v_dim))
    steps = [sharded(ids_BT[:, :6], cache=cache)] + [sharded(ids_BT[:, t:t + 1], cache=cache) for t in range(6, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), full_BTV, atol=1e-5, rtol=0)
