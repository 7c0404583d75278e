"""Single-device DeepSeek-V3 / Kimi K2 decoder: multi-head latent attention (MLA) and DeepSeek MoE layers.

Shapes: B batch, T new tokens, S cached+new keys, D hidden, H heads, Dn qk_nope_head_dim, Dr qk_rope_head_dim,
Dqk = Dn + Dr, Dv v_head_dim, R kv_lora_rank, X a fused projection's width, V vocab. In per-head tensors (q_BHTD,
v_BHSD, ...) the last axis is that tensor's head dim (Dqk, Dn, Dr or Dv), as the variable's prefix says.

Module names are transformers' DeepseekV3ForCausalLM's (model.layers.N.self_attn.kv_a_proj_with_mqa, ...,
model.layers.N.mlp.experts.gate_up_proj), so checkpoints and PEFT adapter keys map without renaming. The first
first_k_dense_replace layers have a dense MLP, the rest the shared MoE block of models/moe.py (sigmoid router with
e_score_correction_bias, group-limited top-k, shared experts).

MLA here expands the latent into full per-head keys and values before attention and caches those (K: Dqk, V: Dv per
head, via ModelArgs.kv_cache_dims); caching the latent instead (Rkv + Dr per token) is a later memory optimisation
that does not change the numerics contract. See docs/mla.md.
"""

import torch
from torch import nn

from kernels import Packing
from kernels.attention import attention
from kernels.rope import (
    apply_rotary,
    apply_rotary_interleaved,
    rope_attention_factor,
    rope_cos_sin,
    rope_frequencies,
)
from models.deepseek_v3.args import ModelArgs
from models.kv_cache import KVCache
from models.llama.model import MLP, RMSNorm
from models.moe import MLPShape, MoE, RouterReplay

# transformers builds q_a_layernorm and kv_a_layernorm without passing rms_norm_eps, so they use this eps.
_LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """Multi-head latent attention: queries through an optional low-rank bottleneck, keys/values through a shared
    Rkv-dim latent plus one Dr-dim rotary key shared by all heads."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = args.num_heads
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
        H = self.num_heads
        if self.q_lora_rank is None:
            q_BTX = self.q_proj(x_BTD)
        else:
            q_BTX = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        q_BHTD = q_BTX.view(B, T, H, self.qk_dim).transpose(1, 2)
        q_nope_BHTD, q_rot_BHTD = torch.split(q_BHTD, [self.nope_dim, self.rope_dim], dim=-1)

        kv_BTX = self.kv_a_proj_with_mqa(x_BTD)
        latent_BTR, k_rot_BTDr = torch.split(kv_BTX, [self.kv_lora_rank, self.rope_dim], dim=-1)
        latent_BTR = self.kv_a_layernorm(latent_BTR)
        k_rot_B1TD = k_rot_BTDr.view(B, 1, T, self.rope_dim)
        rotate = apply_rotary_interleaved if self.rope_interleave else apply_rotary
        q_rot_BHTD, k_rot_B1TD = rotate(q_rot_BHTD, k_rot_B1TD, cos_BTDr, sin_BTDr)

        kv_BHTX = self.kv_b_proj(latent_BTR).view(B, T, H, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope_BHTD, v_BHTD = torch.split(kv_BHTX, [self.nope_dim, self.v_dim], dim=-1)
        k_BHTD = torch.cat((k_nope_BHTD, k_rot_B1TD.expand(B, H, T, self.rope_dim)), dim=-1)
        q_BHTD = torch.cat((q_nope_BHTD, q_rot_BHTD), dim=-1)
        if cache is None:
            out_BHTD = attention(q_BHTD, k_BHTD, v_BHTD, causal=True, q_offset=0, packing=packing, scale=self.scale)
        else:
            out_BHTD = cache.attend(self.layer_idx, q_BHTD, k_BHTD, v_BHTD, scale=self.scale)
        return self.o_proj(out_BHTD.transpose(1, 2).reshape(B, T, H * self.v_dim))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = MLAttention(args, layer_idx)
        if args.is_moe_layer(layer_idx):
            self.mlp = MoE(args.moe_args, layer_idx)
        else:
            self.mlp = MLP(MLPShape(args.hidden_size, args.intermediate_size))
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, h_BTD: torch.Tensor, cos_BTDr: torch.Tensor, sin_BTDr: torch.Tensor, cache: KVCache | None,
        packing: Packing | None, routing: RouterReplay | None,
    ) -> torch.Tensor:
        h_BTD = h_BTD + self.self_attn(self.input_layernorm(h_BTD), cos_BTDr, sin_BTDr, cache, packing)
        x_BTD = self.post_attention_layernorm(h_BTD)
        return h_BTD + (self.mlp(x_BTD, routing) if isinstance(self.mlp, MoE) else self.mlp(x_BTD))


class DecoderStack(nn.Module):
    """The `model.` prefix of HF checkpoints: embeddings, layers, final norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = DecoderStack(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.tie_weights()
        # float32 RoPE frequencies per device; a plain dict, not a buffer, so model.to(bf16) cannot round them.
        self._inv_freq: dict[torch.device, torch.Tensor] = {}
        self._rope_attention_factor = rope_attention_factor(args.rope_scaling)

    def tie_weights(self) -> None:
        """Share one Parameter between embed_tokens and lm_head when the config ties them (also after a
        meta-device load, where assign=True replaces parameters and breaks the sharing)."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        cache: KVCache | None = None,
        *,
        packing: Packing | None = None,
        routing: RouterReplay | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Logits [B,T,V], or the final-normed hidden states [B,T,D] with return_hidden (so a caller can compute
        logprobs in chunks without materialising [B,T,V]).

        With a cache the tokens are written at cache.length.. and cache.length advances by T. With packing (B = 1)
        the row holds several documents: attention stays within each, and positions restart at 0 in each unless
        positions_BT is given. routing: a RouterReplay that records the experts every MoE layer picks, or forces
        them."""
        B, T = input_ids_BT.shape
        offset = 0 if cache is None else cache.length
        if cache is not None and offset + T > cache.max_len:
            raise ValueError(
                f"KVCache overflow: {offset} cached + {T} new tokens exceeds max_len={cache.max_len}; "
                "allocate a larger cache"
            )
        if packing is not None and cache is not None:
            raise ValueError("packing is for training rows; it cannot be combined with a KV cache")
        if positions_BT is None:
            if packing is not None:
                positions_BT = packing.positions().to(input_ids_BT.device)
            else:
                positions_BT = torch.arange(offset, offset + T, device=input_ids_BT.device).expand(B, T)
        h_BTD = self.model.embed_tokens(input_ids_BT)
        cos_BTDr, sin_BTDr = rope_cos_sin(
            positions_BT, self._rope_inv_freq(h_BTD.device), h_BTD.dtype, self._rope_attention_factor
        )
        for layer in self.model.layers:
            h_BTD = layer(h_BTD, cos_BTDr, sin_BTDr, cache, packing, routing)
        if cache is not None:
            cache.length += T
        h_BTD = self.model.norm(h_BTD)
        return h_BTD if return_hidden else self.logits(h_BTD)

    def _rope_inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            inv_freq, _ = rope_frequencies(self.args.qk_rope_head_dim, self.args.rope_theta, self.args.rope_scaling)
            self._inv_freq[device] = inv_freq.to(device)
        return self._inv_freq[device]

    def logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_BTD)
