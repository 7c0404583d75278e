"""The blocks every decoder family shares: RMSNorm, grouped-query attention (optional q/k RMSNorm), the SwiGLU MLP,
and the pre-norm residual layer that wraps an attention and an MLP.

Shapes: B batch, T new tokens, D hidden, H query heads, K kv heads, Dh head_dim, R rotated dims (= Dh here), F
intermediate.

Module names are transformers' (self_attn.q_proj, mlp.gate_proj, input_layernorm, ...). Head counts are read from
the projections' outputs (`view(B, T, -1, Dh)`), never from the config, so a tensor-parallel shard of q/k/v/o (fewer
heads per rank) runs this same code. There is no attention mask argument: attention is causal, so right-padded rows
need none (trailing pads never influence earlier tokens), and with a KVCache every row shares one length.
"""

import torch
from torch import nn

from kernels import Packing, apply_rotary, rms_norm, swiglu
from kernels.attention import attention
from models.kv_cache import KVCache
from models.lora_layers import project


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention with half-split RoPE; Qwen3's per-head q/k RMSNorm when args.qk_norm.

    args: any ModelArgs with hidden_size, num_heads, num_kv_heads, head_dim, qkv_bias, o_bias, qk_norm,
    rms_norm_eps. layer_idx is the layer's number in the whole model, under which its KV cache entries live.
    context_parallel: set by services.trainer.engine.parallel.context.apply_context_parallel (ring attention over
    the cp ranks, the row's ContextLayout passed as `packing`); None runs kernels.attention."""

    context_parallel = None

    def __init__(self, args, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = args.head_dim
        D, Dh = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(D, args.num_heads * Dh, bias=args.qkv_bias)
        self.k_proj = nn.Linear(D, args.num_kv_heads * Dh, bias=args.qkv_bias)
        self.v_proj = nn.Linear(D, args.num_kv_heads * Dh, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * Dh, D, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(Dh, args.rms_norm_eps)
            self.k_norm = RMSNorm(Dh, args.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self, x_BTD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor, cache: KVCache | None,
        packing: Packing | None = None,
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BTX, k_BTX, v_BTX = project(x_BTD, (self.q_proj, self.k_proj, self.v_proj))
        q_BTHD = q_BTX.view(B, T, -1, self.head_dim)
        k_BTKD = k_BTX.view(B, T, -1, self.head_dim)
        v_BTKD = v_BTX.view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q_BTHD, k_BTKD = self.q_norm(q_BTHD), self.k_norm(k_BTKD)
        q_BHTD, k_BKTD = apply_rotary(q_BTHD.transpose(1, 2), k_BTKD.transpose(1, 2), cos_BTR, sin_BTR)
        v_BKTD = v_BTKD.transpose(1, 2)
        if self.context_parallel is not None:  # packing: the row's ContextLayout
            out_BHTD = self.context_parallel.attention(q_BHTD, k_BKTD, v_BKTD, layout=packing, cache=cache)
        elif cache is None:
            out_BHTD = attention(q_BHTD, k_BKTD, v_BKTD, causal=True, q_offset=0, packing=packing)
        else:
            out_BHTD = cache.attend(self.layer_idx, q_BHTD, k_BKTD, v_BKTD)
        return self.o_proj(out_BHTD.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU. args: hidden_size, intermediate_size, mlp_bias (a ModelArgs, or models.moe.MLPShape for another
    width)."""

    def __init__(self, args):
        super().__init__()
        D, F_ = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(D, F_, bias=args.mlp_bias)
        self.up_proj = nn.Linear(D, F_, bias=args.mlp_bias)
        self.down_proj = nn.Linear(F_, D, bias=args.mlp_bias)

    def forward(self, x_BTD: torch.Tensor, routing=None) -> torch.Tensor:
        del routing  # a layer passes its router replay to whichever MLP it holds; a dense one has no router
        gate_BTF, up_BTF = project(x_BTD, (self.gate_proj, self.up_proj))
        return self.down_proj(swiglu(gate_BTF, up_BTF))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h + attn(norm(h)), then h + mlp(norm(h)). A family chooses the attention (GQA, MLA)
    and the MLP (dense, MoE) of each layer: self_attn(x, cos, sin, cache, packing) and mlp(x, routing)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(
        self, h_BTD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor, cache: KVCache | None,
        packing: Packing | None = None, routing=None,
    ) -> torch.Tensor:
        h_BTD = h_BTD + self.self_attn(self.input_layernorm(h_BTD), cos_BTR, sin_BTR, cache, packing)
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD), routing)
