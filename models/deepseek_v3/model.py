"""DeepSeek-V3 / Kimi K2's layers: multi-head latent attention (MLA), DeepSeek MoE, YaRN RoPE on the rope dims.

Shapes: B batch, T new tokens, D hidden, H heads, Dn qk_nope_head_dim, Dr qk_rope_head_dim, Dqk = Dn + Dr, Dv
v_head_dim, R kv_lora_rank, X a fused projection's width. In per-head tensors (q_BHTD, v_BHTD, ...) the last axis is
that tensor's head dim (Dqk, Dn, Dr or Dv), as the variable's prefix says.

Module names are transformers' DeepseekV3ForCausalLM's (model.layers.N.self_attn.kv_a_proj_with_mqa, ...,
model.layers.N.mlp.experts.gate_up_proj), so checkpoints and PEFT adapter keys map without renaming. The first
first_k_dense_replace layers have a dense MLP, the rest the shared MoE block of models/moe.py (sigmoid router with
e_score_correction_bias, group-limited top-k, shared experts). The rest of the decoder is models.common's.

MLA here expands the latent into full per-head keys and values before attention and caches those (K: Dqk, V: Dv per
head, via ModelArgs.kv_cache_dims); caching the latent instead (Rkv + Dr per token) is a later memory optimisation
that does not change the numerics contract. See docs/mla.md. Head counts come from q_b_proj's and kv_b_proj's
outputs, so a tensor-parallel shard of them (and of o_proj's input) runs this same code.
"""

import torch
from torch import nn

from kernels import Packing
from kernels.attention import attention
from kernels.rope import apply_rotary, apply_rotary_interleaved, rope_attention_factor, rope_frequencies
from models.common.blocks import MLP, DecoderLayer, RMSNorm
from models.deepseek_v3.args import ModelArgs
from models.kv_cache import KVCache
from models.moe import MLPShape, MoE

# transformers builds q_a_layernorm and kv_a_layernorm without passing rms_norm_eps, so they use this eps.
_LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """Multi-head latent attention: queries through an optional low-rank bottleneck, keys/values through a shared
    Rkv-dim latent plus one Dr-dim rotary key shared by all heads. context_parallel: as models.common.blocks'
    Attention's (ring attention under context parallelism)."""

    context_parallel = None

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.q_lora_rank, self.kv_lora_rank = args.q_lora_rank, args.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
        self.qk_dim = args.qk_head_dim
        self.rope_interleave = args.rope_interleave
        D, H = args.hidden_size, args.num_heads
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, args.q_lora_rank, bias=args.attention_bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(args.q_lora_rank, H * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, args.kv_lora_rank + self.rope_dim, bias=args.attention_bias)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=args.attention_bias)
        # 1/sqrt(Dqk), times YaRN's mscale^2 when the rope is scaled (transformers' softmax_scale).
        self.scale = args.softmax_scale

    def forward(
        self, x_BTD: torch.Tensor, cos_BTDr: torch.Tensor, sin_BTDr: torch.Tensor, cache: KVCache | None,
        packing: Packing | None = None,
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        if self.q_lora_rank is None:
            q_BTX = self.q_proj(x_BTD)
        else:
            q_BTX = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        q_BHTD = q_BTX.view(B, T, -1, self.qk_dim).transpose(1, 2)
        q_nope_BHTD, q_rot_BHTD = torch.split(q_BHTD, [self.nope_dim, self.rope_dim], dim=-1)

        kv_BTX = self.kv_a_proj_with_mqa(x_BTD)
        latent_BTR, k_rot_BTDr = torch.split(kv_BTX, [self.kv_lora_rank, self.rope_dim], dim=-1)
        latent_BTR = self.kv_a_layernorm(latent_BTR)
        k_rot_B1TD = k_rot_BTDr.view(B, 1, T, self.rope_dim)
        rotate = apply_rotary_interleaved if self.rope_interleave else apply_rotary
        q_rot_BHTD, k_rot_B1TD = rotate(q_rot_BHTD, k_rot_B1TD, cos_BTDr, sin_BTDr)

        kv_BHTX = self.kv_b_proj(latent_BTR).view(B, T, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope_BHTD, v_BHTD = torch.split(kv_BHTX, [self.nope_dim, self.v_dim], dim=-1)
        k_BHTD = torch.cat((k_nope_BHTD, k_rot_B1TD.expand(-1, k_nope_BHTD.shape[1], -1, -1)), dim=-1)
        q_BHTD = torch.cat((q_nope_BHTD, q_rot_BHTD), dim=-1)
        if self.context_parallel is not None:  # packing: the row's ContextLayout
            out_BHTD = self.context_parallel.attention(q_BHTD, k_BHTD, v_BHTD, layout=packing, cache=cache,
                                                       scale=self.scale)
        elif cache is None:
            out_BHTD = attention(q_BHTD, k_BHTD, v_BHTD, causal=True, q_offset=0, packing=packing, scale=self.scale)
        else:
            out_BHTD = cache.attend(self.layer_idx, q_BHTD, k_BHTD, v_BHTD, scale=self.scale)
        return self.o_proj(out_BHTD.transpose(1, 2).reshape(B, T, -1))


def decoder_layer(args: ModelArgs, layer_idx: int) -> DecoderLayer:
    """The first first_k_dense_replace layers have a dense MLP, the rest the DeepSeek MoE block."""
    if args.is_moe_layer(layer_idx):
        mlp = MoE(args.moe_args(), layer_idx)
    else:
        mlp = MLP(MLPShape(args.hidden_size, args.intermediate_size))
    return DecoderLayer(MLAttention(args, layer_idx), mlp, args.hidden_size, args.rms_norm_eps)


def rope(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Frequencies of the qk_rope_head_dim rotated dims, and YaRN's attention factor (1 for the other types)."""
    inv_freq, _ = rope_frequencies(args.qk_rope_head_dim, args.rope_theta, args.rope_scaling)
    return inv_freq, rope_attention_factor(args.rope_scaling)
