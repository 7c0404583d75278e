"""Single-device dense decoder for Llama 3 / Qwen2 / Qwen3, shared by the trainer and the rollout.

Shapes: B batch, T new tokens, S cached+new keys, L layers, D hidden, H query heads, K kv heads, Dh head_dim,
F intermediate, V vocab.

Module names are identical to transformers' *ForCausalLM (model.layers.N.self_attn.q_proj, ...), so Hugging Face
checkpoints and PEFT adapter keys map onto this model without renaming. Parallelism is applied from outside; nothing
here knows about meshes. There is no attention mask argument: attention is causal, so right-padded rows need none
(trailing pads never influence earlier tokens), and with a KVCache every row shares one length.
"""

import torch
import torch.nn.functional as F
from torch import nn

from kernels import Packing, apply_rotary, rms_norm, rope_cos_sin, rope_inv_freq
from kernels.attention import attention
from models.kv_cache import KVCache
from models.llama.args import ModelArgs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
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
        self, x_BTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor, cache: KVCache | None,
        packing: Packing | None = None,
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q_BTHD = self.q_proj(x_BTD).view(B, T, self.num_heads, self.head_dim)
        k_BTKD = self.k_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        v_BTKD = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_BTHD, k_BTKD = self.q_norm(q_BTHD), self.k_norm(k_BTKD)
        q_BHTD, k_BKTD = apply_rotary(q_BTHD.transpose(1, 2), k_BTKD.transpose(1, 2), cos_BTD, sin_BTD)
        v_BKTD = v_BTKD.transpose(1, 2)
        if cache is None:
            out_BHTD = attention(q_BHTD, k_BKTD, v_BKTD, causal=True, q_offset=0, packing=packing)
        else:
            out_BHTD = cache.attend(self.layer_idx, q_BHTD, k_BKTD, v_BKTD)
        return self.o_proj(out_BHTD.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        D, F_ = args.hidden_size, args.intermediate_size
        self.gate_proj = nn.Linear(D, F_, bias=args.mlp_bias)
        self.up_proj = nn.Linear(D, F_, bias=args.mlp_bias)
        self.down_proj = nn.Linear(F_, D, bias=args.mlp_bias)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_BTD)) * self.up_proj(x_BTD))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self, h_BTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor, cache: KVCache | None,
        packing: Packing | None = None,
    ) -> torch.Tensor:
        h_BTD = h_BTD + self.self_attn(self.input_layernorm(h_BTD), cos_BTD, sin_BTD, cache, packing)
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD))


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
        routing=None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """Logits [B,T,V], or the final-normed hidden states [B,T,D] with return_hidden (so a caller can compute
        logprobs in chunks without materialising [B,T,V]).

        With a cache the tokens are written at cache.length.. and cache.length advances by T. With packing (B = 1)
        the row holds several documents: attention stays within each, and positions restart at 0 in each unless
        positions_BT is given. routing (router replay) concerns MoE families; a dense model has no router."""
        del routing
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
        cos_BTD, sin_BTD = rope_cos_sin(positions_BT, self._rope_inv_freq(h_BTD.device), h_BTD.dtype)
        for layer in self.model.layers:
            h_BTD = layer(h_BTD, cos_BTD, sin_BTD, cache, packing)
        if cache is not None:
            cache.length += T
        h_BTD = self.model.norm(h_BTD)
        return h_BTD if return_hidden else self.logits(h_BTD)

    def _rope_inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            inv_freq = rope_inv_freq(self.args.head_dim, self.args.rope_theta, self.args.rope_scaling)
            self._inv_freq[device] = inv_freq.to(device)
        return self._inv_freq[device]

    def logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_BTD)
